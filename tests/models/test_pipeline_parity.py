"""Pipeline parity: rlgen's noise-level-0 sampling reproduces each diffusers pipeline's own ``__call__``.

For every family, the tiny model samples the same prompts from the same initial noise twice: by rlgen
(the recipes' sampling path with the ``flow_sde`` kernel at η = 0 — the Euler ODE — over
``policy.schedule``, decoded by ``policy.decode``) and by the diffusers pipeline built from the same tiny
components, called with the same guidance, resolution, step count and ``generator=`` streams, with
``output_type="pt"``. The DECODED images / videos (fp32, values in [0, 1]) must agree to ``ATOL``. Each
case then shows that the comparison can fail: a near miss (guidance + 0.5, or one step fewer) lands far
outside the tolerance.

Where the pipeline differs on purpose, the call neutralises it (docs/adding_a_model.md, "Pipeline
parity"):

* Wan2.1 — WanPipeline ships UniPC, a second-order multistep predictor–corrector; an RL sampler needs a
  one-step Gaussian transition, so rlgen integrates Euler steps on UniPC's σ grid. The pipeline runs with
  UniPC at order 1 and the corrector off, which on the flow path is exactly the Euler step. UniPC also
  starts at σ₀ = 1 − 1e-6 where rlgen starts at 1 (a 1e-6 step difference, far below ``ATOL``); its
  integer timesteps rlgen reproduces (``wan_timestep``).
* FLUX.1-Kontext / Qwen-Image-Edit — both pipelines resize the source image to ≈ 1 MP; rlgen encodes it
  at the model resolution (the recipe resizes sources to it). Kontext takes ``_auto_resize=False`` and
  ``max_area``; Qwen-Image-Edit's target area is set to the image's own here. Qwen-Image 2.x editing
  resizes it to ``output_resolution``², given as the source's own side.
* Qwen-Image 2.x editing — the pipeline applies one set of condition images to all its prompts, so it is
  called once per prompt with that example's source and noise stream, without its text KV cache (the
  cache changes only the rounding: ``tests/models/test_qwen_image_2.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rlgen_cli.models.qwen_image_edit import to_pil
from rlgen_cli.models.tiny import (
    tiny_flux2_klein_pipeline,
    tiny_flux2_pipeline,
    tiny_flux_kontext_pipeline,
    tiny_flux_pipeline,
    tiny_qwen_image_edit_pipeline,
    tiny_qwen_image_pipeline,
    tiny_sd3_pipeline,
    tiny_wan_pipeline,
    tiny_z_image_pipeline,
)
from rlgen_cli.models.tiny.qwen_image_2 import tiny_qwen_image_2_edit_pipeline
from rlgen_cli.models.wan import wan_sigmas, wan_timestep
from tests.models.helpers import as_loaded, base_policy, initial_noise_generators, ode_samples

ATOL = 1e-5
"""Largest |rlgen − pipeline| allowed on any decoded pixel (fp32; pixels lie in [0, 1]). Measured: ≤ 2.4e-7
for SD3 and Wan, ≤ 4.8e-7 for FLUX and Kontext, ≤ 1.4e-6 for Qwen (its scheduler's σ grid and rlgen's
differ in the last fp32 bits, ≤ 6e-8), ≤ 1.4e-6 for Qwen-Image 2.x editing; every near miss is ≥ 5e-3."""

PROMPTS = ["a red circle", "two blue squares on a wooden table"]
STEPS, SEED = 4, 3


def _sources() -> torch.Tensor:
    """Two 32 px source images with 8-bit values (what PNG files give; PIL round trips them exactly)."""
    return torch.randint(0, 256, (2, 3, 32, 32), generator=torch.Generator().manual_seed(11)) / 255.0


# -- each pipeline's own __call__, with the policy's settings ------------------------------------------


def _sd3(policy, generators, sources, monkeypatch) -> torch.Tensor:
    pipe = as_loaded(tiny_sd3_pipeline(policy.cfg.tiny_seed))
    return pipe(
        PROMPTS,
        negative_prompt=policy.cfg.negative_prompt,
        height=32,
        width=32,
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale,
        generator=generators,
        max_sequence_length=policy.cfg.max_sequence_length,
        output_type="pt",
    ).images


def _flux(policy, generators, sources, monkeypatch) -> torch.Tensor:
    pipe = as_loaded(tiny_flux_pipeline(policy.cfg.tiny_seed))
    return pipe(
        PROMPTS,
        height=32,
        width=32,
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale,
        generator=generators,
        max_sequence_length=policy.cfg.max_sequence_length,
        output_type="pt",
    ).images


def _flux_kontext(policy, generators, sources, monkeypatch) -> torch.Tensor:
    pipe = as_loaded(tiny_flux_kontext_pipeline(policy.cfg.tiny_seed))
    return pipe(
        image=sources,
        prompt=PROMPTS,
        height=32,
        width=32,
        max_area=32 * 32,
        _auto_resize=False,
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale,
        generator=generators,
        max_sequence_length=policy.cfg.max_sequence_length,
        output_type="pt",
    ).images


def _true_cfg_kwargs(policy) -> dict:
    """Qwen's true CFG runs only with a negative prompt (one per prompt); guidance 1 means none."""
    negative = [policy.cfg.negative_prompt] * len(PROMPTS) if policy.guidance_scale > 1 else None
    return {"true_cfg_scale": policy.guidance_scale, "negative_prompt": negative}


def _qwen_image(policy, generators, sources, monkeypatch) -> torch.Tensor:
    pipe = as_loaded(tiny_qwen_image_pipeline(policy.cfg.tiny_seed))
    return pipe(
        PROMPTS,
        **_true_cfg_kwargs(policy),
        height=32,
        width=32,
        num_inference_steps=STEPS,
        generator=generators,
        max_sequence_length=policy.cfg.max_sequence_length,
        output_type="pt",
    ).images


def _qwen_image_edit(policy, generators, sources, monkeypatch) -> torch.Tensor:
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

    # The pipeline resizes the source to ≈ 1024² px; keep it at its own size, as rlgen encodes it.
    resize = module.calculate_dimensions
    monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio: resize(32 * 32, ratio))
    pipe = as_loaded(tiny_qwen_image_edit_pipeline(policy.cfg.tiny_seed))
    return pipe(
        image=to_pil(sources),
        prompt=PROMPTS,
        **_true_cfg_kwargs(policy),
        height=32,
        width=32,
        num_inference_steps=STEPS,
        generator=generators,
        output_type="pt",
    ).images


def _qwen_image_2_edit(policy, generators, sources, monkeypatch) -> torch.Tensor:
    """One call per prompt (the pipeline applies one set of condition images to its whole batch), sources
    kept at their own size (``output_resolution`` = their side), RGBA composited over white as ``decode``."""
    pipe = as_loaded(tiny_qwen_image_2_edit_pipeline(policy.cfg.tiny_seed))
    negative = policy.cfg.negative_prompt if policy.guidance_scale > 1 else None
    images = []
    for prompt, source, generator in zip(PROMPTS, to_pil(sources), generators, strict=True):
        rgba = pipe(
            prompt,
            image=source,
            negative_prompt=negative,
            true_cfg_scale=policy.guidance_scale,
            height=policy.cfg.resolution,
            width=policy.cfg.resolution,
            output_resolution=source.width,
            num_inference_steps=STEPS,
            generator=[generator],
            output_type="pt",
            use_kv_cache=False,
        ).images
        images.append(rgba[:, :3] * rgba[:, 3:] + 1 - rgba[:, 3:])
    return torch.cat(images)


def _wan(policy, generators, sources, monkeypatch) -> torch.Tensor:
    from diffusers import UniPCMultistepScheduler

    cfg = policy.cfg
    pipe = as_loaded(tiny_wan_pipeline(cfg.tiny_seed, cfg.max_sequence_length))
    # UniPC at order 1 without its corrector: the Euler step on the pipeline's own σ grid (module docstring)
    pipe.scheduler = UniPCMultistepScheduler.from_config(
        pipe.scheduler.config, solver_order=1, disable_corrector=list(range(STEPS))
    )
    frames = pipe(
        PROMPTS,
        negative_prompt=cfg.negative_prompt if policy.guidance_scale > 1 else None,
        height=cfg.height,
        width=cfg.width,
        num_frames=cfg.num_frames,
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale,
        generator=generators,
        max_sequence_length=cfg.max_sequence_length,
        output_type="pt",
    ).frames
    return frames.permute(0, 2, 1, 3, 4)  # (B, F, 3, H, W) → rlgen's (B, 3, F, H, W)


def _z_image(policy, generators, sources, monkeypatch) -> torch.Tensor:
    pipe = as_loaded(tiny_z_image_pipeline(policy.cfg.tiny_seed))
    # the pipeline writes CFG as c + g'·(c − u): its g' is rlgen's g − 1 (0 = no unconditional branch);
    # it rewrites the prompt list it is given in place, so it gets a copy
    return pipe(
        list(PROMPTS),
        negative_prompt=[policy.cfg.negative_prompt] * len(PROMPTS),
        height=32,
        width=32,
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale - 1,
        generator=generators,
        max_sequence_length=policy.cfg.max_sequence_length,
        output_type="pt",
    ).images


def _flux2(policy, generators, sources, monkeypatch) -> torch.Tensor:
    """FLUX.2-dev (embedded guidance) or FLUX.2-klein base (true CFG, empty negative prompt)."""
    build = tiny_flux2_pipeline if policy.family == "flux2" else tiny_flux2_klein_pipeline
    pipe = as_loaded(build(policy.cfg.tiny_seed))
    return pipe(
        prompt=PROMPTS,
        height=32,
        width=32,
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale,
        generator=generators,
        max_sequence_length=policy.cfg.max_sequence_length,
        output_type="pt",
    ).images


PipelineCall = Callable[..., torch.Tensor]

CASES = [
    # (model config, guidance, the pipeline's call, takes source images)
    pytest.param("tiny_sd3", 1.0, _sd3, False, id="sd3"),
    pytest.param("tiny_sd3", 4.5, _sd3, False, id="sd3-cfg"),
    pytest.param("tiny_flux", 3.5, _flux, False, id="flux-guidance"),
    pytest.param("tiny_flux_kontext", 2.5, _flux_kontext, True, id="flux_kontext-guidance"),
    pytest.param("tiny_flux2", 4.0, _flux2, False, id="flux2-guidance"),
    pytest.param("tiny_flux2_klein", 1.0, _flux2, False, id="flux2_klein"),
    pytest.param("tiny_flux2_klein", 4.0, _flux2, False, id="flux2_klein-cfg"),
    pytest.param("tiny_qwen_image", 1.0, _qwen_image, False, id="qwen_image"),
    pytest.param("tiny_qwen_image", 4.0, _qwen_image, False, id="qwen_image-true_cfg"),
    pytest.param("tiny_qwen_image_edit", 1.0, _qwen_image_edit, True, id="qwen_image_edit"),
    pytest.param("tiny_qwen_image_edit", 4.0, _qwen_image_edit, True, id="qwen_image_edit-true_cfg"),
    pytest.param("tiny_qwen_image_2_edit", 1.0, _qwen_image_2_edit, True, id="qwen_image_2_edit"),
    pytest.param("tiny_qwen_image_2_edit", 4.0, _qwen_image_2_edit, True, id="qwen_image_2_edit-true_cfg"),
    pytest.param("tiny_wan2_1", 1.0, _wan, False, id="wan2_1"),
    pytest.param("tiny_wan2_1", 4.5, _wan, False, id="wan2_1-cfg"),
    pytest.param("tiny_z_image", 1.0, _z_image, False, id="z_image"),
    pytest.param("tiny_z_image", 5.0, _z_image, False, id="z_image-cfg"),
]


@pytest.mark.parametrize(("model", "guidance", "pipeline_call", "edits"), CASES)
def test_decoded_samples_equal_the_pipelines_own_call(
    model: str, guidance: float, pipeline_call: PipelineCall, edits: bool, monkeypatch
):
    """max |rlgen − pipeline| ≤ ATOL = 1e-5 over every decoded pixel (fp32), CFG / guidance as given."""
    policy = base_policy(model, guidance_scale=guidance)
    sources = _sources() if edits else None
    with torch.no_grad():
        expected = pipeline_call(policy, initial_noise_generators(SEED, len(PROMPTS)), sources, monkeypatch)
        got = ode_samples(policy, PROMPTS, STEPS, SEED, sources)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)

        # The check can fail: guidance + 0.5 (where guidance acts) or one step fewer misses by far.
        if guidance > 1:
            policy.guidance_scale = guidance + 0.5
            near_miss = ode_samples(policy, PROMPTS, STEPS, SEED, sources)
        else:
            near_miss = ode_samples(policy, PROMPTS, STEPS - 1, SEED, sources)
    assert (near_miss - expected).abs().max() > 100 * ATOL


@pytest.mark.parametrize("shift", [3.0, 5.0])
def test_wan_timesteps_are_unipcs_integers(shift: float):
    """WanPipeline's UniPC feeds the transformer int(1000·σ), σ₀ = 1 nudged below 1 (so 999, not 1000);
    on the tiny model a fractional timestep moved the decoded video by up to 0.17."""
    from diffusers import UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
    for steps in (4, 10, 20, 50):
        unipc.set_timesteps(steps)
        assert torch.equal(wan_timestep(wan_sigmas(steps, shift)[:-1]), unipc.timesteps.float())
    assert wan_timestep(torch.tensor([1.0, 0.7, 0.5009, 0.0])).tolist() == [999.0, 700.0, 500.0, 0.0]
