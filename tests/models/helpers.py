"""Helpers the model-adapter tests share: config loading, LoRA perturbation, the reference check."""

from __future__ import annotations

import torch

from rlgen_cli.schema.flow import ModelConfig

CPU = torch.device("cpu")


def model_cfg(name: str) -> ModelConfig:
    """``conf/model/NAME.yaml`` merged into the schema."""
    from omegaconf import OmegaConf

    from rlgen_cli._hydra import conf_dir

    raw = OmegaConf.load(conf_dir() / "model" / f"{name}.yaml")
    raw.pop("defaults", None)  # the data / reward a model picks for a run, not model settings
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))


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
    with policy.reference():
        ref = policy.velocity(x, sigma, cond).detach()
    assert not torch.allclose(tuned, base)
    torch.testing.assert_close(ref, base)
    torch.testing.assert_close(policy.velocity(x, sigma, cond).detach(), tuned)  # adapter back on
