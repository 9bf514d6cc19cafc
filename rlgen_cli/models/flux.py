"""FLUX.1-dev behind the flow-policy protocol (text-to-image, guidance-distilled).

Model: Black Forest Labs, FLUX.1-dev (2024), a 12 B rectified-flow transformer whose guidance scale is
an input embedding (distilled CFG): ``velocity`` makes ONE transformer call with ``guidance`` =
``model.guidance_scale`` (3.5 upstream) and never an unconditional branch. Real weights load through
diffusers' ``FluxPipeline.from_pretrained`` (hub id ``black-forest-labs/FLUX.1-dev`` or a local
directory, ``local_files_only`` honoured); ``models/tiny.py`` builds the same classes from tiny
configs with random weights and offline tokenizers.

Flow-GRPO settings (Liu et al. 2025): 6 / 28 steps, 512 px, LoRA r 64 / α 128 on attention
and feed-forwards (:data:`FLUX_LORA_TARGETS`), gaussian init, noise level 0.9, bf16. The LoRA is saved
in the format ``FluxPipeline.load_lora_weights`` reads. Packing, schedule, timestep and precision
conventions: see ``models/_flux_common.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.models._component_policy import ComponentPolicy
from rlgen_cli.models._flux_common import FLUX_LORA_TARGETS, LORA_WEIGHTS_NAME, FluxModel
from rlgen_cli.models.base import Cond
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import load_pipeline
from rlgen_cli.models.tiny import tiny_flux_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = ["FLUX_LORA_TARGETS", "LORA_WEIGHTS_NAME", "FluxPolicy", "build", "load_flux_pipeline"]


def load_flux_pipeline(cfg: ModelConfig) -> Any:
    """Load a real FLUX.1 pipeline from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import FluxPipeline

    return load_pipeline(FluxPipeline, cfg, "FLUX")


class FluxPolicy(ComponentPolicy):
    """FLUX.1-dev (see the module docstring): text conditioning, guidance embedded, no negative branch."""

    family = "flux"
    component = FluxModel
    pipeline_class = "FluxPipeline"

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning only (no negative branch: guidance is embedded)."""
        return Cond(self.model.encode_text(prompts))


def build(cfg: ModelConfig, device: torch.device) -> FluxPolicy:
    """The registry's entry point: random-init, tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_flux_pipeline, load_flux_pipeline)
    encoders = (pipeline.text_encoder, pipeline.text_encoder_2)
    return with_prompt_cache(FluxPolicy(pipeline, cfg, device), cfg, encoders)
