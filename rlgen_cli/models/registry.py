"""Model-family registry: ``model.family`` → a builder returning a flow policy."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlgen_cli.models.base import FlowPolicy
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import ModelConfig


def _build_sd3(cfg: ModelConfig, device: torch.device) -> FlowPolicy:
    from rlgen_cli.models.sd3 import SD3Policy, load_sd3_pipeline, tiny_sd3_pipeline

    pipeline = (
        tiny_sd3_pipeline(cfg.tiny_seed, cfg.max_sequence_length) if cfg.tiny else load_sd3_pipeline(cfg)
    )
    return SD3Policy(pipeline, cfg, device)


FAMILIES: dict[str, Callable[[ModelConfig, torch.device], FlowPolicy]] = {"sd3": _build_sd3}


def build_policy(cfg: ModelConfig, device: torch.device) -> FlowPolicy:
    """Build the flow policy of ``cfg.family`` (tiny or loaded) on ``device``."""
    try:
        builder = FAMILIES[cfg.family]
    except KeyError:
        raise UserError(
            f"model.family={cfg.family!r} is unknown; families: {', '.join(sorted(FAMILIES))}"
        ) from None
    return builder(cfg, device)
