"""FLUX.2-klein base behind the flow-policy protocol (text-to-image, true classifier-free guidance).

Model: Black Forest Labs, FLUX.2-klein (2026), 4 B / 9 B rectified-flow transformers with a Qwen3 text
encoder, released as *base* checkpoints (``FLUX.2-klein-base-4B`` / ``-9B``: full flow, ≈ 50 steps, true
CFG with an empty negative prompt) and as step- and guidance-distilled ones (``FLUX.2-klein-4B`` /
``-9B``: 4 steps, no CFG). RL trains the base: a distilled checkpoint (``is_distilled`` in its
``model_index.json``) is refused before its weights load, with the base id as the fix. With
``model.guidance_scale > 1`` ``velocity`` combines the prompt and the negative-prompt predictions
(``cfg_combine``, so ``algo.cfg_grad=conditional`` applies). Latent layout, RoPE ids, schedule and
precision: see ``models/_flux2_common.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.models._component_policy import ComponentPolicy
from rlgen_cli.models._flux2_common import FLUX2_LORA_TARGETS, Flux2Model, refuse_step_distilled
from rlgen_cli.models.base import Cond, cfg_two_passes
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import load_pipeline
from rlgen_cli.models.prompt_cache import PromptCache
from rlgen_cli.models.tiny import tiny_flux2_klein_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = ["FLUX2_LORA_TARGETS", "Flux2KleinPolicy", "build", "load_flux2_klein_pipeline"]

BASE_HINT = "black-forest-labs/FLUX.2-klein-base-4B (or -base-9B)"


def is_distilled_checkpoint(cfg: ModelConfig) -> bool:
    """``is_distilled`` from the checkpoint's ``model_index.json``, read before any weight loads."""
    from diffusers import Flux2KleinPipeline

    try:
        config = Flux2KleinPipeline.load_config(
            cfg.path, local_files_only=cfg.local_files_only, revision=cfg.revision
        )
    except (OSError, ValueError) as err:
        raise UserError(
            f"could not read model_index.json of model.path={cfg.path!r}: {err}. Pass a local directory saved "
            "with save_pretrained, or a hub id with network access (model.local_files_only=false)"
        ) from err
    return bool(config.get("is_distilled", False))


def load_flux2_klein_pipeline(cfg: ModelConfig) -> Any:
    """Load a FLUX.2-klein base pipeline from ``cfg.path``; a step-distilled one is a :class:`UserError`."""
    from diffusers import Flux2KleinPipeline

    refuse_step_distilled(is_distilled_checkpoint(cfg), cfg.path, BASE_HINT)
    return load_pipeline(Flux2KleinPipeline, cfg, "FLUX.2-klein")


class Flux2KleinPolicy(ComponentPolicy):
    """FLUX.2-klein base (see the module docstring): text conditioning, true CFG when guidance > 1."""

    family = "flux2_klein"
    component = Flux2Model
    pipeline_class = "Flux2KleinPipeline"
    true_cfg = True

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        refuse_step_distilled(bool(pipeline.config.get("is_distilled", False)), cfg.path, BASE_HINT)
        self._negatives = PromptCache(int(cfg.prompt_cache_mb * 2**20)) if cfg.prompt_cache_mb > 0 else None
        super().__init__(pipeline, cfg, device)

    @property
    def flux2(self) -> Flux2Model:
        """The FLUX.2 component (its ``forward`` is one transformer pass without CFG)."""
        return self.model

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Prompt embeddings, and the negative prompt's when guidance > 1."""
        tensors = {"prompt_embeds": self.model.encode_text(prompts)}
        if self.guidance_scale > 1.0:
            tensors["neg_prompt_embeds"] = self._negative(len(prompts))
        return Cond(tensors)

    def _negative(self, n: int) -> Tensor:
        """The negative prompt as a batch of ``n``, encoded once per batch size (the encoder is frozen)."""
        encode = functools.partial(self.model.encode_text, [self.cfg.negative_prompt] * n)
        if self._negatives is None:
            return encode()
        key = (n, self.cfg.negative_prompt, self.cfg.max_sequence_length)
        return self._negatives.get(key, lambda: Cond({"neg_prompt_embeds": encode()})).tensors[
            "neg_prompt_embeds"
        ]

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) with true CFG folded in (two passes, as the pipeline: prompt, then negative prompt)."""
        conditional = self.model.forward(x, sigma, cond.tensors["prompt_embeds"], guidance=None)
        if self.guidance_scale <= 1.0:
            return conditional
        negative = cond.tensors["neg_prompt_embeds"]
        unconditional = functools.partial(self.model.forward, x, sigma, negative, guidance=None)
        return cfg_two_passes(conditional, unconditional, self.guidance_scale)


def build(cfg: ModelConfig, device: torch.device) -> Flux2KleinPolicy:
    """The registry's entry point: tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_flux2_klein_pipeline, load_flux2_klein_pipeline)
    return with_prompt_cache(Flux2KleinPolicy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
