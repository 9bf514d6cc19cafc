"""What every diffusers family's ``build`` does around its own policy class: pick the pipeline (random
init, tiny or loaded), then route ``encode`` through the prompt cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from rlgen_cli.models.loading import in_model_dtype
from rlgen_cli.models.prompt_cache import cache_prompt_embeddings
from rlgen_cli.models.real_size import flow_pipeline
from rlgen_cli.schema.run import ModelConfig

P = TypeVar("P")


def family_pipeline(
    cfg: ModelConfig,
    device: torch.device,
    tiny: Callable[[int], Any],
    load: Callable[[ModelConfig], Any],
    keep_fp32: tuple[str, ...] = (),
) -> Any:
    """The published architecture at random init when ``model.weights=random_init`` (``models/real_size.py``;
    validation admits it only for families with a real-size variant), ``tiny(model.tiny_seed)`` when
    ``model.tiny``, else ``load(cfg)``. Random and tiny pipelines are cast as the loader casts real weights
    (``loading.in_model_dtype``; ``keep_fp32`` names the components the loader keeps in fp32)."""
    if cfg.weights == "random_init":
        return in_model_dtype(flow_pipeline(cfg, device), cfg, keep_fp32=keep_fp32)
    if cfg.tiny:
        return in_model_dtype(tiny(cfg.tiny_seed), cfg, keep_fp32=keep_fp32)
    return load(cfg)


def with_prompt_cache(policy: P, cfg: ModelConfig, encoders: Sequence[nn.Module]) -> P:
    """``policy`` with ``encode`` routed through a prompt cache of ``model.prompt_cache_mb`` (a batch seen
    before is reused while the ``encoders`` are frozen)."""
    cache_prompt_embeddings(policy, cfg.prompt_cache_mb, encoders)  # type: ignore[arg-type]
    return policy
