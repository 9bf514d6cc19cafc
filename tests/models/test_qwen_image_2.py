"""The Qwen-Image 2.x adapter: decoded samples equal ``QwenImage21Pipeline.__call__`` (with and without
CFG), the real loading path, the schedule, per-prompt-length calls, plain CFG, the RGBA decode, LoRA
format and reference switch, input errors, and the CLI (check-onpolicy exact, a training run)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.models.qwen_image_2 import (
    QWEN_IMAGE_2_LORA_TARGETS,
    QwenImage2Policy,
    load_qwen_image_2_pipeline,
    over_white,
    qwen_image_2_sigmas,
    sigma_grid,
)
from rlgen_cli.models.tiny.qwen_image_2 import tiny_qwen_image_2_pipeline
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME
from tests.conftest import TINY_RUN
from tests.models.helpers import (
    CPU,
    as_loaded,
    assert_reference_disables_the_adapter,
    base_policy,
    initial_noise_generators,
    model_cfg,
    ode_samples,
    perturb_lora,
)

PROMPTS = ["a red circle", "two blue squares on a wooden table"]  # different lengths on purpose
STEPS, SEED = 4, 3
ATOL = 1e-5
"""Largest |rlgen − pipeline| allowed on a decoded pixel (fp32, pixels in [0, 1]), as for every family in
test_pipeline_parity.py."""


@pytest.fixture(scope="module")
def q_cfg():
    return model_cfg("tiny_qwen_image_2")


def _policy(cfg, **changes) -> QwenImage2Policy:
    return QwenImage2Policy(tiny_qwen_image_2_pipeline(cfg.tiny_seed), replace(cfg, **changes), CPU)


@pytest.fixture(scope="module")
def shared(q_cfg):
    policy = _policy(q_cfg)
    return policy, policy.noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS)


@pytest.fixture
def lora_policy(shared):
    """The shared policy; its LoRA weights are restored after the test."""
    policy = shared[0]
    saved = [p.detach().clone() for p in policy.trainable.parameters()]
    yield shared
    with torch.no_grad():
        for param, value in zip(policy.trainable.parameters(), saved, strict=True):
            param.copy_(value)
            param.grad = None


def _raw(policy: QwenImage2Policy, x, sigma: float, embeds, mask=None) -> torch.Tensor:
    """One plain transformer call over [prompt tokens, image tokens] as the pipeline makes it (mask marks
    valid prompt tokens; None = all valid)."""
    batch, tokens = x.shape[:2]
    img_mask = torch.cat(
        [
            torch.zeros(batch, embeds.shape[1], dtype=torch.bool),
            torch.ones(batch, tokens // 4, dtype=torch.bool),
        ],
        dim=1,
    )
    out = policy.transformer(
        hidden_states=x,
        encoder_hidden_states=embeds,
        timestep=torch.full((batch,), sigma),
        img_shapes=[[(1, *policy.latent_hw)]] * batch,
        img_mask=img_mask,
        encoder_hidden_states_mask=mask,
        return_dict=False,
    )[0]
    return out[:, -tokens:]


# -- pipeline parity --------------------------------------------------------------------------------


def _pipeline_samples(pipe, policy, use_kv_cache: bool) -> torch.Tensor:
    """The pipeline's own call, one prompt per call (a padded batch moves the shorter prompt's image RoPE:
    module docstring), with each sample's noise stream; RGBA composited over white as ``decode`` does."""
    side = policy.cfg.resolution
    images = []
    for prompt, generator in zip(PROMPTS, initial_noise_generators(SEED, len(PROMPTS)), strict=True):
        rgba = pipe(
            prompt,
            negative_prompt=policy.cfg.negative_prompt if policy.guidance_scale > 1 else None,
            true_cfg_scale=policy.guidance_scale,
            height=side,
            width=side,
            num_inference_steps=STEPS,
            generator=[generator],
            output_type="pt",
            use_kv_cache=use_kv_cache,
        ).images
        images.append(rgba[:, :3] * rgba[:, 3:] + 1 - rgba[:, 3:])
    return torch.cat(images)


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["no_cfg", "true_cfg"])
def test_decoded_samples_equal_the_pipelines_own_call(guidance: float):
    """max |rlgen − pipeline| ≤ 1e-5 over every decoded pixel; guidance + 0.5 or one step fewer misses."""
    policy = base_policy("tiny_qwen_image_2", guidance_scale=guidance)
    pipe = as_loaded(tiny_qwen_image_2_pipeline(policy.cfg.tiny_seed))
    with torch.no_grad():
        expected = _pipeline_samples(pipe, policy, use_kv_cache=False)
        got = ode_samples(policy, PROMPTS, STEPS, SEED)
        assert got.shape == expected.shape == (2, 3, 64, 64)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        if guidance > 1:  # the pipeline's default KV cache (both branches) changes only the rounding in fp32
            cached = _pipeline_samples(pipe, policy, use_kv_cache=True)
            torch.testing.assert_close(cached, expected, atol=ATOL, rtol=0)
            policy.guidance_scale = guidance + 0.5
            near_miss = ode_samples(policy, PROMPTS, STEPS, SEED)
        else:
            near_miss = ode_samples(policy, PROMPTS, STEPS - 1, SEED)
    assert (near_miss - expected).abs().max() > 100 * ATOL


# -- the adapter ------------------------------------------------------------------------------------


def test_save_pretrained_round_trip_through_the_real_loader(tmp_path: Path, q_cfg, shared):
    tiny_qwen_image_2_pipeline(0).save_pretrained(tmp_path / "q")
    cfg = replace(q_cfg, tiny=False, path=str(tmp_path / "q"), local_files_only=True)
    loaded = QwenImage2Policy(load_qwen_image_2_pipeline(cfg), cfg, CPU)
    built, x, cond = shared
    sigma = torch.tensor(0.7)
    with torch.no_grad(), loaded.trainable.reference(), built.trainable.reference():
        torch.testing.assert_close(
            loaded.velocity(x, sigma, loaded.encode(PROMPTS)), built.velocity(x, sigma, cond)
        )
    with pytest.raises(UserError, match="model.path"):
        load_qwen_image_2_pipeline(replace(cfg, path=str(tmp_path / "nothing")))


def test_configs_hold_the_familys_settings(q_cfg):
    real = model_cfg("qwen_image_2")
    assert real.lora.target_modules == q_cfg.lora.target_modules == QWEN_IMAGE_2_LORA_TARGETS
    assert (real.family, real.tiny, q_cfg.family, q_cfg.tiny) == ("qwen_image_2", False, "qwen_image_2", True)
    # Flow-Factory's qwen_image_2_1 example: no CFG, 10 / 40 steps, 384 px (a multiple of 32), bf16
    assert (real.guidance_scale, real.num_steps, real.eval_num_steps, real.resolution) == (1.0, 10, 40, 384)
    assert real.dtype == "bfloat16" and (real.lora.rank, real.lora.alpha) == (64, 128)


def test_tiny_builder_is_deterministic_in_its_seed_and_leaves_the_global_rng():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = tiny_qwen_image_2_pipeline(0), tiny_qwen_image_2_pipeline(0), tiny_qwen_image_2_pipeline(1)
    assert torch.equal(torch.random.get_rng_state(), before)
    for part in ("transformer", "text_encoder", "vae"):
        pa, pb, pc = (dict(getattr(p, part).named_parameters()) for p in (a, b, c))
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
        assert not all(torch.equal(pa[k], pc[k]) for k in pa)


def test_schedule_equals_the_exponential_shift_by_hand_and_a_shipped_grid():
    """μ = 0.5 + 0.4·(L − 256)/7936; σ' = e^μ/(e^μ + 1/σ − 1) on linspace(1, 1/T, T), stretched so the last
    non-zero σ is 0.02 (Qwen-Image's scheduler config, the tiny one's)."""
    import math

    from diffusers import FlowMatchEulerDiscreteScheduler

    from rlgen_cli.models.tiny.image import QWEN_SCHEDULER

    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    tokens, steps = 1024, 4
    mu = 0.5 + 0.4 * (tokens - 256) / (8192 - 256)
    shifted = [math.exp(mu) / (math.exp(mu) + 1 / s - 1) for s in (1.0, 0.75, 0.5, 0.25)]
    stretched = [1 - (1 - s) / ((1 - shifted[-1]) / (1 - 0.02)) for s in shifted]
    got = qwen_image_2_sigmas(steps, tokens, scheduler)
    torch.testing.assert_close(got, torch.tensor([*stretched, 0.0]), atol=1e-6, rtol=0)
    assert scheduler.timesteps is None or len(scheduler.timesteps) != steps  # the pipeline's copy untouched

    shipped = [1.0, 0.9, 0.6, 0.2]  # a checkpoint's own 4-step grid replaces linspace at 4 steps only
    with_grid = qwen_image_2_sigmas(steps, tokens, scheduler, shipped)
    assert not torch.allclose(with_grid, got, atol=1e-3)
    reference = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    reference.set_timesteps(sigmas=shipped, mu=mu)
    torch.testing.assert_close(with_grid, reference.sigmas, atol=0, rtol=0)
    torch.testing.assert_close(
        torch.from_numpy(sigma_grid(5, shipped)), torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2]).double()
    )
    assert not torch.allclose(qwen_image_2_sigmas(steps, tokens, scheduler, shift=2.0), got, atol=1e-3)


def test_each_prompt_length_runs_unpadded_so_a_sample_ignores_its_batch(lora_policy):
    """Padding moves the image block's RoPE frame position: a padded batch call changes the shorter
    prompt's prediction, so the adapter calls per length; each row equals its prompt's own call."""
    policy, x, cond = lora_policy
    perturb_lora(policy)
    embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_mask"]
    lengths = mask.sum(1).tolist()
    assert lengths[0] < lengths[1]
    sigma = 0.6
    with torch.no_grad():
        policy.guidance_scale = 1.0
        try:
            got = policy.velocity(x, torch.tensor(sigma), cond)
        finally:
            policy.guidance_scale = policy.cfg.guidance_scale
        alone = [_raw(policy, x[i : i + 1], sigma, embeds[i : i + 1, : lengths[i]]) for i in range(2)]
        padded = _raw(policy, x, sigma, embeds[:, : lengths[1]], mask[:, : lengths[1]])
    torch.testing.assert_close(got, torch.cat(alone))
    assert not torch.allclose(padded[0], alone[0][0], atol=1e-4)  # why the adapter does not pad
    torch.testing.assert_close(padded[1], alone[1][0])


def test_cfg_is_plain_without_the_norm_rescale(lora_policy):
    """v = u + g·(c − u) with c, u each prompt's own call; Qwen-Image 1.x's per-token norm rescale is not
    applied (it would change the result)."""
    policy, x, cond = lora_policy
    perturb_lora(policy)
    t = cond.tensors
    sigma = 0.6
    with torch.no_grad():
        c = torch.cat(
            [
                _raw(
                    policy,
                    x[i : i + 1],
                    sigma,
                    t["prompt_embeds"][i : i + 1, : int(t["prompt_mask"][i].sum())],
                )
                for i in range(2)
            ]
        )
        u = _raw(policy, x, sigma, t["neg_prompt_embeds"][:, : int(t["neg_prompt_mask"][0].sum())])
        got = policy.velocity(x, torch.tensor(sigma), cond)
    expected = u + 4.0 * (c - u)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    rescaled = expected * (c.norm(dim=-1, keepdim=True) / expected.norm(dim=-1, keepdim=True))
    assert not torch.allclose(got, rescaled, atol=1e-3)


def test_guidance_one_has_no_unconditional_branch(q_cfg):
    policy = _policy(q_cfg, guidance_scale=1.0)
    x, cond = policy.noise(1, torch.Generator().manual_seed(0)), policy.encode(PROMPTS[:1])
    assert set(cond.tensors) == {"prompt_embeds", "prompt_mask"}
    length = int(cond.tensors["prompt_mask"].sum())
    with torch.no_grad():
        direct = _raw(policy, x, 0.5, cond.tensors["prompt_embeds"][:, :length])
        torch.testing.assert_close(policy.velocity(x, torch.tensor(0.5), cond), direct)


def test_lora_targets_every_block_projection_all_alive(lora_policy):
    policy, x, cond = lora_policy
    names = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names) and len(policy.trainable.parameters()) == len(names)
    assert any("img_mlp.gate_layer" in n for n in names) and any("attn.to_out.0" in n for n in names)
    perturb_lora(policy)  # gaussian init has B = 0, which blocks A's gradient
    policy.velocity(x, torch.tensor(0.8), cond).square().mean().backward()
    silent = [
        n for n, p in policy.transformer.named_parameters() if p.requires_grad and not p.grad.abs().sum()
    ]
    assert silent == []


def test_lora_saved_in_diffusers_format_loads_with_load_lora_weights(tmp_path: Path, q_cfg, lora_policy):
    policy, x, cond = lora_policy
    perturb_lora(policy)
    policy.trainable.save(tmp_path)
    sigma = torch.tensor(0.5)
    expected = policy.velocity(x, sigma, cond).detach()

    plain = tiny_qwen_image_2_pipeline(0)
    plain.load_lora_weights(tmp_path, weight_name=LORA_WEIGHTS_NAME)  # α/r from the file's metadata
    reloaded = QwenImage2Policy(plain, replace(q_cfg, lora=replace(q_cfg.lora, enabled=False)), CPU)
    torch.testing.assert_close(reloaded.velocity(x, sigma, cond).detach(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(UserError, match="no LoRA weights"):
        policy.trainable.load(tmp_path / "missing")


def test_reference_disables_the_adapter(lora_policy):
    policy, x, cond = lora_policy
    with torch.no_grad():
        assert_reference_disables_the_adapter(policy, x, cond)


def test_shapes_rgba_decode_and_input_errors(q_cfg, shared):
    policy, _, cond = shared
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    both = policy.noise(2, gens)
    assert both.shape == (2, 16, 8) and both.dtype == torch.float32  # 4×4 latent, 8 channels
    torch.testing.assert_close(both[1:], policy.noise(1, [torch.Generator().manual_seed(6)]))
    rgba = policy.decode_rgba(both)
    assert rgba.shape == (2, 4, 64, 64)
    images = policy.decode(both)
    assert images.shape == (2, 3, 64, 64) and images.min() >= 0 and images.max() <= 1
    torch.testing.assert_close(images, rgba[:, :3] * rgba[:, 3:] + 1 - rgba[:, 3:])
    half = torch.tensor([0.2, 0.4, 1.0, 0.5]).view(1, 4, 1, 1)  # 0.2·0.5 + 0.5 = 0.6, …
    torch.testing.assert_close(over_white(half), torch.tensor([0.6, 0.7, 1.0]).view(1, 3, 1, 1))
    mask = cond.tensors["prompt_mask"]
    assert mask.shape == (2, q_cfg.max_sequence_length)
    # one token per byte, plus the template tail: <|im_start|> user \n (6), <|im_end|> \n <|im_start|>
    # assistant \n (13)
    assert mask.sum(1).tolist() == [len(p) + 19 for p in PROMPTS]
    with pytest.raises(UserError, match="multiple of 32"):
        _policy(q_cfg, resolution=48)
    with pytest.raises(UserError, match="model.max_sequence_length"):
        _policy(q_cfg, max_sequence_length=8).encode(PROMPTS[:1])


# -- through the CLI --------------------------------------------------------------------------------


def test_check_onpolicy_is_exact(tmp_path: Path, cli):
    code, out = cli("check-onpolicy", "model=tiny_qwen_image_2", *TINY_RUN, f"hydra.run.dir={tmp_path}")
    assert code == 0, out


def test_check_onpolicy_fails_when_weights_move_after_the_rollout(tmp_path: Path, cli):
    """The check can fail: noise of std 1e-3 on the LoRA between rollout and recompute exits 1."""
    code, out = cli(
        "check-onpolicy",
        "model=tiny_qwen_image_2",
        *TINY_RUN,
        "check.perturb_weights=1e-3",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 1, out
    assert "FAIL max error" in out, out


@pytest.mark.slow  # a 2-epoch CLI run
def test_training_through_the_cli_changes_every_lora_tensor(tmp_path: Path, q_cfg, cli):
    from peft.utils import get_peft_model_state_dict

    run_dir = tmp_path / "run"
    code, out = cli(
        "train", "model=tiny_qwen_image_2", *TINY_RUN, "epochs=2", "save_every=1", f"hydra.run.dir={run_dir}"
    )
    assert code == 0, out
    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    initial = {
        f"transformer.{k}": v for k, v in get_peft_model_state_dict(_policy(q_cfg).transformer).items()
    }
    trained = load_file(run_dir / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []
