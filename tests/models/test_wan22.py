"""The Wan2.2 A14B adapter: the expert switch at the boundary on every path (sampling, the SDE window, the
recomputed log-probs, gradients), one expert frozen, pipeline parity with both experts (T2V and I2V),
the checkpoint format each expert's pipeline reads, the real loader and a CLI training run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.models.tiny import tiny_wan22_pipeline
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME
from rlgen_cli.models.wan22 import Wan22Policy, load_wan22_pipeline
from rlgen_cli.sde.rollout import StepSpec, recompute_step, rollout
from rlgen_cli.sde.window import WindowPlan
from tests.conftest import TINY_RUN
from tests.models.helpers import CPU, as_loaded, base_policy, initial_noise_generators, model_cfg, ode_samples

PROMPTS = ["a red circle", "a blue square"]
STEPS = 4
"""On the tiny shift-3 grid: timesteps 999, 900 (high-noise expert, t ≥ 875) and 750, 500 (low-noise)."""
HIGH_STEPS, LOW_STEPS = (0, 1), (2, 3)
SPEC = StepSpec("flow_sde", 0.7)


def _policy(
    name: str = "tiny_wan2_2", train: str = "both", guidance: float = 1.0, guidance_2: float | None = None
) -> Wan22Policy:
    cfg = model_cfg(name)
    experts = replace(cfg.experts, train=train, guidance_scale_2=guidance_2)
    cfg = replace(cfg, guidance_scale=guidance, experts=experts)
    torch.manual_seed(0)
    return Wan22Policy(tiny_wan22_pipeline(0, image_to_video=name.endswith("i2v")), cfg, CPU)


def _perturb_lora(policy: Wan22Policy) -> None:
    """LoRA B ~ N(0, 0.5²) on every trained expert, so each adapter moves its expert's velocity."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in policy.trainable.named():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


def _trajectory(policy: Wan22Policy, steps: tuple[int, ...]):
    cond = policy.encode(PROMPTS)
    x = policy.noise(2, torch.Generator().manual_seed(1))
    sigmas = policy.schedule(STEPS, x)
    plan = WindowPlan(STEPS, sde_steps=steps, train_steps=steps)
    traj = rollout(
        lambda z, s: policy.velocity(z, s, cond), x, sigmas, plan, SPEC, torch.Generator().manual_seed(2)
    )
    return traj, cond


@pytest.fixture(scope="module")
def cfg_policy() -> Wan22Policy:
    """Both experts trained, LoRA perturbed, CFG 4.5 on the high-noise and 3.0 on the low-noise expert."""
    policy = _policy(guidance=4.5, guidance_2=3.0)
    _perturb_lora(policy)
    return policy


def test_the_expert_follows_the_pipelines_boundary(cfg_policy: Wan22Policy):
    timesteps = torch.tensor([999.0, 900.0, 875.0, 874.0, 750.0])
    assert cfg_policy.expert_at(timesteps).tolist() == [True, True, True, False, False]  # t ≥ 0.875·1000


def test_a_window_across_the_boundary_recomputes_its_logprobs_exactly(cfg_policy, monkeypatch):
    """Steps 1 (t = 900, high noise) and 2 (t = 750, low noise) in one window: ratio exactly 1."""
    traj, cond = _trajectory(cfg_policy, (1, 2))
    velocity = lambda z, s: cfg_policy.velocity(z, s, cond)  # noqa: E731
    with torch.no_grad():
        for j in range(traj.num_steps):
            assert torch.equal(recompute_step(velocity, traj, j, SPEC).logprob, traj.logprobs[:, j])
        # The check can fail: the high-noise expert recomputing the low-noise step is far off.
        monkeypatch.setattr(cfg_policy, "expert_at", lambda t: torch.ones_like(t, dtype=torch.bool))
        wrong = recompute_step(velocity, traj, 1, SPEC).logprob
    assert (wrong - traj.logprobs[:, 1]).abs().max() > 1e-2


def test_each_expert_gets_gradient_only_at_its_own_steps(cfg_policy: Wan22Policy):
    traj, cond = _trajectory(cfg_policy, tuple(range(STEPS)))
    velocity = lambda z, s: cfg_policy.velocity(z, s, cond)  # noqa: E731
    for j in range(STEPS):
        for param in cfg_policy.trainable.parameters():
            param.grad = None
        recompute_step(velocity, traj, j, SPEC).logprob.sum().backward()
        touched = {
            expert
            for expert in ("high_noise", "low_noise")
            for name, p in cfg_policy.trainable.named()
            if name.startswith(expert) and p.grad is not None and p.grad.abs().sum() > 0
        }
        assert touched == ({"high_noise"} if j in HIGH_STEPS else {"low_noise"}), j


@pytest.mark.parametrize(("train", "frozen"), [("high_noise", "transformer_2"), ("low_noise", "transformer")])
def test_a_frozen_expert_keeps_its_weights_after_a_step(train: str, frozen: str):
    policy = _policy(train=train)
    frozen_module = getattr(policy.pipeline, frozen)
    before = {k: v.clone() for k, v in frozen_module.state_dict().items()}
    assert not any("lora_" in k for k in before) and not any(
        p.requires_grad for p in frozen_module.parameters()
    )
    assert all(name.startswith(train) for name, _ in policy.trainable.named())
    trained = [p.detach().clone() for p in policy.trainable.parameters()]

    traj, cond = _trajectory(policy, tuple(range(STEPS)))  # both experts' steps in the loss
    optimizer = torch.optim.AdamW(policy.trainable.parameters(), lr=1e-2)
    loss = sum(
        recompute_step(lambda z, s: policy.velocity(z, s, cond), traj, j, SPEC).logprob.sum()
        for j in range(STEPS)
    )
    loss.backward()
    optimizer.step()
    after = frozen_module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not torch.equal(a, b) for a, b in zip(trained, policy.trainable.parameters(), strict=True))


def test_per_sample_sigmas_on_both_sides_run_each_samples_expert(cfg_policy: Wan22Policy):
    x, cond = cfg_policy.noise(2, torch.Generator().manual_seed(0)), cfg_policy.encode(PROMPTS)
    high, low = torch.tensor(0.9), torch.tensor(0.5)
    mixed = cfg_policy.velocity(x, torch.stack([high, low]), cond)
    torch.testing.assert_close(mixed[:1], cfg_policy.velocity(x[:1], high, cond.index(slice(0, 1))))
    torch.testing.assert_close(mixed[1:], cfg_policy.velocity(x[1:], low, cond.index(slice(1, 2))))


def test_low_noise_guidance_without_cfg_is_refused():
    with pytest.raises(UserError, match="model.experts.guidance_scale_2"):
        _policy(guidance_2=3.0)  # guidance_scale 1: no negative branch


# -- pipeline parity: both experts, the pipeline's own __call__ ------------------------------------------
def _unipc_euler(pipe):
    """UniPC at order 1 without corrector: the Euler step on the pipeline's grid (docs/adding_a_model.md)."""
    from diffusers import UniPCMultistepScheduler

    pipe.scheduler = UniPCMultistepScheduler.from_config(
        pipe.scheduler.config, solver_order=1, disable_corrector=list(range(STEPS))
    )
    return pipe


def _t2v_pipeline_call(policy: Wan22Policy, sources) -> torch.Tensor:
    cfg = policy.cfg
    pipe = _unipc_euler(as_loaded(tiny_wan22_pipeline(cfg.tiny_seed, cfg.max_sequence_length)))
    frames = pipe(
        PROMPTS,
        negative_prompt=cfg.negative_prompt if policy.guidance_scale > 1 else None,
        height=cfg.height,
        width=cfg.width,
        num_frames=cfg.num_frames,
        num_inference_steps=STEPS,
        guidance_scale=policy.guidance_scale,
        guidance_scale_2=policy.guidance_scale_2,
        generator=initial_noise_generators(3, 2),
        max_sequence_length=cfg.max_sequence_length,
        output_type="pt",
    ).frames
    return frames.permute(0, 2, 1, 3, 4)


def _i2v_pipeline_call(policy: Wan22Policy, sources) -> torch.Tensor:
    """One sample per call: the I2V pipeline encodes the whole image batch once per generator."""
    from diffusers import WanPipeline

    cfg = policy.cfg
    pipe = _unipc_euler(
        as_loaded(tiny_wan22_pipeline(cfg.tiny_seed, cfg.max_sequence_length, image_to_video=True))
    )
    # diffusers' T5 prompt path (the I2V pipeline's own cleaning needs ftfy, not installed here)
    text = WanPipeline(pipe.tokenizer, pipe.text_encoder, None, None, pipe.scheduler)
    videos = []
    for i, generator in enumerate(initial_noise_generators(3, 2)):
        embeds, neg = text.encode_prompt(
            PROMPTS[i],
            [cfg.negative_prompt],
            do_classifier_free_guidance=policy.guidance_scale > 1,
            max_sequence_length=cfg.max_sequence_length,
        )
        frames = pipe(
            image=sources[i : i + 1],
            prompt_embeds=embeds,
            negative_prompt_embeds=neg,
            height=cfg.height,
            width=cfg.width,
            num_frames=cfg.num_frames,
            num_inference_steps=STEPS,
            guidance_scale=policy.guidance_scale,
            guidance_scale_2=policy.guidance_scale_2,
            generator=[generator],
            output_type="pt",
        ).frames
        videos.append(frames.permute(0, 2, 1, 3, 4))
    return torch.cat(videos)


@pytest.mark.parametrize(
    ("name", "guidance", "guidance_2", "pipeline_call"),
    [
        ("tiny_wan2_2", 1.0, None, _t2v_pipeline_call),
        ("tiny_wan2_2", 4.5, 3.0, _t2v_pipeline_call),
        ("tiny_wan2_2_i2v", 4.5, 2.0, _i2v_pipeline_call),
    ],
)
def test_decoded_samples_equal_the_pipelines_own_call_with_both_experts(
    name, guidance, guidance_2, pipeline_call
):
    """max |rlgen − pipeline| ≤ 1e-5 on every decoded pixel (fp32); 4 steps = 2 per expert."""
    cfg = model_cfg(name)
    policy = base_policy(
        name, guidance_scale=guidance, experts=replace(cfg.experts, guidance_scale_2=guidance_2)
    )
    sources = torch.randint(0, 256, (2, 3, 32, 48), generator=torch.Generator().manual_seed(11)) / 255.0
    sources = sources if policy.capabilities.takes_source_images else None
    with torch.no_grad():
        expected = pipeline_call(policy, sources)
        got = ode_samples(policy, PROMPTS, STEPS, 3, sources)
        assert got.shape == expected.shape == (2, 3, 5, 32, 48)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        # The check can fail: the high-noise expert on every step misses by far.
        policy.boundary_timestep = 0.0
        near_miss = ode_samples(policy, PROMPTS, STEPS, 3, sources)
    assert (near_miss - expected).abs().max() > 1e-3


# -- checkpoints, loading, the CLI ------------------------------------------------------------------------
def test_each_experts_lora_loads_with_the_pipelines_load_lora_weights(
    tmp_path: Path, cfg_policy: Wan22Policy
):
    cfg_policy.trainable.save(tmp_path)
    assert (tmp_path / "high_noise" / LORA_WEIGHTS_NAME).is_file()
    assert (tmp_path / "low_noise" / LORA_WEIGHTS_NAME).is_file()
    x, cond = cfg_policy.noise(2, torch.Generator().manual_seed(0)), cfg_policy.encode(PROMPTS)
    sigmas = (torch.tensor(0.95), torch.tensor(0.5))  # one step per expert
    expected = [cfg_policy.velocity(x, s, cond).detach() for s in sigmas]

    plain = tiny_wan22_pipeline(0)
    plain.load_lora_weights(tmp_path / "high_noise", weight_name=LORA_WEIGHTS_NAME)
    plain.load_lora_weights(
        tmp_path / "low_noise", weight_name=LORA_WEIGHTS_NAME, load_into_transformer_2=True
    )
    no_lora = replace(cfg_policy.cfg, lora=replace(cfg_policy.cfg.lora, enabled=False))
    reloaded = Wan22Policy(plain, no_lora, CPU)
    for sigma, want in zip(sigmas, expected, strict=True):
        torch.testing.assert_close(reloaded.velocity(x, sigma, cond), want, atol=1e-5, rtol=1e-5)

    fresh = _policy(guidance=4.5, guidance_2=3.0)
    fresh.trainable.load(tmp_path)
    for sigma, want in zip(sigmas, expected, strict=True):
        torch.testing.assert_close(fresh.velocity(x, sigma, cond).detach(), want)


def test_reference_disables_both_adapters(cfg_policy: Wan22Policy):
    x, cond = cfg_policy.noise(2, torch.Generator().manual_seed(0)), cfg_policy.encode(PROMPTS)
    base = _policy(guidance=4.5, guidance_2=3.0)  # same weights, LoRA B = 0
    for sigma in (torch.tensor(0.95), torch.tensor(0.5)):
        with cfg_policy.trainable.reference():
            ref = cfg_policy.velocity(x, sigma, cond)
        torch.testing.assert_close(ref, base.velocity(x, sigma, cond).detach())
        assert not torch.allclose(cfg_policy.velocity(x, sigma, cond), ref)


@pytest.mark.parametrize("name", ["tiny_wan2_2", "tiny_wan2_2_i2v"])
def test_save_pretrained_round_trip_through_the_real_loader(tmp_path: Path, name: str):
    i2v = name.endswith("i2v")
    tiny_wan22_pipeline(0, image_to_video=i2v).save_pretrained(tmp_path / "wan22")
    cfg = replace(model_cfg(name), tiny=False, path=str(tmp_path / "wan22"), local_files_only=True)
    torch.manual_seed(0)
    loaded = Wan22Policy(load_wan22_pipeline(cfg, image_to_video=i2v), cfg, CPU)
    built = _policy(name)
    sources = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0)) if i2v else None
    x = built.noise(2, torch.Generator().manual_seed(0))
    for sigma in (torch.tensor(0.95), torch.tensor(0.5)):
        torch.testing.assert_close(
            loaded.velocity(x, sigma, loaded.encode(PROMPTS, sources)),
            built.velocity(x, sigma, built.encode(PROMPTS, sources)),
        )


def test_a_one_transformer_checkpoint_is_refused(tmp_path: Path):
    from rlgen_cli.models.tiny import tiny_wan_pipeline

    tiny_wan_pipeline(0).save_pretrained(tmp_path / "wan21")
    cfg = replace(model_cfg("tiny_wan2_2"), tiny=False, path=str(tmp_path / "wan21"), local_files_only=True)
    with pytest.raises(UserError, match="two-expert"):
        Wan22Policy(load_wan22_pipeline(cfg, image_to_video=False), cfg, CPU)


@pytest.mark.slow
def test_cli_training_changes_every_lora_tensor_of_both_experts(tmp_path: Path, cli):
    run_dir = tmp_path / "run"
    code, out = cli(
        "train",
        "model=tiny_wan2_2",
        *TINY_RUN,
        "model.num_steps=4",
        "epochs=2",
        "save_every=1",
        "images_every=0",
        "eval_every=0",
        "algo.lr=1e-2",
        f"hydra.run.dir={run_dir}",
    )
    assert code == 0, out
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapters
    initial = Wan22Policy(tiny_wan22_pipeline(0), model_cfg("tiny_wan2_2"), CPU)
    weights = run_dir / "checkpoints" / "epoch_000002" / "weights"
    for expert in ("high_noise", "low_noise"):
        module = initial.trainable.experts[expert].module
        before = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(module).items()}
        after = load_file(weights / expert / LORA_WEIGHTS_NAME)
        assert after.keys() == before.keys() and len(after) == 32
        assert [k for k in after if torch.equal(after[k], before[k])] == [], expert


def test_check_onpolicy_passes_across_the_boundary_with_cfg(tmp_path: Path, cli):
    code, out = cli(
        "check-onpolicy",
        "model=tiny_wan2_2",
        "model.guidance_scale=4.5",
        "model.experts.guidance_scale_2=3.0",
        *TINY_RUN,
        "model.num_steps=4",
        f"hydra.run.dir={tmp_path / 'check'}",
    )
    assert code == 0, out
    assert "PASS" in out
