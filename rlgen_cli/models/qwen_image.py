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
from torch import Tensor, nn

from rlgen_cli.models._qwen_common import LORA_WEIGHTS_NAME, QWEN_LORA_TARGETS, TRANSFORMER_DIR, QwenModel
from rlgen_cli.models.base import Capabilities, Cond
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.models.prompt_cache import cache_prompt_embeddings
from rlgen_cli.models.real_size import flow_pipeline
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


class QwenImagePolicy:
    """Qwen-Image: text conditioning through the Qwen2.5-VL encoder, true CFG inside ``velocity``."""

    family = "qwen_image"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.guidance_scale = cfg.guidance_scale
        self.qwen = QwenModel(pipeline, cfg, device, pipeline_class="QwenImagePipeline")
        self.pipeline = pipeline
        self.trainable = self.qwen.trainable
        self.capabilities = Capabilities(has_cfg=cfg.guidance_scale > 1.0)

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.qwen.latent_hw

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Prompt embeddings + masks, padded to ``model.max_sequence_length`` (negative branch when g > 1).

        Keys: ``prompt_embeds`` (B, S, D) in ``model.dtype``, ``prompt_mask`` (B, S) bool and, with CFG,
        ``neg_prompt_embeds`` / ``neg_prompt_mask`` of ``model.negative_prompt``.
        """
        return Cond(self.qwen.text_branches(self._encode_prompts, prompts, self.guidance_scale > 1.0))

    def _encode_prompts(self, prompts: list[str]) -> tuple[Tensor, Tensor | None]:
        return self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.cfg.max_sequence_length
        )

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        return self.qwen.noise(n, generator)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        return self.qwen.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        return self.qwen.velocity(x, sigma, cond, self.guidance_scale, context=None)

    def decode(self, x0: Tensor) -> Tensor:
        return self.qwen.decode(x0)


def build(cfg: ModelConfig, device: torch.device) -> QwenImagePolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, the published architecture at random
    init when ``cfg.weights`` is ``random_init`` (``models/real_size.py``), else the loaded one."""
    if cfg.weights == "random_init":
        pipeline = in_model_dtype(flow_pipeline(cfg, device), cfg)
    elif cfg.tiny:
        pipeline = in_model_dtype(tiny_qwen_image_pipeline(cfg.tiny_seed), cfg)
    else:
        pipeline = load_qwen_image_pipeline(cfg)
    policy = QwenImagePolicy(pipeline, cfg, device)
    cache_prompt_embeddings(
        policy, cfg.prompt_cache_mb, (pipeline.text_encoder,)
    )  # a batch seen before is reused
    return policy
