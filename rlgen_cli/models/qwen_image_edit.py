"""Qwen-Image-Edit (instruction editing) behind the flow-policy protocol.

The source image conditions the model twice, as in diffusers' ``QwenImageEditPipeline``: through the
Qwen2.5-VL encoder (the edit chat template with an image slot, so the prompt tokens attend to the
image) and as VAE latent tokens appended after the target tokens (RoPE frame 1). ``velocity`` returns
only the target tokens' prediction. Upstream Flow-GRPO (``counting_qwenimage_edit``): 10 / 50 steps,
true CFG 4 with negative prompt " " (+ the same source image), 512 px, LoRA 64/128, noise 1.0 (Fast:
1.5), bf16.

Source images arrive as (B, 3, H, W) in [0, 1] (the recipe resizes them to the model size, as upstream
resizes to the target area). The VL encoder receives them as 8-bit RGB images, exactly what the
pipeline's processor gets from PIL inputs; the VAE encodes them deterministically (posterior mode).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rlgen_cli.models._component_policy import check_sources
from rlgen_cli.models._qwen_common import (
    LORA_WEIGHTS_NAME,
    QWEN_LORA_TARGETS,
    TRANSFORMER_DIR,
    QwenPolicy,
    source_context,
)
from rlgen_cli.models.base import Cond
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import load_pipeline
from rlgen_cli.models.tiny import tiny_qwen_image_edit_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = [
    "LORA_WEIGHTS_NAME",
    "QWEN_LORA_TARGETS",
    "TRANSFORMER_DIR",
    "QwenImageEditPolicy",
    "build",
    "load_qwen_image_edit_pipeline",
]


def load_qwen_image_edit_pipeline(cfg: ModelConfig) -> Any:
    """Load a real ``QwenImageEditPipeline`` from ``cfg.path`` (hub id or local directory)."""
    from diffusers import QwenImageEditPipeline

    return load_pipeline(QwenImageEditPipeline, cfg, "Qwen-Image-Edit")


def to_pil(images: Tensor) -> list[Image.Image]:
    """(B, 3, H, W) in [0, 1] → 8-bit RGB PIL images (lossless for images read from 8-bit files)."""
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return [Image.fromarray(np.ascontiguousarray(p)) for p in pixels.permute(0, 2, 3, 1).cpu().numpy()]


class QwenImageEditPolicy(QwenPolicy):
    """Qwen-Image-Edit: prompt + source image through the VL encoder, source latents as extra tokens."""

    family = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    edits = True

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """VL embeddings of (prompt, source) pairs and the packed source latents.

        Keys: ``prompt_embeds`` (B, S, D), ``prompt_mask`` (B, S) bool (padded to
        ``model.max_sequence_length``; the negative branch ``neg_*`` when g > 1 pairs
        ``model.negative_prompt`` with the same image), ``source_latents`` (B, L', 4C) fp32 and
        ``source_shape`` (B, 3) int: the (frame, h/2, w/2) RoPE shape of the source tokens.
        """
        images = check_sources(
            images,
            len(prompts),
            'Qwen-Image-Edit needs a source image per prompt: give the dataset an "image" field per line '
            '(jsonl lines like {"prompt": ..., "image": "src/0001.png"})',
        )
        pil = to_pil(images)
        encode_one = functools.partial(self._encode_prompts, images=pil)
        tensors = self.model.text_branches(encode_one, prompts, self.guidance_scale > 1.0)
        latents, shape = self.model.encode_image(images, "source image")
        tensors |= {"source_latents": latents, "source_shape": shape.expand(len(prompts), 3).clone()}
        return Cond(tensors)

    def _encode_prompts(self, prompts: list[str], images: list[Image.Image]) -> tuple[Tensor, Tensor | None]:
        return self.pipeline.encode_prompt(prompt=prompts, image=images, device=self.device)

    def context(self, cond: Cond) -> tuple[Tensor, tuple[int, int, int]]:
        """The source latent tokens and their (frame, h/2, w/2) shape (one size per batch)."""
        return source_context(cond, "a batch mixes source images of different sizes; resize them to one size")


def build(cfg: ModelConfig, device: torch.device) -> QwenImageEditPolicy:
    """The registry's entry point: random-init, tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_qwen_image_edit_pipeline, load_qwen_image_edit_pipeline)
    return with_prompt_cache(QwenImageEditPolicy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
