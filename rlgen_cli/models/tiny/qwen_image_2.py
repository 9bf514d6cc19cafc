"""Tiny Qwen-Image 2.x: the real diffusers / transformers classes (``QwenImage21Pipeline``, its single-stream
block-causal transformer, the 16× RGBA VAE, a Qwen3-VL text encoder and processor), scaled-down configs,
random weights deterministic in ``seed``, the offline byte-level tokenizer of the tiny Qwen3-VL.

The VAE keeps the real spatial compression (16×: five levels, four of them downsampling) and the RGBA
input/output, with 8 latent channels instead of 64, so a 64 px image is a 4×4 latent: 16 tokens, 4 of the
encoder's 2×2 image slots. The scheduler config is Qwen-Image's (exponential dynamic shift, terminal σ
0.02); the adapter reads whatever scheduler a checkpoint ships, so the tiny one only has to exercise a
non-trivial shift.
"""

from __future__ import annotations

from typing import Any

import torch

from rlgen_cli.models.tiny.image import QWEN_SCHEDULER
from rlgen_cli.models.tiny.qwen3_vl import tiny_qwen3_vl, tiny_qwen3_vl_processor

LATENT_CHANNELS = 8  # Qwen-Image 2.1: 64


def tiny_qwen_image_2_edit_pipeline(seed: int = 0) -> Any:
    """:func:`tiny_qwen_image_2_pipeline` whose encoder reads condition images as the real one does: 16-px
    patches merged 2×2, so each merged token covers 32×32 px — one image slot of the transformer, which the
    source's 2×2 latent tokens fill (the 4-px default would give 16 encoder tokens per slot). Images from 32²
    to 128² px keep their size in the processor."""
    return tiny_qwen_image_2_pipeline(
        seed, tiny_qwen3_vl_processor(min_pixels=32 * 32, max_pixels=128 * 128, patch=16)
    )


def tiny_qwen_image_2_pipeline(seed: int = 0, processor: Any = None) -> Any:
    """A tiny ``QwenImage21Pipeline`` (64 px images, 4×4×8 latents), deterministic in ``seed``; the global
    torch RNG is left as it was. ``processor``: the Qwen3-VL processor (None = the tiny default)."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )

    processor = processor if processor is not None else tiny_qwen3_vl_processor()
    with torch.random.fork_rng(devices=[]):
        text_encoder = tiny_qwen3_vl(processor, hidden_size=32, seed=seed)
        torch.manual_seed(seed + 1)
        transformer = QwenImage21Transformer2DModel(
            patch_size=1,
            in_channels=LATENT_CHANNELS,
            out_channels=LATENT_CHANNELS,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            context_in_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
        vae = AutoencoderKLQwenImage21(
            base_dim=4,
            decoder_base_dim=4,
            z_dim=LATENT_CHANNELS,
            dim_mult=[1, 1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0, 0.5, -0.4, 0.2, -0.1],
            latents_std=[1.5, 0.8, 1.2, 1.0, 0.9, 1.1, 1.3, 0.7],
        )
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        processor=processor,
        transformer=transformer,
    )
