"""The Z-Image adapter: real loading path, schedule and CFG convention equal to diffusers', LoRA format and
reference switch, input errors, and the CLI (training moves every LoRA tensor, ratio exactly 1).
Sampling parity with ``ZImagePipeline.__call__`` is in test_pipeline_parity.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.models.tiny import tiny_z_image_pipeline
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME
from rlgen_cli.models.z_image import ZImagePolicy, load_z_image_pipeline, pad_captions, z_image_sigmas
from tests.conftest import TINY_RUN
from tests.models.helpers import (
    CPU,
    assert_reference_disables_the_adapter,
    model_cfg,
    perturb_lora,
    restoring_trainable,
)

PROMPTS = ["a red circle", "two blue squares on a wooden table"]


@pytest.fixture(scope="module")
def z_cfg():
    return model_cfg("tiny_z_image")


def _policy(cfg, **changes) -> ZImagePolicy:
    return ZImagePolicy(tiny_z_image_pipeline(cfg.tiny_seed), replace(cfg, **changes), CPU)


@pytest.fixture(scope="module")
def shared(z_cfg):
    policy = _policy(z_cfg)
    return policy, policy.noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS)


@pytest.fixture
def lora_policy(shared):
    """The shared policy; its LoRA weights are restored after the test."""
    for _ in restoring_trainable(shared[0]):
        yield shared


def _raw(policy: ZImagePolicy, x, sigma: float, embeds, mask) -> torch.Tensor:
    """One plain transformer call on each prompt's valid tokens, in the pipeline's time t = 1 − σ."""
    frames = list(x.unsqueeze(2).unbind(0))
    captions = [e[m] for e, m in zip(embeds, mask, strict=True)]
    t = torch.full((x.shape[0],), 1.0 - sigma)
    return torch.stack(policy.transformer(frames, t, captions, return_dict=False)[0]).squeeze(2)


def test_save_pretrained_round_trip_through_the_real_loader(tmp_path: Path, z_cfg, shared):
    tiny_z_image_pipeline(0).save_pretrained(tmp_path / "z")
    cfg = replace(z_cfg, tiny=False, path=str(tmp_path / "z"), local_files_only=True)
    loaded = ZImagePolicy(load_z_image_pipeline(cfg), cfg, CPU)
    built, x, cond = shared
    sigma = torch.tensor(0.7)
    with torch.no_grad(), loaded.trainable.reference(), built.trainable.reference():
        torch.testing.assert_close(
            loaded.velocity(x, sigma, loaded.encode(PROMPTS)), built.velocity(x, sigma, cond)
        )
    with pytest.raises(UserError, match="model.path"):
        load_z_image_pipeline(replace(cfg, path=str(tmp_path / "nothing")))


def test_tiny_builder_is_deterministic_in_its_seed():
    a, b, c = tiny_z_image_pipeline(0), tiny_z_image_pipeline(0), tiny_z_image_pipeline(1)
    for part in ("transformer", "text_encoder"):
        pa, pb, pc = (dict(getattr(p, part).named_parameters()) for p in (a, b, c))
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
        assert not all(torch.equal(pa[k], pc[k]) for k in pa)


@pytest.mark.parametrize(
    "config",
    [
        {"shift": 3.0, "use_dynamic_shifting": False},
        {
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 1.15,
            "time_shift_type": "exponential",
        },
    ],
    ids=["static", "dynamic"],
)
def test_schedule_equals_the_pipelines_scheduler(config):
    """The pipeline calls set_timesteps(sigmas=linspace(1, 1/T, T), mu=μ(image tokens))."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    tokens, steps = 1024, 6
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=calculate_shift(tokens))
    got = z_image_sigmas(steps, tokens, scheduler.config)
    torch.testing.assert_close(got, scheduler.sigmas, atol=1e-6, rtol=0)
    assert got[0] == 1 and got[-1] == 0
    assert not torch.allclose(z_image_sigmas(steps, tokens, scheduler.config, shift=2.0), got, atol=1e-3)


def test_unsupported_scheduler_shift_is_a_user_error():
    with pytest.raises(UserError, match="model.shift"):
        z_image_sigmas(4, 256, {"use_dynamic_shifting": True, "time_shift_type": "linear"})


def test_cfg_flips_the_sign_and_combines_in_rlgen_convention(lora_policy):
    """v = −(u + g·(c − u)) with the transformer's x₀ − ε predictions c, u at t = 1 − σ."""
    policy, x, cond = lora_policy
    perturb_lora(policy)
    t = cond.tensors
    with torch.no_grad():
        c = _raw(policy, x, 0.6, t["prompt_embeds"], t["prompt_mask"])
        u = _raw(policy, x, 0.6, t["neg_prompt_embeds"], t["neg_prompt_mask"])
        got = policy.velocity(x, torch.tensor(0.6), cond)
    # the adapter runs both branches in one batch (other padding inside the transformer): fp32 rounding × g
    torch.testing.assert_close(got, -(u + 5.0 * (c - u)), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, -(u + 4.0 * (c - u)), atol=1e-3)  # the pipeline's g' = 4 is our g = 5


def test_guidance_one_has_no_unconditional_branch(z_cfg):
    policy = _policy(z_cfg, guidance_scale=1.0)
    x, cond = policy.noise(2, torch.Generator().manual_seed(0)), policy.encode(PROMPTS)
    assert set(cond.tensors) == {"prompt_embeds", "prompt_mask"}
    with torch.no_grad():
        direct = _raw(policy, x, 0.5, cond.tensors["prompt_embeds"], cond.tensors["prompt_mask"])
        torch.testing.assert_close(policy.velocity(x, torch.tensor(0.5), cond), -direct)


def test_lora_targets_attention_and_mlp_all_alive(lora_policy):
    policy, x, cond = lora_policy
    names = [n for n, p in policy.transformer.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names) and len(policy.trainable.parameters()) == len(names)
    assert any("feed_forward.w3" in n for n in names) and any("attention.to_out.0" in n for n in names)
    perturb_lora(policy)  # gaussian init has B = 0, which blocks A's gradient
    policy.velocity(x, torch.tensor(0.8), cond).square().mean().backward()
    silent = [
        n for n, p in policy.transformer.named_parameters() if p.requires_grad and not p.grad.abs().sum()
    ]
    assert silent == []


def test_lora_saved_in_diffusers_format_loads_with_load_lora_weights(tmp_path: Path, z_cfg, lora_policy):
    policy, x, cond = lora_policy
    perturb_lora(policy)
    policy.trainable.save(tmp_path)
    sigma = torch.tensor(0.5)
    expected = policy.velocity(x, sigma, cond).detach()

    plain = tiny_z_image_pipeline(0)
    plain.load_lora_weights(tmp_path, weight_name=LORA_WEIGHTS_NAME)  # α/r from the file's metadata
    reloaded = ZImagePolicy(plain, replace(z_cfg, lora=replace(z_cfg.lora, enabled=False)), CPU)
    torch.testing.assert_close(reloaded.velocity(x, sigma, cond).detach(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(UserError, match="no LoRA weights"):
        _policy(z_cfg).trainable.load(tmp_path / "missing")


def test_reference_disables_the_adapter(lora_policy):
    policy, x, cond = lora_policy
    with torch.no_grad():
        assert_reference_disables_the_adapter(policy, x, cond)


def test_shapes_padding_and_input_errors(z_cfg, shared):
    policy, _, cond = shared
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    both = policy.noise(2, gens)
    assert both.shape == (2, 4, 8, 8) and both.dtype == torch.float32
    torch.testing.assert_close(both[1:], policy.noise(1, [torch.Generator().manual_seed(6)]))
    images = policy.decode(both)
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    mask = cond.tensors["prompt_mask"]
    assert mask.shape == (2, z_cfg.max_sequence_length)
    # one token per byte plus the chat turn's 19: <|im_start|> user \n (6), <|im_end|> \n (2),
    # <|im_start|> assistant \n (11)
    assert mask.sum(1).tolist() == [len(p) + 19 for p in PROMPTS]
    with pytest.raises(UserError, match="multiple of 8"):
        _policy(z_cfg, resolution=36)
    with pytest.raises(UserError, match="model.max_sequence_length"):
        pad_captions([torch.zeros(5, 3)], 5)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    from tests.conftest import run_cli

    run_dir = tmp_path_factory.mktemp("z_rl") / "run"
    code, out = run_cli(
        "train", "model=tiny_z_image", *TINY_RUN, "epochs=2", "save_every=1", f"hydra.run.dir={run_dir}"
    )
    assert code == 0, out
    return run_dir


@pytest.mark.slow  # a 2-epoch CLI run: ≈ 60 s on 2 busy cores
def test_training_changes_every_lora_tensor(trained_run: Path, z_cfg):
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    initial = {
        f"transformer.{k}": v for k, v in get_peft_model_state_dict(_policy(z_cfg).transformer).items()
    }
    trained = load_file(trained_run / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    assert trained.keys() == initial.keys() and len(trained) > 0
    assert [k for k in trained if torch.equal(trained[k], initial[k])] == []


def test_check_onpolicy_passes(tmp_path: Path, cli):
    code, out = cli("check-onpolicy", "model=tiny_z_image", *TINY_RUN, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
