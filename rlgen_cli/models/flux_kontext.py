"""FLUX.1-Kontext-dev behind the flow-policy protocol (instruction-based image editing).

Model: Labs et al. 2025, "FLUX.1 Kontext: Flow Matching for In-Context Image Generation and Editing in
Latent Space". The source image is VAE-encoded (distribution mode, then shift and scale as diffusers'
``FluxKontextPipeline._encode_vae_image``), packed into tokens and appended after the noisy target
tokens; its RoPE ids are (1, row, col) where the target's are (0, row, col). The transformer sees the
whole sequence, ``velocity`` returns the target tokens' prediction only, and the dynamic shift μ counts
target tokens only — as the pipeline does. Guidance is embedded (2.5 upstream), with no CFG branch.

The source is encoded at the size it is given (the recipe resizes it to the model's resolution);
diffusers' optional auto-resize to Kontext's preferred ≈ 1 MP resolutions is not applied, so the
sequence is twice the target's length.

Flow-GRPO settings (``counting_flux_kontext``): 6 / 28 steps, 512 px, LoRA r 64 / α 128
on FLUX's attention and feed-forward targets plus the single blocks' ``proj_mlp``
(:data:`KONTEXT_LORA_TARGETS`), noise level 0.9, bf16 (precision notes: ``models/_flux_common.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.models._flux_common import (
    FLUX_LORA_TARGETS,
    LORA_WEIGHTS_NAME,
    FluxFamilyPolicy,
    image_ids,
    pack,
    tiny_flux_components,
)
from rlgen_cli.models.base import Cond
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import ModelConfig

__all__ = [
    "KONTEXT_LORA_TARGETS",
    "LORA_WEIGHTS_NAME",
    "FluxKontextPolicy",
    "build",
    "load_flux_kontext_pipeline",
    "tiny_flux_kontext_pipeline",
]

KONTEXT_LORA_TARGETS = [*FLUX_LORA_TARGETS, "proj_mlp"]
"""Flow-GRPO's FLUX.1-Kontext LoRA targets: FLUX's plus the single-stream blocks' ``proj_mlp``."""

SOURCE_INDEX = 1
"""First RoPE id axis of source-image tokens (target tokens use 0)."""


def tiny_flux_kontext_pipeline(seed: int = 0) -> Any:
    """A tiny ``FluxKontextPipeline`` (the tiny FLUX modules), deterministic in ``seed``."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**tiny_flux_components(seed))


def load_flux_kontext_pipeline(cfg: ModelConfig) -> Any:
    """Load a real FLUX.1-Kontext pipeline from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import FluxKontextPipeline

    return load_pipeline(FluxKontextPipeline, cfg, "FLUX.1-Kontext")


class FluxKontextPolicy(FluxFamilyPolicy):
    """FLUX.1-Kontext (see the module docstring); ``encode`` needs the source images."""

    family = "flux_kontext"
    takes_source_images = True
    pipeline_class = "FluxKontextPipeline"

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning plus the packed source latents (B, L', D) and their ids (B, L', 3).

        Args:
            prompts: The edit instructions, one per sample.
            images: Source images (B, 3, H, W) in [0, 1], H and W multiples of 2·vae_scale_factor.

        Raises:
            UserError: If the images are missing or do not match the prompts.
        """
        if images is None:
            raise UserError(
                "FLUX.1-Kontext is an editing model: encode needs source images (B, 3, H, W) in [0, 1]; give "
                'every dataset line an "image" path (jsonl lines like {"prompt": ..., "image": "src/0.png"})'
            )
        if images.dim() != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            raise UserError(
                f"source images must be (B, 3, H, W) with B = {len(prompts)} prompts, got {tuple(images.shape)}"
            )
        tensors = self.encode_text(prompts)
        tokens, ids = self.encode_source(images)
        tensors["source_latents"] = tokens
        tensors["source_ids"] = ids.expand(len(prompts), -1, -1)
        return Cond(tensors)

    @torch.no_grad()
    def encode_source(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """Source images (B, 3, H, W) in [0, 1] → packed fp32 latents (B, L', D) and ids (L', 3)."""
        vae = self.pipeline.vae
        h = self._latent_side(images.shape[2], "height")
        w = self._latent_side(images.shape[3], "width")
        pixels = (images.to(self.device, vae.dtype) * 2 - 1).clamp(-1, 1)
        latents = vae.encode(pixels).latent_dist.mode()  # sample_mode="argmax", as the pipeline
        latents = (latents.float() - vae.config.shift_factor) * vae.config.scaling_factor
        return pack(latents), image_ids(h, w, index=SOURCE_INDEX, device=self.device)

    def context_tokens(self, cond: Cond) -> tuple[Tensor, Tensor]:
        """The source tokens and their ids, appended after the target tokens in ``velocity``."""
        return cond.tensors["source_latents"], cond.tensors["source_ids"][0]


def build(cfg: ModelConfig, device: torch.device) -> FluxKontextPolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, else the loaded one."""
    pipeline = (
        in_model_dtype(tiny_flux_kontext_pipeline(cfg.tiny_seed), cfg)
        if cfg.tiny
        else load_flux_kontext_pipeline(cfg)
    )
    return FluxKontextPolicy(pipeline, cfg, device)
