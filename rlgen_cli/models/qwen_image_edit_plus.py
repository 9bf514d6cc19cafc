"""Qwen-Image-Edit-Plus (multi-image editing, the 2509 / 2511 layout) behind the flow-policy protocol.

As diffusers' ``QwenImageEditPlusPipeline``: each example has N source images (N ≥ 1, the same N in a
batch). They condition the model twice: through the Qwen2.5-VL encoder (each source, resized to ≈ 384²
px as the pipeline does, fills a "Picture i:" vision slot before the instruction) and as VAE latent tokens
appended after the target tokens, source i at RoPE frame i. ``velocity`` returns only the target tokens'
prediction. The N sources share one size (the recipe resizes them to the model resolution, where the
pipeline resizes them to ≈ 1 MP), so their tokens are passed as one (N, h/2, w/2) RoPE block: frame i of
that block gets exactly the positions the pipeline gives source i as its own (1, h/2, w/2) shape, and the
2511 checkpoint's ``zero_cond_t`` marks the same tokens as conditioning.

Sources arrive as (B, N, 3, H, W) in [0, 1] (a (B, 3, H, W) tensor is N = 1); an editing set lists the N
paths of an example in its ``"image"`` field. The pipeline itself samples one prompt at a time; rlgen
encodes each example with its own sources and pads the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.models._qwen_common import QWEN_LORA_TARGETS, QwenPolicy, pad_text, source_context
from rlgen_cli.models.base import Cond
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import load_pipeline
from rlgen_cli.models.qwen_image_edit import to_pil
from rlgen_cli.models.tiny import tiny_qwen_image_edit_plus_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = ["QWEN_LORA_TARGETS", "QwenImageEditPlusPolicy", "build", "load_qwen_image_edit_plus_pipeline"]


def load_qwen_image_edit_plus_pipeline(cfg: ModelConfig) -> Any:
    """Load a real ``QwenImageEditPlusPipeline`` from ``cfg.path`` (hub id or local directory)."""
    from diffusers import QwenImageEditPlusPipeline

    return load_pipeline(QwenImageEditPlusPipeline, cfg, "Qwen-Image-Edit-Plus")


def as_source_stack(images: Tensor | None, batch: int) -> Tensor:
    """Sources as (B, N, 3, H, W): a (B, 3, H, W) tensor is one source per example."""
    if images is None:
        raise UserError(
            'Qwen-Image-Edit-Plus needs source images per prompt: give the dataset an "image" field per line '
            '(a path, or a list of N paths for N sources: {"prompt": ..., "image": ["a.png", "b.png"]})'
        )
    if images.ndim == 4:
        images = images.unsqueeze(1)
    if images.ndim != 5 or images.shape[0] != batch or images.shape[2] != 3:
        raise UserError(
            f"source images must be (B, N, 3, H, W) or (B, 3, H, W) with B = {batch} prompts, got "
            f"{tuple(images.shape)}"
        )
    return images


class QwenImageEditPlusPolicy(QwenPolicy):
    """Qwen-Image-Edit-Plus: prompt + N sources through the VL encoder, source latents as extra tokens."""

    family = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    edits = True

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """VL embeddings of (prompt, N sources) and the packed source latents.

        Keys: ``prompt_embeds`` (B, S, D), ``prompt_mask`` (B, S) bool (padded to
        ``model.max_sequence_length``; the negative branch ``neg_*`` when g > 1 pairs
        ``model.negative_prompt`` with the same sources), ``source_latents`` (B, N·L', 4C) fp32 and
        ``source_shape`` (B, 3) int: the (N, h/2, w/2) RoPE block of the source tokens.
        """
        sources = as_source_stack(images, len(prompts))
        conditions = [[self._condition_image(p) for p in to_pil(example)] for example in sources]

        def encode_each(texts: list[str]) -> tuple[Tensor, Tensor]:
            # one call per example: each prompt sees only its own sources (the pipeline's batch of one)
            parts = [self._encode(text, images) for text, images in zip(texts, conditions, strict=True)]
            longest = max(embeds.shape[1] for embeds, _ in parts)
            padded = [pad_text(embeds, mask, longest) for embeds, mask in parts]
            return torch.cat([e for e, _ in padded]), torch.cat([m for _, m in padded])

        tensors = self.model.text_branches(encode_each, prompts, self.guidance_scale > 1.0)
        latents, shapes = zip(
            *(
                self.model.encode_image(sources[:, i], f"source image {i + 1}")
                for i in range(sources.shape[1])
            ),
            strict=True,
        )
        block = shapes[0].clone()
        block[0, 0] = sources.shape[1]  # N frames of one size: (N, h/2, w/2)
        tensors |= {
            "source_latents": torch.cat(latents, dim=1),
            "source_shape": block.expand(len(prompts), 3).clone(),
        }
        return Cond(tensors)

    def _condition_image(self, image: Image.Image) -> Image.Image:
        """The source as the pipeline hands it to the VL encoder: resized to ≈ 384² px (sides ÷ 32)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
            CONDITION_IMAGE_SIZE,
            calculate_dimensions,
        )

        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
        return self.pipeline.image_processor.resize(image, height, width)

    def _encode(self, text: str, images: list[Image.Image]) -> tuple[Tensor, Tensor | None]:
        return self.pipeline.encode_prompt(prompt=[text], image=images, device=self.device)

    def context(self, cond: Cond) -> tuple[Tensor, tuple[int, int, int]]:
        """Every source's latent tokens and their (N, h/2, w/2) RoPE block (one per batch)."""
        mixed = "a batch mixes source images of different sizes or counts; give them one of each"
        return source_context(cond, mixed)


def build(cfg: ModelConfig, device: torch.device) -> QwenImageEditPlusPolicy:
    """The registry's entry point: tiny or loaded pipeline (``models/building.py``)."""
    load = load_qwen_image_edit_plus_pipeline
    pipeline = family_pipeline(cfg, device, tiny_qwen_image_edit_plus_pipeline, load)
    return with_prompt_cache(QwenImageEditPlusPolicy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
