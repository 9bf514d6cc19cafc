"""Qwen-Image-Edit-Plus: N source images per example. Sampling equals ``QwenImageEditPlusPipeline``'s own
call per prompt (two sources, with and without true CFG), the (N, h/2, w/2) RoPE block equals N separate
source shapes, editing sets carry N paths per example, and wrong counts or shapes are clear errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlgen_cli.data.images import require_source_images, source_images
from rlgen_cli.data.prompts import PromptExample
from rlgen_cli.models.qwen_image_edit import to_pil
from rlgen_cli.models.qwen_image_edit_plus import QwenImageEditPlusPolicy, as_source_stack
from rlgen_cli.models.tiny import tiny_qwen_image_edit_plus_pipeline
from rlgen_cli.schema.errors import UserError
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, as_loaded, base_policy, initial_noise_generators, model_cfg, ode_samples

PROMPTS = ["put the circle of picture 1 next to picture 2", "swap the colours of the two pictures"]
STEPS, SEED = 4, 3


def _sources(n: int = 2) -> torch.Tensor:
    """(2, n, 3, 32, 32) sources with 8-bit values (PIL round trips them exactly)."""
    return torch.randint(0, 256, (2, n, 3, 32, 32), generator=torch.Generator().manual_seed(11)) / 255.0


def _pipeline_samples(guidance: float, sources: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The pipeline's own call, one prompt at a time (it takes batch size 1), each with its generator."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module

    # the pipeline VAE-encodes sources at ≈ 1 MP; rlgen at the model resolution (the recipe resizes them)
    monkeypatch.setattr(module, "VAE_IMAGE_SIZE", 32 * 32)
    pipe = as_loaded(tiny_qwen_image_edit_plus_pipeline(0))
    gens = initial_noise_generators(SEED, len(PROMPTS))
    return torch.cat([
        pipe(
            image=to_pil(sources[i]), prompt=[PROMPTS[i]], negative_prompt=[" "] if guidance > 1 else None,
            true_cfg_scale=guidance, height=32, width=32, num_inference_steps=STEPS, generator=[gens[i]],
            output_type="pt",
        ).images
        for i in range(len(PROMPTS))
    ])  # fmt: skip


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["no_cfg", "true_cfg"])
def test_two_source_sampling_equals_the_pipelines_own_call(guidance: float, monkeypatch):
    """max |rlgen − pipeline| ≤ 1e-5 over decoded pixels (measured ≤ 2.4e-6); swapping the two sources
    misses by far more, so the order of the sources reaches the model."""
    policy = base_policy("tiny_qwen_image_edit_plus", guidance_scale=guidance)
    sources = _sources()
    with torch.no_grad():
        expected = _pipeline_samples(guidance, sources, monkeypatch)
        got = ode_samples(policy, PROMPTS, STEPS, SEED, sources)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        swapped = ode_samples(policy, PROMPTS, STEPS, SEED, sources.flip(1))
    assert (swapped - expected).abs().max() > 1e-3


def test_source_block_equals_separate_source_shapes():
    """Tokens of N same-size sources under one (N, h, w) shape get the RoPE of N (1, h, w) shapes."""
    policy = base_policy("tiny_qwen_image_edit_plus", guidance_scale=1.0)
    x = policy.noise(2, torch.Generator().manual_seed(0))
    cond = policy.encode(PROMPTS, _sources(3))
    assert cond.tensors["source_shape"][0].tolist() == [3, 4, 4]
    assert cond.tensors["source_latents"].shape[:2] == (2, 3 * 16)
    hidden = torch.cat([x, cond.tensors["source_latents"]], dim=1)
    separate = [[(1, 4, 4)] * 4] * 2  # the target and three sources, as the pipeline passes them
    embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_mask"]
    keep = int(mask.sum(1).max())
    with torch.no_grad():
        by_pipeline = policy.transformer(
            hidden_states=hidden, timestep=torch.full((2,), 0.6), encoder_hidden_states=embeds[:, :keep],
            encoder_hidden_states_mask=mask[:, :keep], img_shapes=separate, return_dict=False,
        )[0][:, :16]  # fmt: skip
        torch.testing.assert_close(policy.velocity(x, torch.tensor(0.6), cond), by_pipeline)


def test_bad_source_tensors_are_user_errors():
    with pytest.raises(UserError, match="needs source images"):
        as_source_stack(None, 2)
    with pytest.raises(UserError, match="B = 2 prompts"):
        as_source_stack(torch.zeros(3, 2, 3, 8, 8), 2)
    assert as_source_stack(torch.zeros(2, 3, 8, 8), 2).shape == (2, 1, 3, 8, 8)  # one source each


def test_editing_sets_carry_n_sources_and_counts_must_agree(tmp_path: Path):
    from PIL import Image

    for name, red in (("a.png", 10), ("b.png", 200), ("c.png", 90)):
        Image.new("RGB", (8, 8), (red, 0, 0)).save(tmp_path / name)
    source = str(tmp_path / "set.jsonl")
    two = [
        PromptExample(0, "edit", {"image": ["a.png", "b.png"]}),
        PromptExample(1, "e", {"image": ["c.png", "a.png"]}),
    ]
    dataset = type("Set", (), {"source": source})()
    stacked = source_images(two, dataset, 4, 4)
    assert stacked.shape == (2, 2, 3, 4, 4)
    assert [round(float(stacked[i, j, 0].mean()) * 255) for i in range(2) for j in range(2)] == [
        10,
        200,
        90,
        10,
    ]
    assert source_images(two[:1], dataset, 4, 4).ndim == 5  # a list of paths keeps its source axis
    single = [PromptExample(0, "edit", {"image": "a.png"})]
    assert source_images(single, dataset, 4, 4).shape == (1, 3, 4, 4)  # the one-source layout is unchanged
    mixed = [two[0], PromptExample(1, "edit", {"image": ["c.png"]})]
    with pytest.raises(UserError, match="example 1 .* has 1 source images but example 0 has 2"):
        require_source_images(mixed, source, "data.train")
    missing = [PromptExample(0, "edit", {"image": ["a.png", "nope.png"]})]
    with pytest.raises(UserError, match="nope.png, which does not exist"):
        require_source_images(missing, source, "data.train")


def test_a_batch_mixing_source_counts_is_a_user_error():
    policy = QwenImageEditPlusPolicy(
        tiny_qwen_image_edit_plus_pipeline(0),
        replace(model_cfg("tiny_qwen_image_edit_plus"), guidance_scale=1.0),
        CPU,
    )
    x, cond = policy.noise(2), policy.encode(PROMPTS, _sources(2))
    cond.tensors["source_shape"][1, 0] = 1  # as if the second example had one source
    with pytest.raises(UserError, match="mixes source images"):
        policy.velocity(x, torch.tensor(0.5), cond)


def test_check_onpolicy_passes(tmp_path: Path, cli):
    code, out = cli(
        "check-onpolicy", "model=tiny_qwen_image_edit_plus", *TINY_RUN, f"hydra.run.dir={tmp_path}"
    )
    assert code == 0, out
