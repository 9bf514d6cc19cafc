"""Tiny Qwen-VL: trained BPE tokenizer, loading from disk, rollout, log-prob consistency, context errors."""

from __future__ import annotations

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
from rlgen_cli.vlm.rollout import (
    SamplingOptions,
    check_context,
    collate,
    completion_logprobs,
    encode_prompts,
    generate,
    load_image,
    pad_stack,
)
from rlgen_cli.vlm.tokenizer import SPECIAL_TOKENS, tiny_tokenizer, trained_bpe


def test_tokenizer_is_a_trained_byte_level_bpe_with_qwen_specials():
    vocab, merges = trained_bpe()
    assert len(merges) > 50  # trained, not just the 256 byte symbols
    tok = tiny_tokenizer()
    text = "### Step 1: the answer is 3.<|im_end|>"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) - 10  # merges compress it
    assert all(tok.convert_tokens_to_ids(t) >= len(vocab) for t in SPECIAL_TOKENS)
    assert tok.decode(tok("héllo ∑")["input_ids"]) == "héllo ∑"  # byte-level: any text round-trips


def _batch(policy, n: int = 4):
    examples = load_vlm_examples("builtin:tiny_r1vl.json")[:n]
    vlm = policy.cfg.vlm
    prompts = [prompt_text(policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in examples]
    return prompts, [load_image(ex.image) for ex in examples]


def test_rollout_is_seeded_stops_at_eos_and_suppresses_vision_tokens(tiny_vlm_policy):
    policy = tiny_vlm_policy
    prompts, images = _batch(policy)
    encoded = encode_prompts(policy, prompts, images)
    assert "<|image_pad|>" in prompts[0] and encoded["image_grid_thw"].shape == (4, 3)
    options = SamplingOptions(temperature=1.5, top_p=1.0, top_k=0, max_new_tokens=16)
    first = generate(policy, encoded, options, seed=3)
    again = generate(policy, encoded, options, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.ids, again.ids))
    for ids, truncated in zip(first.ids, first.truncated):
        assert not set(ids.tolist()) & set(policy.suppressed_ids)
        stops = [i for i, t in enumerate(ids.tolist()) if t in policy.stop_ids]
        assert (stops == [] and truncated and len(ids) == 16) or (stops == [len(ids) - 1] and not truncated)
    # π_old on the training layout reproduces the sampler's raw-logit log-probs up to KV-cache numerics,
    # and the same computation with gradients on is bit-identical (ratio exactly 1).
    batch = collate(policy, prompts, images, first.ids)
    with torch.no_grad():
        old = completion_logprobs(policy, batch)
    new = completion_logprobs(policy, batch)
    mask = batch.completion_mask.bool()
    assert torch.equal(new.detach()[mask], old[mask])
    assert (old - pad_stack(first.logprobs, old.shape[1])).abs()[mask].max() < 1e-5


def test_too_long_prompt_fails_early_with_a_clear_error(tiny_vlm_policy):
    prompts, images = _batch(tiny_vlm_policy, 1)
    encoded = encode_prompts(tiny_vlm_policy, prompts, images)
    with pytest.raises(
        UserError, match=r"sample #7: prompt is \d+ tokens \(16 of them image tokens\).*never truncated"
    ):
        check_context(tiny_vlm_policy, encoded, 10_000, ["#7"])


def test_real_loading_from_a_saved_directory_applies_pixel_bounds(tmp_path):
    from rlgen_cli.models.tiny import save_tiny_vlm
    from rlgen_cli.vlm.policy import build_vlm
    from tests.vlm.conftest import TINY_VLM, compose_config

    path = save_tiny_vlm(tmp_path / "qwen25", kind="qwen2_5_vl")
    typed, _ = compose_config(
        "train",
        TINY_VLM
        + [
            "algo=step_grpo",
            "reward=length",
            "model.family=qwen2_5_vl",
            "model.tiny=false",
            f"model.path={path}",
            "model.local_files_only=true",
            "model.vlm.max_pixels=256",
        ],
    )
    policy = build_vlm(typed.model, torch.device("cpu"))
    assert type(policy.model.base_model.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    encoded = encode_prompts(
        policy, ["<|vision_start|><|image_pad|><|vision_end|>hi"], [load_image(_image(tmp_path))]
    )
    assert int(encoded["image_grid_thw"].prod()) <= 256 // 16  # ≤ max_pixels / patch² patches
    bad, _ = compose_config(
        "train",
        TINY_VLM
        + [
            "algo=step_grpo",
            "reward=length",
            "model.tiny=false",
            f"model.path={tmp_path / 'absent'}",
            "model.local_files_only=true",
        ],
    )
    with pytest.raises(UserError, match="cannot load qwen2_vl"):
        build_vlm(bad.model, torch.device("cpu"))


def _image(tmp_path):
    from PIL import Image

    path = tmp_path / "big.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(path)
    return path
