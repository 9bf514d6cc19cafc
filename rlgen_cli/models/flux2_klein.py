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
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models._flux2_common import FLUX2_LORA_TARGETS, Flux2Model, refuse_step_distilled
from rlgen_cli.models.base import Capabilities, Cond, cfg_combine, uncond_takes_grad
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.models.prompt_cache import PromptCache, cache_prompt_embeddings
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


class Flux2KleinPolicy:
    """FLUX.2-klein base (see the module docstring): text conditioning, true CFG when guidance > 1."""

    family = "flux2_klein"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        refuse_step_distilled(bool(pipeline.config.get("is_distilled", False)), cfg.path, BASE_HINT)
        self.cfg = cfg
        self.device = device
        self.guidance_scale = cfg.guidance_scale
        self.capabilities = Capabilities(has_cfg=cfg.guidance_scale > 1.0)
        self._negatives = PromptCache(int(cfg.prompt_cache_mb * 2**20)) if cfg.prompt_cache_mb > 0 else None
        self.flux2 = Flux2Model(pipeline, cfg, device, pipeline_class="Flux2KleinPipeline")
        self.pipeline = pipeline
        self.trainable = self.flux2.trainable

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Prompt embeddings, and the negative prompt's when guidance > 1."""
        tensors = {"prompt_embeds": self.flux2.encode_text(prompts)}
        if self.guidance_scale > 1.0:
            tensors["neg_prompt_embeds"] = self._negative(len(prompts))
        return Cond(tensors)

    def _negative(self, n: int) -> Tensor:
        """The negative prompt as a batch of ``n``, encoded once per batch size (the encoder is frozen)."""
        encode = functools.partial(self.flux2.encode_text, [self.cfg.negative_prompt] * n)
        if self._negatives is None:
            return encode()
        key = (n, self.cfg.negative_prompt, self.cfg.max_sequence_length)
        return self._negatives.get(key, lambda: Cond({"neg_prompt_embeds": encode()})).tensors[
            "neg_prompt_embeds"
        ]

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        return self.flux2.noise(n, generator)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        return self.flux2.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) with true CFG folded in (two passes, as the pipeline: prompt, then negative prompt)."""
        embeds = cond.tensors["prompt_embeds"]
        if self.guidance_scale <= 1.0:
            return self.flux2.forward(x, sigma, embeds, guidance=None)
        negative = cond.tensors["neg_prompt_embeds"]
        conditional = self.flux2.forward(x, sigma, embeds, guidance=None)
        if uncond_takes_grad():
            uncond = self.flux2.forward(x, sigma, negative, guidance=None)
        else:  # the unconditional branch without autograd (models/base.py: cfg_gradient)
            with torch.no_grad():
                uncond = self.flux2.forward(x, sigma, negative, guidance=None)
        return cfg_combine(uncond, conditional, self.guidance_scale)

    def decode(self, x0: Tensor) -> Tensor:
        return self.flux2.decode(x0)


def build(cfg: ModelConfig, device: torch.device) -> Flux2KleinPolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, else the loaded one."""
    if cfg.tiny:
        pipeline = in_model_dtype(tiny_flux2_klein_pipeline(cfg.tiny_seed), cfg)
    else:
        pipeline = load_flux2_klein_pipeline(cfg)
    policy = Flux2KleinPolicy(pipeline, cfg, device)
    cache_prompt_embeddings(
        policy, cfg.prompt_cache_mb, (pipeline.text_encoder,)
    )  # a batch seen before is reused
    return policy
