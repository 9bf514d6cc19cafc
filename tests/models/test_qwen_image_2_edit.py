"""The Qwen-Image 2.x editing adapter (pipeline parity: tests/models/test_pipeline_parity.py): the source's
encoder slots and VAE tokens as the pipeline makes them, each sample's velocity depends on its own source
and not on its batch, and the input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import Cond
from rlgen_cli.models.qwen_image_2_edit import QwenImage2EditPolicy
from rlgen_cli.models.tiny.qwen_image_2 import tiny_qwen_image_2_edit_pipeline
from rlgen_cli.schema.families import family_spec
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, model_cfg

PROMPTS = ["a red circle", "two blue squares on a wooden table"]  # different lengths on purpose
TOLERANCE = 64 * torch.finfo(torch.float32).eps
"""fp32 agreement of the same computation batched differently (a few roundings per layer of two)."""


@pytest.fixture(scope="module")
def edit():
    cfg = model_cfg("tiny_qwen_image_2_edit")
    policy = QwenImage2EditPolicy(tiny_qwen_image_2_edit_pipeline(cfg.tiny_seed), cfg, CPU)
    sources = torch.randint(0, 256, (2, 3, 32, 32), generator=torch.Generator().manual_seed(11)) / 255.0
    return policy, sources, policy.encode(PROMPTS, sources)


def test_the_family_edits_and_its_row_says_so(edit):
    policy = edit[0]
    assert policy.capabilities.takes_source_images and policy.capabilities.has_cfg
    row = family_spec("qwen_image_2_edit")
    assert row.editing and row.diffusers_pipeline == "QwenImage21Pipeline"


def test_the_source_fills_one_encoder_slot_per_32_px_before_the_prompt(edit):
    policy, _, cond = edit
    slots, mask = cond.tensors["prompt_image_mask"], cond.tensors["prompt_mask"]
    # a 32 px source: one 2×2 group of the 16× latent, one merged 32 px token of the encoder
    assert slots.sum(1).tolist() == [1, 1] == cond.tensors["neg_prompt_image_mask"].sum(1).tolist()
    # T2I: one token per byte + 19 of template tail; the edit template adds "<image1>" (8 bytes),
    # <|vision_start|>, the slot and <|vision_end|>
    assert mask.sum(1).tolist() == [len(p) + 19 + 8 + 3 for p in PROMPTS]
    position = int(slots[0].nonzero()[0])
    assert position == 6 + 8 + 1  # after "<|im_start|>user\n" (6) and "<image1>" (8), <|vision_start|> (1)
    assert (slots.nonzero()[:, 1] == position).all()  # the prompt comes after the source in both rows
    assert cond.tensors["source_shape"].tolist() == [[2, 2], [2, 2]]


def test_source_tokens_are_the_pipelines_vae_latents(edit):
    """``encode_sources`` against the pipeline's own ``_encode_vae_image`` + ``_pack_latents`` of the same
    opaque RGBA source in [-1, 1]."""
    policy, sources, cond = edit
    pipe = policy.pipeline
    rgba = torch.cat([sources, torch.ones_like(sources[:, :1])], dim=1) * 2 - 1
    with torch.no_grad():
        latents = pipe._encode_vae_image(rgba.unsqueeze(2), generator=None)  # (B, C, 1, 2, 2)
    expected = pipe._pack_latents(latents, 2, latents.shape[1], 2, 2)
    torch.testing.assert_close(cond.tensors["source_latents"], expected, atol=TOLERANCE, rtol=0)


def test_a_sample_depends_on_its_own_source_and_not_on_its_batch(edit):
    policy, sources, cond = edit
    x = policy.noise(2, torch.Generator().manual_seed(0))
    sigma = torch.tensor(0.7)
    with torch.no_grad():
        both = policy.velocity(x, sigma, cond)
        alone = policy.velocity(x[1:], sigma, cond.index(torch.tensor([1])))
        swapped = policy.velocity(x, sigma, policy.encode(PROMPTS, sources.flip(0)))
    torch.testing.assert_close(both[1:], alone, atol=TOLERANCE, rtol=0)
    assert (swapped - both).abs().amax(dim=(1, 2)).min() > 100 * TOLERANCE  # each row saw the other source


def test_input_errors_name_what_to_give(edit):
    policy, sources, _ = edit
    with pytest.raises(UserError, match='"image" field'):
        policy.encode(PROMPTS)
    with pytest.raises(UserError, match="with B = 2 prompts"):
        policy.encode(PROMPTS, sources[:1])
    with pytest.raises(UserError, match=r"height \(source image\) 48 px is not a multiple of 32"):
        policy.encode(PROMPTS, torch.rand(2, 3, 48, 32))
    # 32×128 and 128×32 sources: as many tokens and slots (so the conditionings join), other grids
    wide = policy.encode(PROMPTS[:1], torch.rand(1, 3, 32, 128))
    tall = policy.encode(PROMPTS[1:], torch.rand(1, 3, 128, 32))
    with pytest.raises(UserError, match="mixes source images of different sizes"):
        policy.velocity(policy.noise(2), torch.tensor(0.5), Cond.cat([wide, tall]))


def test_check_onpolicy_is_exact_on_an_editing_set(tmp_path: Path, cli):
    """Through the CLI with the tiny editing set (sources resized to the model's 64 px): the recomputed
    log-probs equal the rollout's; with noise of std 1e-3 on the LoRA between the two the check fails."""
    run = ("check-onpolicy", "model=tiny_qwen_image_2_edit", "data=tiny_edit", *TINY_RUN)
    code, out = cli(*run, f"hydra.run.dir={tmp_path / 'exact'}")
    assert code == 0, out
    code, out = cli(*run, "check.perturb_weights=1e-3", f"hydra.run.dir={tmp_path / 'moved'}")
    assert code == 1 and "FAIL max error" in out, out
