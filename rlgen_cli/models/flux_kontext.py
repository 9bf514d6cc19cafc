"""FLUX.1-Kontext-dev behind the flow-policy protocol (instruction-based image editing).

Model: Labs et al. 2025, "FLUX.1 Kontext: Flow Matching for In-Context Image Generation and Editing in
Latent Space". The source image is VAE-encoded (distribution mode, then shift and scale as diffusers'
``FluxKontextPipeline._encode_vae_image``), packed into tokens and appended after the noisy target
tokens; its RoPE ids are (1, row, col) where the target's are (0, row, col). The transformer sees the
whole sequence, ``velocity`` returns the target tokens' prediction only, and the dynamic shift μ counts
target tokens only — as the pipeline does. Guidance is embedded (2.5 upstream), with no CFG branch.

The source is encoded at the size it is given (the recipe resizes it to the model's resolution);
diffusers' optional auto-resize to Kontext's preferred ≈ 1 MP resolutions is not applied, so the
sequence is twice the target's length.

Flow-GRPO settings (``counting_flux_kontext``): 6 / 28 steps, 512 px, LoRA r 64 / α 128
on FLUX's attention and feed-forward targets plus the single blocks' ``proj_mlp``
(:data:`KONTEXT_LORA_TARGETS`), noise level 0.9, bf16 (precision notes: ``models/_flux_common.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.models._component_policy import ComponentPolicy, check_sources
from rlgen_cli.models._flux_common import FLUX_LORA_TARGETS, LORA_WEIGHTS_NAME, FluxModel
from rlgen_cli.models.base import Cond
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import load_pipeline
from rlgen_cli.models.tiny import tiny_flux_kontext_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = [
    "KONTEXT_LORA_TARGETS",
    "LORA_WEIGHTS_NAME",
    "FluxKontextPolicy",
    "build",
    "load_flux_kontext_pipeline",
]

KONTEXT_LORA_TARGETS = [*FLUX_LORA_TARGETS, "proj_mlp"]
"""Flow-GRPO's FLUX.1-Kontext LoRA targets: FLUX's plus the single-stream blocks' ``proj_mlp``."""

SOURCE_INDEX = 1
"""First RoPE id axis of source-image tokens (target tokens use 0)."""


def load_flux_kontext_pipeline(cfg: ModelConfig) -> Any:
    """Load a real FLUX.1-Kontext pipeline from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import FluxKontextPipeline

    return load_pipeline(FluxKontextPipeline, cfg, "FLUX.1-Kontext")


class FluxKontextPolicy(ComponentPolicy):
    """FLUX.1-Kontext (see the module docstring); ``encode`` needs the source images."""

    family = "flux_kontext"
    component = FluxModel
    pipeline_class = "FluxKontextPipeline"
    edits = True

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning plus the packed source latents (B, L', D) and their ids (B, L', 3).

        Args:
            prompts: The edit instructions, one per sample.
            images: Source images (B, 3, H, W) in [0, 1], H and W multiples of 2·vae_scale_factor.

        Raises:
            UserError: If the images are missing or do not match the prompts.
        """
        images = check_sources(
            images,
            len(prompts),
            "FLUX.1-Kontext is an editing model: encode needs source images (B, 3, H, W) in [0, 1]; give "
            'every dataset line an "image" path (jsonl lines like {"prompt": ..., "image": "src/0.png"})',
        )
        tensors = self.model.encode_text(prompts)
        tokens, ids = self.model.encode_image(images, index=SOURCE_INDEX)
        tensors["source_latents"] = tokens
        tensors["source_ids"] = ids.expand(len(prompts), -1, -1)
        return Cond(tensors)

    def context(self, cond: Cond) -> tuple[Tensor, Tensor]:
        """The source tokens and their ids, appended after the target tokens."""
        return cond.tensors["source_latents"], cond.tensors["source_ids"][0]


def build(cfg: ModelConfig, device: torch.device) -> FluxKontextPolicy:
    """The registry's entry point: random-init, tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_flux_kontext_pipeline, load_flux_kontext_pipeline)
    encoders = (pipeline.text_encoder, pipeline.text_encoder_2)
    return with_prompt_cache(FluxKontextPolicy(pipeline, cfg, device), cfg, encoders)
