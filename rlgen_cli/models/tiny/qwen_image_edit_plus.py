"""Tiny Qwen-Image-Edit-Plus (the 2509 / 2511 multi-image layout): the tiny Qwen-Image modules behind
``QwenImageEditPlusPipeline``, deterministic in ``seed``."""

from __future__ import annotations

from typing import Any

from rlgen_cli.models.tiny.image import tiny_qwen_pipeline


def tiny_qwen_image_edit_plus_pipeline(seed: int = 0) -> Any:
    """A tiny ``QwenImageEditPlusPipeline`` (32 px images, the VL processor sees ≤ 32×32 px per source)."""
    from diffusers import QwenImageEditPlusPipeline

    return tiny_qwen_pipeline(QwenImageEditPlusPipeline, seed)
