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
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models._flux2_common import FLUX2_LORA_TARGETS, Flux2Model, refuse_step_distilled
from rlgen_cli.models.base import Capabilities, Cond
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.models.prompt_cache import cache_prompt_embeddings
from rlgen_cli.models.tiny import tiny_flux2_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = ["FLUX2_LORA_TARGETS", "Flux2Policy", "build", "load_flux2_pipeline"]


def load_flux2_pipeline(cfg: ModelConfig) -> Any:
    """Load a real FLUX.2-dev pipeline from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import Flux2Pipeline

    refuse_step_distilled(False, cfg.path, "black-forest-labs/FLUX.2-dev")
    return load_pipeline(Flux2Pipeline, cfg, "FLUX.2")


class Flux2Policy:
    """FLUX.2-dev (see the module docstring): text conditioning, guidance embedded, no negative branch."""

    family = "flux2"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        if not pipeline.transformer.config.guidance_embeds:
            raise UserError(
                f"model.path={cfg.path!r} has no guidance embedding, so it is not FLUX.2-dev: for FLUX.2-klein "
                "checkpoints use model=flux2_klein"
            )
        self.cfg = cfg
        self.device = device
        self.guidance_scale = cfg.guidance_scale
        self.flux2 = Flux2Model(pipeline, cfg, device, pipeline_class="Flux2Pipeline")
        self.pipeline = pipeline
        self.trainable = self.flux2.trainable
        self.capabilities = Capabilities()

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning only (no negative branch: guidance is embedded)."""
        return Cond({"prompt_embeds": self.flux2.encode_text(prompts)})

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        return self.flux2.noise(n, generator)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        return self.flux2.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        return self.flux2.forward(x, sigma, cond.tensors["prompt_embeds"], guidance=self.guidance_scale)

    def decode(self, x0: Tensor) -> Tensor:
        return self.flux2.decode(x0)


def build(cfg: ModelConfig, device: torch.device) -> Flux2Policy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, else the loaded one."""
    pipeline = (
        in_model_dtype(tiny_flux2_pipeline(cfg.tiny_seed), cfg) if cfg.tiny else load_flux2_pipeline(cfg)
    )
    policy = Flux2Policy(pipeline, cfg, device)
    cache_prompt_embeddings(
        policy, cfg.prompt_cache_mb, (pipeline.text_encoder,)
    )  # a batch seen before is reused
    return policy
