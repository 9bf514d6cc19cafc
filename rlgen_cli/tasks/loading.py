"""Rebuild a policy for sampling or evaluation, from the config or from a checkpoint's own config."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import OmegaConf

from rlgen_cli.schema.flow import ModelConfig

log = logging.getLogger(__name__)


def _model_overrides() -> list[str]:
    """The ``model.*`` overrides the user typed (they win over a checkpoint's model config)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [o for o in HydraConfig.get().overrides.task if o.startswith("model.")]


def load_policy(model_cfg: ModelConfig, checkpoint: str | None, device_name: str) -> Any:
    """The policy of ``model_cfg``, or of ``checkpoint``'s config with its trained weights loaded.

    A checkpoint's weights only fit the model that made them, so its saved ``model`` section is used;
    explicit ``model.key=value`` overrides still apply on top (e.g. ``model.dtype``).
    """
    from rlgen_cli.models import build_policy, resolve_device
    from rlgen_cli.tasks.common import validated
    from rlgen_cli.training.checkpoint import open_checkpoint

    device = resolve_device(device_name)
    if checkpoint is None:
        return build_policy(model_cfg, device)
    ckpt = open_checkpoint(checkpoint)
    saved = OmegaConf.merge(OmegaConf.structured(ModelConfig), ckpt.config().model)
    overrides = OmegaConf.from_dotlist(_model_overrides())
    if "model" in overrides:
        saved = OmegaConf.merge(saved, overrides.model)
    policy = build_policy(validated(saved), device)
    policy.trainable.load(ckpt.weights)
    log.info("loaded trained weights from %s", ckpt.path)
    return policy
