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
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models._qwen_common import QWEN_LORA_TARGETS, QwenModel, pad_text
from rlgen_cli.models.base import Capabilities, Cond
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.models.prompt_cache import cache_prompt_embeddings
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


class QwenImageEditPlusPolicy:
    """Qwen-Image-Edit-Plus: prompt + N sources through the VL encoder, source latents as extra tokens."""

    family = "qwen_image_edit_plus"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.guidance_scale = cfg.guidance_scale
        self.qwen = QwenModel(pipeline, cfg, device, pipeline_class="QwenImageEditPlusPipeline")
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

        tensors = self.qwen.text_branches(encode_each, prompts, self.guidance_scale > 1.0)
        latents, shapes = zip(
            *(
                self.qwen.encode_image(sources[:, i], f"source image {i + 1}")
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

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        return self.qwen.noise(n, generator)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        return self.qwen.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The target tokens' velocity, with every source's latent tokens appended to the sequence."""
        shapes = cond.tensors["source_shape"]
        if not bool((shapes == shapes[0]).all()):
            raise UserError("a batch mixes source images of different sizes or counts; give them one of each")
        frames, h, w = (int(v) for v in shapes[0])
        context = (cond.tensors["source_latents"], (frames, h, w))
        return self.qwen.velocity(x, sigma, cond, self.guidance_scale, context=context)

    def decode(self, x0: Tensor) -> Tensor:
        return self.qwen.decode(x0)


def build(cfg: ModelConfig, device: torch.device) -> QwenImageEditPlusPolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, else the loaded one."""
    pipeline = (
        in_model_dtype(tiny_qwen_image_edit_plus_pipeline(cfg.tiny_seed), cfg)
        if cfg.tiny
        else load_qwen_image_edit_plus_pipeline(cfg)
    )
    policy = QwenImageEditPlusPolicy(pipeline, cfg, device)
    cache_prompt_embeddings(
        policy, cfg.prompt_cache_mb, (pipeline.text_encoder,)
    )  # a batch seen before is reused
    return policy
