"""Qwen-Image (text-to-image) behind the flow-policy protocol.

Real weights load through ``QwenImagePipeline.from_pretrained`` (hub id ``Qwen/Qwen-Image`` or a local
directory, ``local_files_only`` honoured); ``models/tiny.py`` builds the same classes from
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

from rlgen_cli.models._qwen_common import LORA_WEIGHTS_NAME, QWEN_LORA_TARGETS, TRANSFORMER_DIR, QwenPolicy
from rlgen_cli.models.base import Cond
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import load_pipeline
from rlgen_cli.models.tiny import tiny_qwen_image_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = [
    "LORA_WEIGHTS_NAME",
    "QWEN_LORA_TARGETS",
    "TRANSFORMER_DIR",
    "QwenImagePolicy",
    "build",
    "load_qwen_image_pipeline",
]


def load_qwen_image_pipeline(cfg: ModelConfig) -> Any:
    """Load a real ``QwenImagePipeline`` from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import QwenImagePipeline

    return load_pipeline(QwenImagePipeline, cfg, "Qwen-Image")


class QwenImagePolicy(QwenPolicy):
    """Qwen-Image: text conditioning through the Qwen2.5-VL encoder, true CFG inside ``velocity``."""

    family = "qwen_image"
    pipeline_class = "QwenImagePipeline"

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Prompt embeddings + masks, padded to ``model.max_sequence_length`` (negative branch when g > 1).

        Keys: ``prompt_embeds`` (B, S, D) in ``model.dtype``, ``prompt_mask`` (B, S) bool and, with CFG,
        ``neg_prompt_embeds`` / ``neg_prompt_mask`` of ``model.negative_prompt``.
        """
        return Cond(self.model.text_branches(self._encode_prompts, prompts, self.guidance_scale > 1.0))

    def _encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor | None]:
        return self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.cfg.max_sequence_length
        )


def build(cfg: ModelConfig, device: torch.device) -> QwenImagePolicy:
    """The registry's entry point: random-init, tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_qwen_image_pipeline, load_qwen_image_pipeline)
    return with_prompt_cache(QwenImagePolicy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
