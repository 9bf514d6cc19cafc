"""The latent grid every transformer family over a 2×2-grouped VAE latent sets up: the pipeline on its
device with frozen encoders, the VAE in the family's dtype, and the latent size of ``model.height`` ×
``model.width`` (:class:`LatentGrid`). FLUX.1 and Qwen-Image also cut the latent (B, C, h, w) into 2×2
patches, so the policy's ``x`` is the packed token sequence (B, h/2·w/2, 4C) in fp32: :class:`PackedModel`
adds their initial noise and token-count-shifted schedule; ``FluxModel`` and ``QwenModel`` add the
trainable transformer, its call and the VAE's codec."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from rlgen_cli.models.base import TORCH_DTYPES
from rlgen_cli.models.loading import image_size, pack, patch_multiple, prepare_pipeline, vae_dtype
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal
from rlgen_cli.sde.schedule import calculate_mu, shift_sigmas


class LatentGrid:
    """A pipeline on ``device`` with its ``encoders`` frozen and its VAE in the family's dtype (fp32 where
    ``fp32_vae``, unless ``model.vae_dtype`` says otherwise), and :attr:`latent_hw`, the latent size of
    ``cfg``'s images.

    Subclasses set ``encoders``, ``fp32_vae`` and ``grid_reason``: why an image side must be a multiple of
    2·``vae_scale_factor`` (``{factor}`` stands for the factor), said when it is not."""

    encoders: ClassVar[tuple[str, ...]] = ("vae", "text_encoder")
    fp32_vae: ClassVar[bool]
    grid_reason: ClassVar[str]

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        prepare_pipeline(pipeline, device, self.encoders, vae_dtype(cfg, fp32_by_default=self.fp32_vae))
        self.pipeline = pipeline
        height, width = image_size(cfg)
        self.latent_hw = (self.latent_side(height, "height"), self.latent_side(width, "width"))

    def latent_side(self, pixels: int, name: str) -> int:
        """Latent size of an image side; it must hold whole 2×2 groups of the downsampled latent."""
        factor = self.pipeline.vae_scale_factor
        patch_multiple(self.pipeline, pixels, name, self.grid_reason.format(factor=factor))
        return pixels // factor


def config_mu(image_tokens: int, config: Any) -> float:
    """The dynamic shift's μ for ``image_tokens``: linear between a scheduler config's
    (``base_image_seq_len``, ``base_shift``) and (``max_image_seq_len``, ``max_shift``), with diffusers'
    defaults (256, 0.5) and (4096, 1.15) for keys it lacks."""
    return calculate_mu(
        image_tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def static_shift_sigmas(num_steps: int, shift: float) -> Tensor:
    """(T+1,) sigmas of ``linspace(1, 0, T+1)`` under the static SD3 shift ``shift`` (``model.shift > 0``
    in place of a family's dynamic shift)."""
    return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1), shift)


class Sigmas(Protocol):
    def __call__(self, num_steps: int, image_tokens: int, config: Any, shift: float = 0.0) -> Tensor: ...


class PackedModel(LatentGrid):
    """A :class:`LatentGrid` whose ``x`` is the packed latent; subclasses also set ``sigmas``: the family's
    schedule from the number of image tokens and the pipeline's scheduler config."""

    sigmas: ClassVar[Sigmas]

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """x_1 ~ N(0, I) drawn in the latent shape (n, C, h, w), then packed: fp32 (n, L, 4C)."""
        shape = (self.pipeline.transformer.config.in_channels // 4, *self.latent_hw)
        return pack(standard_normal(n, shape, generator, self.device))

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """(T+1,) sigmas ending at 0 for the image tokens of ``x`` (the family's :attr:`sigmas`)."""
        config = self.pipeline.scheduler.config
        return type(self).sigmas(num_steps, x.shape[1], config, self.cfg.shift).to(self.device)
