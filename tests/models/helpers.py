"""Helpers the model-adapter tests share: config loading, LoRA perturbation, the reference check."""

from __future__ import annotations

import torch

from rlgen_cli.schema.run import ModelConfig

CPU = torch.device("cpu")


def restoring_trainable(policy):
    """Yield; then put every trained parameter of ``policy`` back as it was and clear its gradients (a
    module-scoped policy shared by tests that train it)."""
    saved = [p.detach().clone() for p in policy.trainable.parameters()]
    yield
    with torch.no_grad():
        for param, value in zip(policy.trainable.parameters(), saved, strict=True):
            param.copy_(value)
            param.grad = None


def model_cfg(name: str) -> ModelConfig:
    """``conf/model/NAME.yaml`` merged into the schema."""
    from omegaconf import OmegaConf

    from rlgen_cli._hydra import conf_dir
    from rlgen_cli.schema.model import option_section

    return OmegaConf.to_object(option_section(OmegaConf.load(conf_dir() / "model" / f"{name}.yaml")))


def perturb_lora(policy, std: float = 0.5, generator: torch.Generator | None = None) -> None:
    """Draw every LoRA B matrix from N(0, std²), so the adapter changes the velocity (B starts at 0)."""
    with torch.no_grad():
        for name, param in policy.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std, generator=generator)


def assert_reference_disables_the_adapter(policy, x: torch.Tensor, cond) -> None:
    """Perturbing LoRA changes the velocity; ``reference()`` gives the pre-perturbation one and then
    switches the adapter back on."""
    sigma = torch.tensor(0.6)
    base = policy.velocity(x, sigma, cond).detach()
    perturb_lora(policy)
    tuned = policy.velocity(x, sigma, cond).detach()
    with policy.trainable.reference():
        ref = policy.velocity(x, sigma, cond).detach()
    assert not torch.allclose(tuned, base)
    torch.testing.assert_close(ref, base)
    torch.testing.assert_close(policy.velocity(x, sigma, cond).detach(), tuned)  # adapter back on


# -- pipeline parity: rlgen's noise-level-0 sampling against a diffusers pipeline's own __call__ --------


def base_policy(name: str, **changes):
    """The policy of ``conf/model/NAME.yaml`` without its LoRA adapter (the base model a pipeline samples);
    ``changes`` override config fields (e.g. ``guidance_scale``)."""
    from dataclasses import replace

    from rlgen_cli.models import build_policy

    cfg = model_cfg(name)
    return build_policy(replace(cfg, lora=replace(cfg.lora, enabled=False), **changes), CPU)


def as_loaded(pipeline):
    """``pipeline`` as ``from_pretrained`` hands it out: every module in eval mode and the bar off.

    The tiny builders construct their modules in training mode; a pipeline called in that state samples
    with dropout in its text encoders (the policy adapters switch it off themselves).
    """
    for component in pipeline.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def initial_noise_generators(seed: int, n: int) -> list[torch.Generator]:
    """Fresh generators of the streams :func:`ode_samples` draws sample i's initial noise from; a
    pipeline given them as ``generator=`` draws the same x₁ (one ``randn`` per sample)."""
    from rlgen_cli.sde.noise import Stream, sample_generators

    return sample_generators(seed, 0, range(n), CPU, salt=Stream.INITIAL_NOISE)


def ode_samples(policy, prompts: list[str], num_steps: int, seed: int, sources=None) -> torch.Tensor:
    """rlgen's decoded samples at noise level 0: the recipes' sampling path (encode, per-sample initial
    noise, ``schedule``, ``velocity``, ``decode``) with the ``flow_sde`` kernel at η = 0, the Euler ODE.
    Images (B, 3, H, W) or videos (B, 3, F, H, W) in [0, 1]."""
    from rlgen_cli.sde.rollout import StepSpec
    from rlgen_cli.sde.sampling import sample_images

    spec = StepSpec("flow_sde", 0.0)
    return sample_images(policy, prompts, num_steps, len(prompts), seed, spec=spec, sources=sources)
