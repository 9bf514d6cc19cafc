"""VLM recipes end to end on the tiny Qwen2-VL: StepGRPO through the CLI, on-policy check, evaluation,
SFT warm-up, merged export, and the too-long-prompt error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.vlm.conftest import TINY_VLM, compose_config

STEP_GRPO = [*TINY_VLM, "algo=step_grpo", "reward=length", "reward.kwargs.length.target=400", "algo.lr=1e-2"]


@pytest.fixture(scope="module")
def step_grpo_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("vlm_rl") / "run"
    code, out = run_cli("train", *STEP_GRPO, "epochs=2", "save_every=1", f"hydra.run.dir={run_dir}")
    assert code == 0, out
    return run_dir


def test_two_step_grpo_steps_change_every_trainable_tensor(step_grpo_run: Path):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from rlgen_cli.vlm.policy import build_vlm

    rows = [json.loads(line) for line in (step_grpo_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["global_step"] == 2  # epochs completed
    for row in rows:  # a reward that varies: every group carries signal
        assert row["reward/std"] > 0 and row["zero_std_ratio"] == 0.0
        for key in (
            "policy_loss",
            "kl_loss",
            "clipfrac",
            "ratio_min",
            "ratio_max",
            "grad_norm",
            "completions/mean_length",
            "completions/clipped_ratio",
            "sampler/logp_gap_max",
        ):
            assert row[key] is not None, key
    assert rows[0]["ratio_min"] == rows[0]["ratio_max"] == 1.0  # one on-policy update per rollout
    assert rows[1]["kl_loss"] > 0  # the policy moved away from the reference after step 1
    ckpt = step_grpo_run / "checkpoints" / "epoch_000002"
    typed, _ = compose_config("train", STEP_GRPO)
    initial = get_peft_model_state_dict(build_vlm(typed.model, torch.device("cpu")).model)
    trained = load_file(ckpt / "weights" / "adapter_model.safetensors")
    assert set(trained) == set(initial) and len(initial) == 16  # A and B of q/k/v/o in 2 layers
    unchanged = [k for k in initial if torch.equal(initial[k], trained[k])]
    assert not unchanged, unchanged


def test_resumed_run_equals_the_uninterrupted_one(step_grpo_run: Path, tmp_path: Path):
    from safetensors.torch import load_file

    middle = step_grpo_run / "checkpoints" / "epoch_000001"
    code, out = run_cli("train", *STEP_GRPO, "epochs=2", f"resume={middle}", f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    name = "weights/adapter_model.safetensors"
    resumed = load_file(tmp_path / "checkpoints" / "epoch_000002" / name)
    uninterrupted = load_file(step_grpo_run / "checkpoints" / "epoch_000002" / name)
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_export_writes_a_merged_model_that_loads_as_is(step_grpo_run: Path, tmp_path: Path):
    from transformers import Qwen2VLForConditionalGeneration

    from rlgen_cli.vlm.export import main

    out = main([str(step_grpo_run / "checkpoints" / "epoch_000002"), str(tmp_path / "merged")])
    model = Qwen2VLForConditionalGeneration.from_pretrained(out)
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert (out / "processor_config.json").is_file() or (out / "preprocessor_config.json").is_file()


def test_check_onpolicy_cli_exits_0(tmp_path: Path):
    code, out = run_cli("check-onpolicy", *STEP_GRPO, f"hydra.run.dir={tmp_path}")
    assert code == 0 and "PASS" in out, out


def test_eval_cli_writes_results(tmp_path: Path):
    args = [
        "model=tiny_qwen2_vl",
        "data=tiny_vlm",
        "reward=r1vl",
        "progress=false",
        "model.vlm.eval_max_new_tokens=4",
    ]
    code, out = run_cli("eval", *args, f"hydra.run.dir={tmp_path}")
    assert code == 0 and (tmp_path / "results.json").is_file(), out


def test_eval_reports_accuracy_overall_and_per_category(tmp_path: Path):
    from rlgen_cli.recipes.vlm_rl import evaluate

    overrides = ["model=tiny_qwen2_vl", "data=tiny_vlm", "reward=r1vl", "progress=false", "batch_size=6",
                 "model.vlm.eval_max_new_tokens=8"]  # fmt: skip
    typed, raw = compose_config("eval", overrides, run_dir=tmp_path)
    accuracy = evaluate(typed, raw)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["accuracy"] == accuracy and results["num_samples"] == 6
    assert set(results["categories"]) == {"colour", "counting"}
    assert set(results["rewards"]) == {"mix", "answer_accuracy", "step_rar", "step_rvr"}
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 6


def test_sft_warm_up_lowers_the_loss_on_assistant_tokens(tmp_path: Path):
    """Full fine-tuning (R1-VL's warm-up), 3 epochs of 2 steps on the 7 kept conversations."""
    from rlgen_cli.recipes.vlm_sft import VLMSFTRecipe

    rollout_only = (  # SFT generates no rollouts (and refuses these settings of them)
        "algo.token.max_completion_tokens", "algo.group_size", "algo.prompts_per_epoch", "algo.sample_batch_size",
    )  # fmt: skip
    tiny = [o for o in TINY_VLM if not o.startswith(rollout_only)]
    overrides = [*tiny, "algo=vlm_sft", "reward=length", "data.train=builtin:tiny_sft.jsonl", "epochs=3",
                 "save_every=0", "algo.lr=1e-2", "algo.token.lr_schedule=constant", "model.lora.enabled=false"]  # fmt: skip
    typed, raw = compose_config("train", overrides, run_dir=tmp_path)
    recipe = VLMSFTRecipe(typed, raw)
    recipe.setup()
    assert len(recipe.train_set) == 7 and recipe.dropped == 1  # the reflective conversation is gone
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.8 * losses[0], losses


def test_assistant_mask_covers_only_assistant_turns(tiny_vlm_policy):
    from rlgen_cli.recipes.vlm_sft import assistant_mask

    tok = tiny_vlm_policy.tokenizer
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA 12<|im_end|>\n"
    ids = torch.tensor(tok(text)["input_ids"])
    assert tok.decode(ids[assistant_mask(ids, tok)]) == "A 12<|im_end|>"


def test_too_long_prompt_exits_2_with_the_fix(tmp_path: Path):
    code, out = run_cli(
        "train", *STEP_GRPO, "epochs=1", "model.vlm.max_context=40", f"hydra.run.dir={tmp_path}"
    )
    assert code == 2
    assert "never truncated" in out and "model.vlm.max_context" in out


def test_image_rewards_are_rejected_by_the_vlm_recipe(tmp_path: Path):
    code, out = run_cli(
        "train",
        *TINY_VLM,
        "algo=step_grpo",
        "reward=jpeg_compressibility",
        "epochs=1",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 2 and "score images" in out
