"""Qwen-Image (text-to-image) behind the flow-policy protocol.

Real weights load through ``QwenImagePipeline.from_pretrained`` (hub id ``Qwen/Qwen-Image`` or a local
directory, ``local_files_only`` honoured); :func:`tiny_qwen_image_pipeline` builds the same classes from
tiny configs with random weights and an offline byte-level tokenizer. Upstream Flow-GRPO settings
(pickscore_qwenimage): 10 / 50 steps, true CFG 4 with the per-token norm rescale, negative prompt " ", 512 px,
LoRA r 64 / α 128 on attention and MLPs (gaussian init), SDE noise level 1.2, bf16. Packing, schedule,
CFG and precision are shared with Qwen-Image-Edit: see ``models/_qwen_common.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.models._qwen_common import (
    LORA_WEIGHTS_NAME,
    QWEN_LORA_TARGETS,
    TRANSFORMER_DIR,
    QwenFamilyPolicy,
    tiny_qwen_pipeline,
)
from rlgen_cli.models.base import Cond
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import ModelConfig

__all__ = [
    "LORA_WEIGHTS_NAME",
    "QWEN_LORA_TARGETS",
    "TRANSFORMER_DIR",
    "QwenImagePolicy",
    "build",
    "load_qwen_image_pipeline",
    "tiny_qwen_image_pipeline",
]


def tiny_qwen_image_pipeline(seed: int = 0) -> Any:
    """A tiny ``QwenImagePipeline`` (32 px images, 8×8×4 latents), deterministic in ``seed``."""
    from diffusers import QwenImagePipeline

    return tiny_qwen_pipeline(QwenImagePipeline, seed)


def load_qwen_image_pipeline(cfg: ModelConfig) -> Any:
    """Load a real ``QwenImagePipeline`` from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import QwenImagePipeline

    return load_pipeline(QwenImagePipeline, cfg, "Qwen-Image")


class QwenImagePolicy(QwenFamilyPolicy):
    """Qwen-Image: text conditioning through the Qwen2.5-VL encoder, true CFG inside ``velocity``."""

    family = "qwen_image"
    takes_source_images = False
    pipeline_class = "QwenImagePipeline"

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Prompt embeddings + masks, padded to ``model.max_sequence_length`` (negative branch when g > 1).

        Keys: ``prompt_embeds`` (B, S, D) in ``model.dtype``, ``prompt_mask`` (B, S) bool and, with CFG,
        ``neg_prompt_embeds`` / ``neg_prompt_mask`` of ``model.negative_prompt``.
        """
        if images is not None:
            raise UserError(
                "Qwen-Image is a text-to-image model: it takes no source images (use qwen_image_edit)"
            )
        return Cond(self.text_branches(self._encode_prompts, prompts))

    def _encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor | None]:
        return self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.cfg.max_sequence_length
        )


def build(cfg: ModelConfig, device: torch.device) -> QwenImagePolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, else the loaded one."""
    pipeline = (
        in_model_dtype(tiny_qwen_image_pipeline(cfg.tiny_seed), cfg)
        if cfg.tiny
        else load_qwen_image_pipeline(cfg)
    )
    return QwenImagePolicy(pipeline, cfg, device)
