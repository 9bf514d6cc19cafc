"""FLUX.1-dev behind the flow-policy protocol (text-to-image, guidance-distilled).

Model: Black Forest Labs, FLUX.1-dev (2024), a 12 B rectified-flow transformer whose guidance scale is
an input embedding (distilled CFG): ``velocity`` makes ONE transformer call with ``guidance`` =
``model.guidance_scale`` (3.5 upstream) and never an unconditional branch. Real weights load through
diffusers' ``FluxPipeline.from_pretrained`` (hub id ``black-forest-labs/FLUX.1-dev`` or a local
directory, ``local_files_only`` honoured); ``tiny_flux_pipeline`` builds the same classes from tiny
configs with random weights and offline tokenizers.

Flow-GRPO settings (Liu et al. 2025): 6 / 28 steps, 512 px, LoRA r 64 / α 128 on attention
and feed-forwards (:data:`FLUX_LORA_TARGETS`), gaussian init, noise level 0.9, bf16. The LoRA is saved
in the format ``FluxPipeline.load_lora_weights`` reads. Packing, schedule, timestep and precision
conventions: see ``models/_flux_common.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from rlgen_cli.models._flux_common import (
    FLUX_LORA_TARGETS,
    LORA_WEIGHTS_NAME,
    FluxFamilyPolicy,
    tiny_flux_components,
)
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.schema.flow import ModelConfig

__all__ = [
    "FLUX_LORA_TARGETS",
    "LORA_WEIGHTS_NAME",
    "FluxPolicy",
    "build",
    "load_flux_pipeline",
    "tiny_flux_pipeline",
]


def tiny_flux_pipeline(seed: int = 0) -> Any:
    """A tiny ``FluxPipeline`` (≈ 0.1 M-parameter transformer, 32 px images), deterministic in ``seed``."""
    from diffusers import FluxPipeline

    return FluxPipeline(**tiny_flux_components(seed))


def load_flux_pipeline(cfg: ModelConfig) -> Any:
    """Load a real FLUX.1 pipeline from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import FluxPipeline

    return load_pipeline(FluxPipeline, cfg, "FLUX")


class FluxPolicy(FluxFamilyPolicy):
    """FLUX.1-dev (see the module docstring); the protocol lives in ``FluxFamilyPolicy``."""

    family = "flux"
    takes_source_images = False
    pipeline_class = "FluxPipeline"


def build(cfg: ModelConfig, device: torch.device) -> FluxPolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, else the loaded one."""
    pipeline = in_model_dtype(tiny_flux_pipeline(cfg.tiny_seed), cfg) if cfg.tiny else load_flux_pipeline(cfg)
    return FluxPolicy(pipeline, cfg, device)
