"""Qwen3-VL as a token-RL policy and as a judge, on the tiny random Qwen3-VL: its own processor geometry,
the real loader (``model.path=``), ``check-onpolicy`` exact and failing once the weights move, token
GRPO / StepGRPO through the CLI changing every LoRA tensor, and the ``qwenvl`` judge loading it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from rlgen_cli.rewards.base import RewardBatch
from rlgen_cli.rewards.registry import build_reward
from rlgen_cli.schema.check import TEXT_TOLERANCE
from tests.conftest import run_cli
from tests.vlm.conftest import TINY_VLM, compose_config

TINY_QWEN3_VL = ["model=tiny_qwen3_vl" if arg == "model=tiny_qwen2_vl" else arg for arg in TINY_VLM]
REPORT_ROW = "│"


def _max_error(out: str) -> float:
    line = next(line for line in out.splitlines() if "sampler): max error" in line)
    return float(line.split("max error")[1].split()[0])


@pytest.fixture(scope="module")
def qwen3_vl_dir(tmp_path_factory) -> Path:
    from rlgen_cli.models.tiny import save_tiny_qwen3_vl

    return save_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"))


def test_processor_has_qwen3_vl_geometry_and_chat_template():
    from rlgen_cli.models.tiny import tiny_qwen3_vl, tiny_qwen3_vl_processor

    processor = tiny_qwen3_vl_processor(min_pixels=64, max_pixels=1024)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # Qwen3-VL Instruct inserts no default system prompt (Qwen2-VL's template does)
    assert (
        text
        == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    )
    # 28 × 20 px snaps to multiples of patch 4 × merge 2 = 8: 32 × 16 → an 8 × 4 patch grid → 8 merged tokens
    encoded = processor(text=[text], images=[Image.new("RGB", (20, 28))], return_tensors="pt")
    assert encoded["image_grid_thw"].tolist() == [[1, 8, 4]]
    assert int((encoded["input_ids"] == processor.image_token_id).sum()) == 8
    assert int(encoded["mm_token_type_ids"].sum()) == 8  # the image tokens are type 1 for M-RoPE
    config = tiny_qwen3_vl(processor).config
    assert config.vision_config.patch_size == 4 and config.vision_config.deepstack_visual_indexes == [0, 1]
    assert config.text_config.rope_parameters["mrope_section"] == [4, 2, 2]  # 8 = head_dim 16 / 2


def test_real_loader_reads_a_saved_qwen3_vl_with_the_configured_pixel_bounds(qwen3_vl_dir, tmp_path):
    from rlgen_cli.errors import UserError
    from rlgen_cli.vlm.policy import build_vlm
    from rlgen_cli.vlm.rollout import encode_prompts

    typed, _ = compose_config(
        "train",
        [
            *TINY_QWEN3_VL,
            "algo=token_grpo",
            "reward=length",
            "model.tiny=false",
            f"model.path={qwen3_vl_dir}",
            "model.local_files_only=true",
            "model.vlm.max_pixels=256",
        ],
    )
    policy = build_vlm(typed.model, torch.device("cpu"))
    assert type(policy.model.base_model.model).__name__ == "Qwen3VLForConditionalGeneration"
    lora = [name for name, _ in policy.model.named_parameters() if "lora_" in name]
    assert lora and not any("visual" in name for name in lora)  # LoRA on the language model only
    assert len(policy.suppressed_ids) == 4 and len(policy.stop_ids) == 2
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    encoded = encode_prompts(policy, ["<|vision_start|><|image_pad|><|vision_end|>hi"], [image])
    assert encoded["image_grid_thw"].tolist() == [[1, 4, 4]]  # 32² px > 256 → 16² px: 4 × 4 patches of 4 px
    bad, _ = compose_config(
        "train",
        [
            *TINY_QWEN3_VL,
            "algo=token_grpo",
            "reward=length",
            "model.tiny=false",
            f"model.path={tmp_path / 'absent'}",
            "model.local_files_only=true",
        ],
    )
    with pytest.raises(UserError, match="cannot load qwen3_vl"):
        build_vlm(bad.model, torch.device("cpu"))


def test_check_onpolicy_is_exact_for_tiny_qwen3_vl(tmp_path: Path):
    args = [*TINY_QWEN3_VL, "algo=token_grpo", "reward=length", f"hydra.run.dir={tmp_path}"]
    code, out = run_cli("check-onpolicy", *args)
    assert code == 0, out
    assert "PASS text (hf sampler): max error" in out
    assert sum(line.startswith(REPORT_ROW) for line in out.splitlines()) == 4  # 2 prompts × 2 completions
    assert _max_error(out) <= TEXT_TOLERANCE  # measured 4.8e-7 in fp32 (KV cache vs full forward)


def test_check_onpolicy_fails_when_the_qwen3_vl_weights_move(tmp_path: Path):
    args = [*TINY_QWEN3_VL, "algo=token_grpo", "reward=length", "check.perturb_weights=1e-3"]
    code, out = run_cli("check-onpolicy", *args, f"hydra.run.dir={tmp_path}")
    assert code == 1, out
    assert "FAIL text (hf sampler): max error" in out and _max_error(out) > 100 * TEXT_TOLERANCE


def _train_changes_every_lora_tensor(algo: str, run_dir: Path) -> list[dict]:
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from rlgen_cli.vlm.policy import build_vlm

    args = [
        *TINY_QWEN3_VL,
        f"algo={algo}",
        "reward=length",
        "reward.kwargs.length.target=400",
        "algo.lr=1e-2",
    ]
    code, out = run_cli("train", *args, "epochs=2", "save_every=2", f"hydra.run.dir={run_dir}")
    assert code == 0, out
    typed, _ = compose_config("train", args)
    initial = get_peft_model_state_dict(build_vlm(typed.model, torch.device("cpu")).model)
    trained = load_file(run_dir / "checkpoints" / "epoch_000002" / "weights" / "adapter_model.safetensors")
    assert set(trained) == set(initial) and len(initial) == 16  # A and B of q/k/v/o in 2 text layers
    unchanged = [name for name in initial if torch.equal(initial[name], trained[name])]
    assert not unchanged, unchanged
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_token_grpo_trains_every_lora_tensor_of_qwen3_vl(tmp_path: Path):
    rows = _train_changes_every_lora_tensor("token_grpo", tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["ratio_min"] == rows[0]["ratio_max"] == 1.0  # one on-policy update per rollout


def test_step_grpo_trains_every_lora_tensor_of_qwen3_vl(tmp_path: Path):
    rows = _train_changes_every_lora_tensor("step_grpo", tmp_path / "run")
    assert rows[-1]["kl_loss"] > 0  # moved away from the reference after the first step


def test_qwenvl_judge_scores_with_a_qwen3_vl(qwen3_vl_dir):
    judge = build_reward(
        "qwenvl",
        model_path=str(qwen3_vl_dir),
        device="cpu",
        dtype="float32",
        local_files_only=True,
        max_new_tokens=6,
        batch_size=2,
    )
    result = judge.score(RewardBatch(prompts=["a cat", "a dog", "a cow"], images=torch.rand(3, 3, 20, 28)))
    assert type(judge._model).__name__ == "Qwen3VLForConditionalGeneration"
    assert result.scores.shape == (3,) and len(result.details["answers"]) == 3
    for score, bad in zip(result.scores.tolist(), result.details["unparsed"].tolist(), strict=True):
        assert (bad == 1.0 and math.isnan(score)) or (bad == 0.0 and 0.2 <= score <= 1.0)
    assert len(judge._suppressed_ids(judge._processor.tokenizer)) == 4  # vision tokens never answered
