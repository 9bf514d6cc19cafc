"""Rebuild a policy for sampling or evaluation, from the config or from a checkpoint's own config.

A checkpoint's weights only fit the model that made them, so ``rlgen sample`` / ``rlgen eval`` of a
checkpoint draw with the checkpoint's saved ``model`` section (explicit ``model.key=value`` overrides on
top). :func:`with_checkpoint_model` puts that section into the verb's config before ``resolved.yaml`` is
written, so the run directory records the model that drew the images, and :func:`describe_model` is the
line ``run.log`` names it with.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlgen_cli.schema.model import typed_model_section
from rlgen_cli.schema.run import ModelConfig

log = logging.getLogger(__name__)


def _model_overrides() -> list[str]:
    """The ``model.*`` overrides the user typed (they win over a checkpoint's model config)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [o for o in HydraConfig.get().overrides.task if o.startswith("model.")]


def checkpoint_model(checkpoint: str, user_overrides: bool = True) -> DictConfig:
    """The ``model`` section ``checkpoint``'s weights fit: its saved one, with the user's ``model.*``
    overrides on top (e.g. ``model.dtype``) unless ``user_overrides`` is off (a VLM checkpoint loads
    its saved section as it is)."""
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    saved = typed_model_section(open_checkpoint(checkpoint).config().model)
    overrides = OmegaConf.from_dotlist(_model_overrides() if user_overrides else [])
    if "model" in overrides:
        saved = OmegaConf.merge(saved, overrides.model)
    return saved


def with_checkpoint_model(cfg: DictConfig, checkpoint: str | None, user_overrides: bool = True) -> DictConfig:
    """``cfg`` with its ``model`` replaced by the checkpoint's (unchanged without a checkpoint): the config
    the run really uses, which ``resolved.yaml`` then records."""
    if checkpoint is None:
        return cfg
    cfg = cfg.copy()
    cfg.model = checkpoint_model(checkpoint, user_overrides)
    return cfg


def with_checkpoint_policy(cfg: DictConfig, checkpoint: str | None) -> DictConfig:
    """``cfg`` with ``r3.policy`` replaced by the checkpoint's, as R3's evaluation loads it (a unified
    policy's weights fit only the parts that made them)."""
    if checkpoint is None:
        return cfg
    from rlgen_cli.schema.r3 import typed_policy
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    cfg = cfg.copy()
    saved = open_checkpoint(checkpoint).config().r3.policy
    cfg.r3.policy = typed_policy(cfg.model.family, saved)
    return cfg


def describe_model(model_cfg: ModelConfig, checkpoint: str | None) -> str:
    """What draws the images, in one line: the family, where its weights come from, its sampling
    settings, and the checkpoint whose trained weights are loaded."""
    if model_cfg.tiny:
        source = f"tiny (random weights, tiny_seed={model_cfg.tiny_seed})"
    elif model_cfg.weights == "random_init":
        source = f"random_init ({model_cfg.variant} architecture, tiny_seed={model_cfg.tiny_seed})"
    else:
        source = f"path={model_cfg.path}" + (f"@{model_cfg.revision}" if model_cfg.revision else "")
    trained = f", trained weights of {checkpoint}" if checkpoint else ", base weights"
    if not hasattr(model_cfg, "resolution"):  # a VLM's section: no image size or guidance to report
        return f"model.family={model_cfg.family} {source}, dtype={model_cfg.dtype}{trained}"
    size = f"{model_cfg.height or model_cfg.resolution}x{model_cfg.width or model_cfg.resolution}"
    return (
        f"model.family={model_cfg.family} {source}, dtype={model_cfg.dtype}, {size}, "
        f"guidance_scale={model_cfg.guidance_scale}{trained}"
    )


def load_policy(model_cfg: ModelConfig, checkpoint: str | None, device_name: str) -> Any:
    """The policy of ``model_cfg`` with ``checkpoint``'s trained weights loaded (when given).

    ``model_cfg`` is the model the run uses: with a checkpoint, the one :func:`with_checkpoint_model` put
    into the config.
    """
    from rlgen_cli.models import build_policy, resolve_device
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    policy = build_policy(model_cfg, resolve_device(device_name))
    if checkpoint is None:
        return policy
    ckpt = open_checkpoint(checkpoint)
    policy.trainable.load(ckpt.weights)
    log.info("loaded trained weights from %s", ckpt.path)
    return policy
