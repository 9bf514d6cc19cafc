"""Pieces every diffusers family shares: loading a pipeline as a user-facing operation, and the 2×2
latent packing that FLUX and Qwen-Image feed their transformers."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlgen_cli.models.base import TORCH_DTYPES
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import ModelConfig


def load_pipeline(pipeline_cls: type, cfg: ModelConfig, what: str) -> Any:
    """``pipeline_cls.from_pretrained(cfg.path)`` in ``cfg.dtype``; a failure is a :class:`UserError`."""
    try:
        return pipeline_cls.from_pretrained(
            cfg.path, torch_dtype=TORCH_DTYPES[cfg.dtype], local_files_only=cfg.local_files_only,
            revision=cfg.revision,
        )  # fmt: skip
    except (OSError, ValueError) as err:
        raise UserError(
            f"could not load a {what} pipeline from model.path={cfg.path!r}: {err}. Pass a local directory "
            "saved with save_pretrained, or a hub id with network access (model.local_files_only=false)"
        ) from err


def in_model_dtype(pipeline: Any, cfg: ModelConfig, keep_fp32: tuple[str, ...] = ()) -> Any:
    """A tiny pipeline (built in fp32) as :func:`load_pipeline` gives a real one: every module in
    ``model.dtype``, except the components ``keep_fp32`` the family's loader keeps in fp32. So the tiny
    models run the low-precision paths of real runs (docs/precision.md)."""
    pipeline.to(dtype=TORCH_DTYPES[cfg.dtype])
    for name in keep_fp32:
        getattr(pipeline, name).to(torch.float32)
    return pipeline


def pack(latents: Tensor) -> Tensor:
    """(B, C, h, w) → (B, h/2·w/2, 4C): 2×2 patches as tokens (diffusers' ``_pack_latents``)."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of :func:`pack` for an h×w latent: (B, L, 4C) → (B, C, h, w)."""
    b, _, d = tokens.shape
    patches = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, d // 4, h, w)
