"""Qwen-Image 2.x editing (a prompt and a source image) behind the flow-policy protocol.

The same checkpoint and pipeline as ``qwen_image_2`` (``QwenImage21Pipeline``), called with a condition
image (its ``image=``). As the pipeline does, the source conditions the model twice: the Qwen3-VL encoder
reads it in the edit template (``<image1><|vision_start|><|image_pad|><|vision_end|>`` before the prompt,
so the prompt attends to it), and its VAE latent tokens take the encoder's image slots: each slot stands
for a 2×2 group of latent tokens, the source's tokens come before the target's in the transformer's
sequence, and the source's latent grid is listed before the target's in ``img_shapes``. ``velocity``
returns only the target tokens' prediction; the source's tokens, like the text, are modulated at t = 0
(``causal_condition``), so they never depend on the step.

Sources arrive as (B, 3, H, W) in [0, 1], one per prompt, sides multiples of 32 px (the recipe resizes them
to the model size; the pipeline resizes them to ``output_resolution``², which is what the sampling size
is by default). The encoder receives them as 8-bit RGB images, exactly what the pipeline's processor gets
from PIL inputs; the VAE, which reads RGBA, gets them opaque (alpha 1), as the pipeline converts an RGB
input, and encodes them deterministically (posterior mode). The pipeline applies one set of condition
images to a whole batch; rlgen encodes each example with its own source, one prompt per encoder call,
and runs each prompt length as a call of its own (``models/qwen_image_2.py``), so every sample's velocity
is the pipeline's for that example alone. The negative branch pairs ``model.negative_prompt`` with the same
source, as the pipeline's.

Settings, schedule, CFG, precision and LoRA targets are ``qwen_image_2``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.models._component_policy import check_sources
from rlgen_cli.models.base import Capabilities, Cond
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import latent_statistics
from rlgen_cli.models.qwen_image_2 import (
    QWEN_IMAGE_2_LORA_TARGETS,
    QwenImage2Policy,
    Source,
    load_qwen_image_2_pipeline,
)
from rlgen_cli.models.qwen_image_edit import to_pil
from rlgen_cli.models.tiny.qwen_image_2 import tiny_qwen_image_2_edit_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = ["QWEN_IMAGE_2_LORA_TARGETS", "QwenImage2EditPolicy", "build"]

MISSING_SOURCE = (
    'Qwen-Image 2.x editing needs a source image per prompt: give the dataset an "image" field per line '
    '(jsonl lines like {"prompt": ..., "image": "src/0001.png"})'
)


class QwenImage2EditPolicy(QwenImage2Policy):
    """Qwen-Image 2.x editing: prompt + source through the Qwen3-VL encoder, source latents in its slots."""

    family = "qwen_image_2_edit"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__(pipeline, cfg, device)
        self.capabilities = Capabilities(takes_source_images=True, has_cfg=cfg.guidance_scale > 1.0)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """The encoder's reading of each (prompt, source) pair and the source's latent tokens.

        Keys: ``prompt_embeds`` (B, S, D), ``prompt_mask`` (B, S) bool and ``prompt_image_mask`` (B, S) bool
        (the source's slots), padded to ``model.max_sequence_length``; the same three ``neg_*`` when g > 1,
        ``model.negative_prompt`` paired with the same source; ``source_latents`` (B, h·w, C) fp32 and
        ``source_shape`` (B, 2) int, the source's latent grid (h, w).
        """
        images = check_sources(images, len(prompts), MISSING_SOURCE)
        sources = [[image] for image in to_pil(images)]
        tensors = self._pairs(prompts, sources, "")
        if self.guidance_scale > 1.0:
            tensors |= self._pairs([self.cfg.negative_prompt] * len(prompts), sources, "neg_")
        latents, grid = self.encode_sources(images)
        tensors |= {"source_latents": latents, "source_shape": grid.expand(len(prompts), 2).clone()}
        return Cond(tensors)

    def _pairs(self, prompts: Sequence[str], sources: list[list], prefix: str) -> dict[str, Tensor]:
        rows = [self._text(prompt, images) for prompt, images in zip(prompts, sources, strict=True)]
        names = ("prompt_embeds", "prompt_mask", "prompt_image_mask")
        return {f"{prefix}{name}": torch.cat([row[i] for row in rows]) for i, name in enumerate(names)}

    @torch.no_grad()
    def encode_sources(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """Source images (B, 3, H, W) in [0, 1] → normalised VAE latent tokens (B, h·w, C) fp32 (opaque RGBA,
        posterior mode) and their (1, 2) latent grid (h, w)."""
        h = self.latent_side(images.shape[2], "height (source image)")
        w = self.latent_side(images.shape[3], "width (source image)")
        vae = self.pipeline.vae
        rgba = torch.cat([images, torch.ones_like(images[:, :1])], dim=1).to(self.device, torch.float32)
        pixels = (rgba * 2 - 1).to(vae.dtype).unsqueeze(2)  # (B, 4, 1, H, W) in [-1, 1]
        mean, std = latent_statistics(vae, self.device)
        latents = (vae.encode(pixels).latent_dist.mode().float() - mean) / std  # (B, C, 1, h, w)
        return latents[:, :, 0].flatten(2).transpose(1, 2), torch.tensor([[h, w]], device=self.device)

    def branch(self, cond: Cond, negative: bool) -> tuple[Tensor, Tensor, Tensor | None, Source | None]:
        """The prompt embeddings, masks and image slots of one branch, and the source tokens with their grid
        (one size per batch)."""
        prefix = "neg_" if negative else ""
        tensors = cond.tensors
        grids = tensors["source_shape"]
        if not bool((grids == grids[0]).all()):
            raise UserError("a batch mixes source images of different sizes; resize them to one size")
        h, w = (int(v) for v in grids[0])
        source = (tensors["source_latents"], (h, w))
        names = ("prompt_embeds", "prompt_mask", "prompt_image_mask")
        embeds, mask, slots = (tensors[f"{prefix}{name}"] for name in names)
        return embeds, mask, slots, source


def build(cfg: ModelConfig, device: torch.device) -> QwenImage2EditPolicy:
    """The registry's entry point: tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_qwen_image_2_edit_pipeline, load_qwen_image_2_pipeline)
    return with_prompt_cache(QwenImage2EditPolicy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
