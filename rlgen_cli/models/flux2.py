"""FLUX.2-dev behind the flow-policy protocol (text-to-image, guidance-distilled, not step-distilled).

Model: Black Forest Labs, FLUX.2-dev (2025), a 32 B rectified-flow transformer with a Mistral-Small-3.x
text encoder. Like FLUX.1-dev its guidance scale is an input embedding (distilled CFG): ``velocity``
makes ONE transformer call with ``guidance`` = ``model.guidance_scale`` (4 upstream) and never an
unconditional branch. It still samples a full flow (≈ 50 steps), so it is an RL base model; a
step-distilled derivative (a "Turbo" checkpoint) is refused or warned about
(:func:`~rlgen_cli.models._flux2_common.refuse_step_distilled`). Real weights load through
``Flux2Pipeline.from_pretrained``; ``models/tiny/flux2.py`` builds the same classes with random weights.
Latent layout, RoPE ids, schedule and precision: see ``models/_flux2_common.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.models._component_policy import ComponentPolicy
from rlgen_cli.models._flux2_common import FLUX2_LORA_TARGETS, Flux2Model, refuse_step_distilled
from rlgen_cli.models.base import Cond
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import load_pipeline
from rlgen_cli.models.tiny import tiny_flux2_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = ["FLUX2_LORA_TARGETS", "Flux2Policy", "build", "load_flux2_pipeline"]


def load_flux2_pipeline(cfg: ModelConfig) -> Any:
    """Load a real FLUX.2-dev pipeline from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import Flux2Pipeline

    refuse_step_distilled(False, cfg.path, "black-forest-labs/FLUX.2-dev")
    return load_pipeline(Flux2Pipeline, cfg, "FLUX.2")


class Flux2Policy(ComponentPolicy):
    """FLUX.2-dev (see the module docstring): text conditioning, guidance embedded, no negative branch."""

    family = "flux2"
    component = Flux2Model
    pipeline_class = "Flux2Pipeline"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        if not pipeline.transformer.config.guidance_embeds:
            raise UserError(
                f"model.path={cfg.path!r} has no guidance embedding, so it is not FLUX.2-dev: for FLUX.2-klein "
                "checkpoints use model=flux2_klein"
            )
        super().__init__(pipeline, cfg, device)

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning only (no negative branch: guidance is embedded)."""
        return Cond({"prompt_embeds": self.model.encode_text(prompts)})

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        return self.model.forward(x, sigma, cond.tensors["prompt_embeds"], guidance=self.guidance_scale)


def build(cfg: ModelConfig, device: torch.device) -> Flux2Policy:
    """The registry's entry point: tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_flux2_pipeline, load_flux2_pipeline)
    return with_prompt_cache(Flux2Policy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
