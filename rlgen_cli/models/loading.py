"""Pieces every diffusers family shares: loading a pipeline as a user-facing operation, and the 2×2
latent packing that FLUX and Qwen-Image feed their transformers."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import TORCH_DTYPES
from rlgen_cli.schema.run import ModelConfig

TRANSFORMERS = ("transformer", "transformer_2")
"""The pipeline components ``model.frozen_dtype`` applies to (Wan2.2's second expert included)."""


def frozen_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype of the transformer's frozen weights: ``model.frozen_dtype``, null = ``model.dtype``."""
    return TORCH_DTYPES[cfg.frozen_dtype or cfg.dtype]


def vae_dtype(cfg: ModelConfig, fp32_by_default: bool) -> torch.dtype:
    """The VAE's dtype: ``model.vae_dtype``, null = the family's own (fp32 where ``fp32_by_default``, else
    ``model.dtype``)."""
    if cfg.vae_dtype is not None:
        return TORCH_DTYPES[cfg.vae_dtype]
    return torch.float32 if fp32_by_default else TORCH_DTYPES[cfg.dtype]


def set_dtypes(cfg: ModelConfig) -> dict[str, torch.dtype]:
    """The components whose dtype the model section sets explicitly: the transformers for
    ``model.frozen_dtype``, the VAE for ``model.vae_dtype``. They are loaded straight in it, so fp32 weights
    never pass through ``model.dtype`` (a round trip would round them)."""
    dtypes = {name: TORCH_DTYPES[cfg.frozen_dtype] for name in TRANSFORMERS} if cfg.frozen_dtype else {}
    if cfg.vae_dtype is not None:
        dtypes["vae"] = TORCH_DTYPES[cfg.vae_dtype]
    return dtypes


def load_dtypes(cfg: ModelConfig) -> torch.dtype | dict[str, torch.dtype]:
    """``torch_dtype`` for ``from_pretrained``: ``model.dtype``, per component where :func:`set_dtypes`
    names one (diffusers' ``{component: dtype, "default": dtype}``)."""
    explicit = set_dtypes(cfg)
    return {"default": TORCH_DTYPES[cfg.dtype], **explicit} if explicit else TORCH_DTYPES[cfg.dtype]


def load_pipeline(pipeline_cls: type, cfg: ModelConfig, what: str) -> Any:
    """``pipeline_cls.from_pretrained(cfg.path)`` in :func:`load_dtypes`; a failure is a :class:`UserError`."""
    try:
        return pipeline_cls.from_pretrained(
            cfg.path,
            torch_dtype=load_dtypes(cfg),
            local_files_only=cfg.local_files_only,
            revision=cfg.revision,
        )
    except (OSError, ValueError) as err:
        raise UserError(
            f"could not load a {what} pipeline from model.path={cfg.path!r}: {err}. Pass a local directory "
            "saved with save_pretrained, or a hub id with network access (model.local_files_only=false)"
        ) from err


def prepare_pipeline(pipeline: Any, device: torch.device, frozen: tuple[str, ...], vae: torch.dtype) -> None:
    """``pipeline`` on ``device`` for rollouts: its progress bar off, the components named in ``frozen``
    (absent ones skipped) without gradients and in eval mode, the VAE in ``vae`` (:func:`vae_dtype`). The
    transformer is left to ``TrainableTransformer``."""
    pipeline.to(device)
    cast_as_loaded(pipeline.vae, vae)
    freeze_on(pipeline, device, frozen)  # the move again is a no-op


def freeze_on(pipeline: Any, device: torch.device, frozen: tuple[str, ...]) -> None:
    """``pipeline`` on ``device``, its progress bar off, the components named in ``frozen`` (absent ones
    skipped) without gradients and in eval mode; dtypes untouched."""
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    for name in frozen:
        part = getattr(pipeline, name, None)
        if part is not None:
            part.requires_grad_(False).eval()


def image_size(cfg: ModelConfig) -> tuple[int, int]:
    """(height, width) in pixels: ``model.height`` / ``model.width``, each defaulting to ``model.resolution``."""
    return cfg.height or cfg.resolution, cfg.width or cfg.resolution


def patch_multiple(pipeline: Any, pixels: int, name: str, why: str) -> int:
    """The pixel multiple an image side needs when the transformer groups 2×2 latent cells
    (2 · ``vae_scale_factor``); a side off that grid is a :class:`UserError` whose reason is ``why``."""
    multiple = pipeline.vae_scale_factor * 2
    if pixels % multiple:
        raise UserError(
            f"image {name} {pixels} px is not a multiple of {multiple}: {why}; set model.resolution (or "
            f"model.{name}) to a multiple of {multiple}"
        )
    return multiple


def kept_in_fp32(module: nn.Module, dtype: torch.dtype) -> frozenset[str]:
    """Module names whose weights ``from_pretrained(torch_dtype=dtype)`` keeps in fp32: a diffusers model's
    ``_keep_in_fp32_modules`` in any low dtype (Wan's norms and time embedding), a transformers model's
    in fp16 only (T5's ``wo``), plus its ``_keep_in_fp32_modules_strict`` in fp16 and bf16."""
    if dtype == torch.float32:
        return frozenset()
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    if type(module).__module__.startswith("transformers."):
        keep = keep if dtype == torch.float16 else set()
        keep |= set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    return frozenset(keep)


def cast_as_loaded(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module`` in place as ``from_pretrained(torch_dtype=dtype)`` would have loaded it: floating
    weights and buffers in ``dtype`` except those under :func:`kept_in_fp32` names."""
    keep = kept_in_fp32(module, dtype)
    nn.Module.to(module, dtype)  # not diffusers' override, which warns about the modules restored below
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        if keep & set(name.split(".")):
            tensor.data = tensor.data.float()


def in_model_dtype(pipeline: Any, cfg: ModelConfig, keep_fp32: tuple[str, ...] = ()) -> Any:
    """A tiny pipeline (built in fp32) as :func:`load_pipeline` gives a real one: every module cast by
    :func:`cast_as_loaded` to ``model.dtype``, except the components ``keep_fp32`` that the family's loader
    moves back to fp32 (Wan's VAE) and those :func:`set_dtypes` names. So the tiny models run the
    low-precision paths of real runs (docs/precision.md)."""
    dtype, explicit = TORCH_DTYPES[cfg.dtype], set_dtypes(cfg)
    for name, component in pipeline.components.items():
        if isinstance(component, nn.Module):
            default = torch.float32 if name in keep_fp32 else dtype
            cast_as_loaded(component, explicit.get(name, default))
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


def latent_statistics(vae: Any, device: torch.device) -> tuple[Tensor, Tensor]:
    """The VAE's per-channel latent mean and std from its config, each (1, C, 1, 1, 1) fp32 (the video
    VAEs of Wan and Qwen-Image normalise latents as (z − mean) / std)."""
    mean = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    return mean, std


def to_unit(images: Tensor) -> Tensor:
    """The VAE's output in [-1, 1] → fp32 in [0, 1]."""
    return (images.float() / 2 + 0.5).clamp(0, 1)


def decode_shifted(vae: Any, latents: Tensor) -> Tensor:
    """Latents (B, C, h, w) as the transformer sees them → images (B, 3, H, W) in [0, 1], fp32: un-scaled and
    un-shifted by the VAE config's ``scaling_factor`` / ``shift_factor`` (SD3, FLUX.1, Z-Image)."""
    latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    return to_unit(vae.decode(latents.to(vae.dtype), return_dict=False)[0])
