"""Stable Diffusion 3 / 3.5 behind the flow-policy protocol.

Real weights load through ``StableDiffusion3Pipeline.from_pretrained`` (hub id or local directory,
``local_files_only`` honoured); ``models/tiny.py`` builds the same classes from tiny configs with
random weights and offline tokenizers. LoRA follows Flow-GRPO (r 32, α 64, attention projections,
gaussian init) and is saved in the format ``StableDiffusion3Pipeline.load_lora_weights`` reads.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rlgen_cli.models.base import (
    TORCH_DTYPES,
    Capabilities,
    Cond,
    cfg_combine,
    uncond_takes_grad,
)
from rlgen_cli.models.loading import in_model_dtype, load_pipeline, prepare_pipeline, vae_dtype
from rlgen_cli.models.prompt_cache import PromptCache, cache_prompt_embeddings
from rlgen_cli.models.real_size import flow_pipeline
from rlgen_cli.models.tiny import tiny_sd3_pipeline
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME as LORA_WEIGHTS_NAME  # re-exported
from rlgen_cli.models.trainable import TRANSFORMER_DIR as TRANSFORMER_DIR  # re-exported
from rlgen_cli.models.trainable import DiffusersCheckpoint, TrainableTransformer, autocast
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal
from rlgen_cli.sde.schedule import sd3_sigmas

log = logging.getLogger(__name__)


def load_sd3_pipeline(cfg: ModelConfig):
    """Load a real SD3 pipeline from ``cfg.path`` (hub id or local directory)."""
    from diffusers import StableDiffusion3Pipeline

    return load_pipeline(StableDiffusion3Pipeline, cfg, "SD3")


def dead_context_queries(transformer: nn.Module) -> list[str]:
    """The last block's ``attn.add_q_proj``: with ``context_pre_only`` its text-token outputs are dropped,
    so a LoRA there never receives a gradient (upstream trains it anyway: wasted parameters)."""
    names = []
    for i, block in enumerate(transformer.transformer_blocks):
        if getattr(block, "context_pre_only", False):
            names.append(f"transformer_blocks.{i}.attn.add_q_proj")
    return names


class SD3Policy:
    """SD3 behind the flow-policy protocol (see ``models/base.py``)."""

    family = "sd3"

    def __init__(self, pipeline, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.guidance_scale = cfg.guidance_scale
        self.capabilities = Capabilities(has_cfg=cfg.guidance_scale > 1.0)
        self._negatives = PromptCache(int(cfg.prompt_cache_mb * 2**20)) if cfg.prompt_cache_mb > 0 else None
        encoders = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
        prepare_pipeline(pipeline, device, encoders, vae_dtype(cfg, fp32_by_default=False))
        self.pipeline = pipeline
        self.trainable = TrainableTransformer(
            pipeline,
            cfg,
            checkpoint=DiffusersCheckpoint("StableDiffusion3Pipeline", "SD3Transformer2DModel"),
            exclude=dead_context_queries(pipeline.transformer) if cfg.lora.enabled else (),
        )

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning (+ the negative branch when guidance > 1); ``images`` are not used by SD3."""
        tensors = self._encode_text(prompts).tensors
        if self.guidance_scale > 1.0:
            negative = self._negative(len(prompts)).tensors
            tensors |= {"neg_prompt_embeds": negative["prompt_embeds"], "neg_pooled": negative["pooled"]}
        return Cond(tensors)

    def _encode_text(self, prompts: Sequence[str]) -> Cond:
        """The pipeline's prompt embeddings (B, L, D) and pooled embeddings (B, D') of ``prompts``; the
        pipeline encodes a negative prompt with these same calls."""
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.cfg.max_sequence_length,
        )
        return Cond({"prompt_embeds": embeds, "pooled": pooled})

    def _negative(self, n: int) -> Cond:
        """The negative prompt encoded as a batch of ``n``, once per batch size (the encoders are frozen)
        unless ``model.prompt_cache_mb=0``."""
        encode = functools.partial(self._encode_text, [self.cfg.negative_prompt] * n)
        if self._negatives is None:
            return encode()
        return self._negatives.get((n, self.cfg.negative_prompt, self.cfg.max_sequence_length), encode)

    # -- sampling geometry --------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int]:
        factor = self.pipeline.vae_scale_factor
        side = self.cfg.resolution // factor
        return (self.transformer.config.in_channels, side, side)

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """Initial latents x_1 ~ N(0, I), fp32, (n, C, H, W); one generator per sample or one for all."""
        return standard_normal(n, self.latent_shape(), generator, self.device)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """SD3 shifted sigmas, (T+1,) ending at 0."""
        return sd3_sigmas(num_steps, shift=self.cfg.shift).to(self.device)

    # -- the one transformer call -------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) with CFG folded in; x (B, C, H, W) fp32, sigma scalar or (B,); returns fp32 (B, C, H, W)."""
        batch = x.shape[0]
        timestep = (sigma.float().reshape(-1).expand(batch) * 1000.0).to(self.device)
        embeds, pooled = cond.tensors["prompt_embeds"], cond.tensors["pooled"]
        if self.guidance_scale <= 1.0:
            return self._forward(x, timestep, embeds, pooled)
        neg_embeds, neg_pooled = cond.tensors["neg_prompt_embeds"], cond.tensors["neg_pooled"]
        if not uncond_takes_grad():
            # the unconditional branch as a pass of its own without autograd: no activations kept, no
            # backward through it; sampling under the same cfg_gradient mode takes the same two passes,
            # so the rollout's and the training forward's values stay identical
            with torch.no_grad():
                uncond = self._forward(x, timestep, neg_embeds, neg_pooled)
            return cfg_combine(uncond, self._forward(x, timestep, embeds, pooled), self.guidance_scale)
        out = self._forward(
            torch.cat([x, x]),
            torch.cat([timestep, timestep]),
            torch.cat([neg_embeds, embeds]),
            torch.cat([neg_pooled, pooled]),
        )
        uncond, cond_v = out.chunk(2)
        return cfg_combine(uncond, cond_v, self.guidance_scale)

    def _forward(self, x: Tensor, timestep: Tensor, embeds: Tensor, pooled: Tensor) -> Tensor:
        """One transformer pass in the model dtype; latents in and velocity out stay fp32 outside."""
        with autocast(self.device, self.dtype):
            return self.trainable.forward_module()(
                hidden_states=x.to(self.dtype),
                timestep=timestep,
                encoder_hidden_states=embeds,
                pooled_projections=pooled,
                return_dict=False,
            )[0].float()

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Latents (B, C, h, w) → images (B, 3, H, W) in [0, 1], fp32."""
        vae = self.pipeline.vae
        latents = x0 / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


def build(cfg: ModelConfig, device: torch.device) -> SD3Policy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, the published architecture at random
    init when ``cfg.weights`` is ``random_init`` (``models/real_size.py``), else the loaded one."""
    if cfg.weights == "random_init":
        pipeline = in_model_dtype(flow_pipeline(cfg, device), cfg)
    else:
        pipeline = (
            in_model_dtype(tiny_sd3_pipeline(cfg.tiny_seed), cfg) if cfg.tiny else load_sd3_pipeline(cfg)
        )
    policy = SD3Policy(pipeline, cfg, device)
    encoders = (pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3)
    cache_prompt_embeddings(policy, cfg.prompt_cache_mb, encoders)  # a batch seen before is reused
    return policy
