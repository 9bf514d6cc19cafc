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
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models._qwen_common import LORA_WEIGHTS_NAME, QWEN_LORA_TARGETS, TRANSFORMER_DIR, QwenModel
from rlgen_cli.models.base import Capabilities, Cond
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.models.prompt_cache import cache_prompt_embeddings
from rlgen_cli.models.real_size import flow_pipeline
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


class QwenImageEditPolicy:
    """Qwen-Image-Edit: prompt + source image through the VL encoder, source latents as extra tokens."""

    family = "qwen_image_edit"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.guidance_scale = cfg.guidance_scale
        self.qwen = QwenModel(pipeline, cfg, device, pipeline_class="QwenImageEditPipeline")
        self.pipeline = pipeline
        self.trainable = self.qwen.trainable
        self.capabilities = Capabilities(takes_source_images=True, has_cfg=cfg.guidance_scale > 1.0)

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.qwen.latent_hw

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """VL embeddings of (prompt, source) pairs and the packed source latents.

        Keys: ``prompt_embeds`` (B, S, D), ``prompt_mask`` (B, S) bool (padded to
        ``model.max_sequence_length``; the negative branch ``neg_*`` when g > 1 pairs
        ``model.negative_prompt`` with the same image), ``source_latents`` (B, L', 4C) fp32 and
        ``source_shape`` (B, 3) int: the (frame, h/2, w/2) RoPE shape of the source tokens.
        """
        if images is None:
            raise UserError(
                'Qwen-Image-Edit needs a source image per prompt: give the dataset an "image" field per line '
                '(jsonl lines like {"prompt": ..., "image": "src/0001.png"})'
            )
        if images.ndim != 4 or images.shape[0] != len(prompts) or images.shape[1] != 3:
            raise UserError(
                f"source images must be (B, 3, H, W) with B = {len(prompts)} prompts, got {tuple(images.shape)}"
            )
        pil = to_pil(images)
        encode_one = functools.partial(self._encode_prompts, images=pil)
        tensors = self.qwen.text_branches(encode_one, prompts, self.guidance_scale > 1.0)
        latents, shape = self.qwen.encode_image(images, "source image")
        tensors |= {"source_latents": latents, "source_shape": shape.expand(len(prompts), 3).clone()}
        return Cond(tensors)

    def _encode_prompts(self, prompts: list[str], images: list[Image.Image]) -> tuple[Tensor, Tensor | None]:
        return self.pipeline.encode_prompt(prompt=prompts, image=images, device=self.device)

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        return self.qwen.noise(n, generator)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        return self.qwen.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The target tokens' velocity, with the source latent tokens appended to the sequence."""
        return self.qwen.velocity(x, sigma, cond, self.guidance_scale, context=self._source(cond))

    def _source(self, cond: Cond) -> tuple[Tensor, tuple[int, int, int]]:
        """The source latent tokens and their (frame, h/2, w/2) shape (one size per batch)."""
        shapes = cond.tensors["source_shape"]
        if not bool((shapes == shapes[0]).all()):
            raise UserError("a batch mixes source images of different sizes; resize them to one size")
        frame, h, w = (int(v) for v in shapes[0])
        return cond.tensors["source_latents"], (frame, h, w)

    def decode(self, x0: Tensor) -> Tensor:
        return self.qwen.decode(x0)


def build(cfg: ModelConfig, device: torch.device) -> QwenImageEditPolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, the published architecture at random
    init when ``cfg.weights`` is ``random_init`` (``models/real_size.py``), else the loaded one."""
    if cfg.weights == "random_init":
        pipeline = in_model_dtype(flow_pipeline(cfg, device), cfg)
    elif cfg.tiny:
        pipeline = in_model_dtype(tiny_qwen_image_edit_pipeline(cfg.tiny_seed), cfg)
    else:
        pipeline = load_qwen_image_edit_pipeline(cfg)
    policy = QwenImageEditPolicy(pipeline, cfg, device)
    cache_prompt_embeddings(
        policy, cfg.prompt_cache_mb, (pipeline.text_encoder,)
    )  # a batch seen before is reused
    return policy
