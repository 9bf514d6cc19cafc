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
from torch import Tensor, nn

from rlgen_cli.models._flux_common import FLUX_LORA_TARGETS, LORA_WEIGHTS_NAME, FluxModel
from rlgen_cli.models.base import Capabilities, Cond
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.models.prompt_cache import cache_prompt_embeddings
from rlgen_cli.models.real_size import flow_pipeline
from rlgen_cli.models.tiny import tiny_flux_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = ["FLUX_LORA_TARGETS", "LORA_WEIGHTS_NAME", "FluxPolicy", "build", "load_flux_pipeline"]


def load_flux_pipeline(cfg: ModelConfig) -> Any:
    """Load a real FLUX.1 pipeline from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import FluxPipeline

    return load_pipeline(FluxPipeline, cfg, "FLUX")


class FluxPolicy:
    """FLUX.1-dev (see the module docstring): text conditioning, guidance embedded, no negative branch."""

    family = "flux"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.guidance_scale = cfg.guidance_scale
        self.flux = FluxModel(pipeline, cfg, device, pipeline_class="FluxPipeline")
        self.pipeline = pipeline
        self.trainable = self.flux.trainable
        self.capabilities = Capabilities()

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning only (no negative branch: guidance is embedded)."""
        return Cond(self.flux.encode_text(prompts))

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        return self.flux.noise(n, generator)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        return self.flux.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        return self.flux.velocity(x, sigma, cond, self.guidance_scale, context=None)

    def decode(self, x0: Tensor) -> Tensor:
        return self.flux.decode(x0)


def build(cfg: ModelConfig, device: torch.device) -> FluxPolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, the published architecture at random
    init when ``cfg.weights`` is ``random_init`` (``models/real_size.py``), else the loaded one."""
    if cfg.weights == "random_init":
        pipeline = in_model_dtype(flow_pipeline(cfg, device), cfg)
    else:
        pipeline = (
            in_model_dtype(tiny_flux_pipeline(cfg.tiny_seed), cfg) if cfg.tiny else load_flux_pipeline(cfg)
        )
    policy = FluxPolicy(pipeline, cfg, device)
    cache_prompt_embeddings(
        policy, cfg.prompt_cache_mb, (pipeline.text_encoder, pipeline.text_encoder_2)
    )  # a batch seen before is reused
    return policy
