"""What FLUX.2-dev and FLUX.2-klein share: :class:`Flux2Model`, the component both adapters hold.

FLUX.2 (Black Forest Labs, 2025) keeps FLUX.1's rectified-flow MMDiT layout (double-stream, then
single-stream blocks) and its timestep convention, and changes everything around it. Conventions
reproduced from diffusers' ``Flux2Pipeline`` / ``Flux2KleinPipeline`` (0.42):

* **Latents.** The VAE (32 latent channels for the real model) is patchified 2×2 *inside* the latent
  space and normalised by the VAE's batch-norm statistics; the initial noise is drawn directly in that
  patchified shape (4C, h/2, w/2) and flattened row-major into tokens (B, h/2·w/2, 4C). FLUX.1 instead
  draws (C, h, w) and packs it, so the same generator gives a different x₁: the layouts are not shared.
* **RoPE ids.** Four axes (t, h, w, l): image tokens (0, row, col, 0), text tokens (0, 0, 0, index);
  FLUX.1 has three axes and zero text ids.
* **Text.** One decoder-only LLM (Mistral-Small-3.x for dev, Qwen3 for klein); the embedding is three of
  its hidden layers concatenated per token. No pooled embedding.
* **Schedule.** ``linspace(1, 1/T, T)`` shifted with μ from ``compute_empirical_mu(image tokens, T)``
  (μ depends on the step count too, unlike FLUX.1's μ); the sigmas come from the pipeline's own
  scheduler config. ``model.shift > 0`` selects a static shift of ``linspace(1, 0, T+1)`` instead.
* **Timestep.** As FLUX.1: the transformer takes t = σ (and multiplies by 1000 inside); dev embeds the
  guidance scale the same way, klein has no guidance embedding and runs true CFG.

Precision as FLUX.1: bf16 weights and forward under autocast, fp32 latents and velocities.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.models._latent_grid import static_shift_sigmas
from rlgen_cli.models.base import TORCH_DTYPES
from rlgen_cli.models.loading import image_size, patch_multiple, prepare_pipeline, to_unit, vae_dtype
from rlgen_cli.models.trainable import DiffusersCheckpoint, TrainableTransformer, autocast
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal

log = logging.getLogger(__name__)

FLUX2_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
]
"""Attention and feed-forwards of the double-stream blocks, and the fused QKV + MLP input projection of
the single-stream blocks (the modules diffusers' FLUX.2 LoRA conversion names)."""

DISTILLED_NAME = re.compile(r"turbo|lightning|schnell|hyper|lcm|distill", re.IGNORECASE)
"""Names of step-distilled checkpoints and LoRAs ("FLUX.2-dev-Turbo", "…-Lightning", …)."""


def refuse_step_distilled(is_distilled: bool, path: str | None, base_hint: str) -> None:
    """A step-distilled checkpoint is a :class:`UserError`; a name that looks distilled is a warning.

    RL needs the base flow: a few-step sampler leaves no room for an SDE window and its ODE is not the
    flow whose Gaussian transitions the policy gradient scores (docs/adding_a_model.md)."""
    if is_distilled:
        raise UserError(
            f"model.path={path!r} is a step-distilled checkpoint (model_index.json: is_distilled=true): "
            f"RL trains the base flow, not a few-step sampler; set model.path to {base_hint}"
        )
    if path and DISTILLED_NAME.search(path):
        log.warning(
            "model.path=%r looks like a step-distilled model; RL assumes the base flow (%s). If it is "
            "distilled, sampling with few large steps makes the SDE exploration and KL meaningless.",
            path,
            base_hint,
        )


def compute_empirical_mu(image_tokens: int, num_steps: int) -> float:
    """FLUX.2's shift exponent μ: linear in the token count, interpolated in the step count between fits
    at 10 and 200 steps (above 4300 tokens only the 200-step fit)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu as empirical_mu

    return float(empirical_mu(image_seq_len=image_tokens, num_steps=num_steps))


def flux2_sigmas(num_steps: int, image_tokens: int, scheduler_config: Any, shift: float = 0.0) -> Tensor:
    """(T+1,) sigmas ending at 0: the pipeline's scheduler at μ(tokens, T), or a static ``shift > 0``."""
    if shift > 0:
        return static_shift_sigmas(num_steps, shift)
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)  # a copy: no shared state
    base = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).numpy()
    scheduler.set_timesteps(sigmas=base, mu=compute_empirical_mu(image_tokens, num_steps))
    return scheduler.sigmas.float()


def image_ids(h: int, w: int, device: torch.device) -> Tensor:
    """(h·w, 4) RoPE ids of an h×w token grid: (0, row, col, 0)."""
    ids = torch.zeros(h, w, 4, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(-1, 4)


def text_ids(length: int, device: torch.device) -> Tensor:
    """(L, 4) RoPE ids of L text tokens: (0, 0, 0, index)."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


class Flux2Model:
    """A FLUX.2 pipeline set up for training: frozen text encoder and VAE, the trainable transformer
    (:attr:`trainable`), the token geometry and the one transformer call. ``x`` is (B, L, 4C) in fp32.

    Args:
        pipeline: A ``Flux2Pipeline`` or ``Flux2KleinPipeline`` (moved to ``device``).
        cfg: The model config (size, dtype, LoRA, shift, sequence length).
        pipeline_class: The diffusers pipeline class whose ``load_lora_weights`` reads the checkpoints.
    """

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device, pipeline_class: str) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        prepare_pipeline(pipeline, device, ("vae", "text_encoder"), vae_dtype(cfg, fp32_by_default=False))
        self.pipeline = pipeline
        height, width = image_size(cfg)
        self.token_hw = (self.token_side(height, "height"), self.token_side(width, "width"))
        self.trainable = TrainableTransformer(
            pipeline, cfg, checkpoint=DiffusersCheckpoint(pipeline_class, "Flux2Transformer2DModel")
        )

    def token_side(self, pixels: int, name: str) -> int:
        """Tokens along an image side: the latent is patchified 2×2, so pixels must split evenly."""
        factor = self.pipeline.vae_scale_factor
        why = f"FLUX.2 patchifies 2×2 patches of the {factor}× downsampled latent"
        return pixels // patch_multiple(self.pipeline, pixels, name, why)

    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str]) -> Tensor:
        """(B, S, 3·D): three hidden layers of the text encoder, concatenated per token (the pipeline's)."""
        embeds, _ = self.pipeline.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.cfg.max_sequence_length,
        )
        return embeds

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """x_1 ~ N(0, I) drawn in the patchified latent shape (n, 4C, h/2, w/2), as tokens (n, L, 4C)."""
        shape = (self.pipeline.transformer.config.in_channels, *self.token_hw)
        return standard_normal(n, shape, generator, self.device).flatten(2).transpose(1, 2)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """(T+1,) sigmas ending at 0 for the image tokens of ``x`` (:func:`flux2_sigmas`)."""
        config = self.pipeline.scheduler.config
        return flux2_sigmas(num_steps, x.shape[1], config, self.cfg.shift).to(self.device)

    def forward(self, x: Tensor, sigma: Tensor, embeds: Tensor, guidance: float | None) -> Tensor:
        """One transformer pass: packed x (B, L, D) fp32, sigma 0-d or (B,); returns fp32 (B, L, D).
        ``guidance`` is the embedded guidance scale (dev) or None (klein)."""
        batch = x.shape[0]
        timestep = sigma.float().reshape(-1).expand(batch).to(self.device)  # t = σ = timesteps / 1000
        guidance_in = None
        if guidance is not None:
            guidance_in = torch.full((batch,), guidance, device=self.device, dtype=torch.float32)
        with autocast(self.device, self.dtype):
            return self.trainable.forward_module()(
                hidden_states=x.to(self.dtype),
                timestep=timestep,
                guidance=guidance_in,
                encoder_hidden_states=embeds,
                txt_ids=text_ids(embeds.shape[1], self.device),
                img_ids=image_ids(*self.token_hw, self.device),
                return_dict=False,
            )[0].float()

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Tokens (B, L, 4C) → images (B, 3, H, W) in [0, 1], fp32: batch-norm denormalised, unpatchified."""
        vae = self.pipeline.vae
        h, w = self.token_hw
        latents = x0.transpose(1, 2).reshape(x0.shape[0], -1, h, w)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).float()
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1).float() + vae.config.batch_norm_eps)
        latents = self.pipeline._unpatchify_latents(latents * std + mean)
        return to_unit(vae.decode(latents.to(vae.dtype), return_dict=False)[0])
