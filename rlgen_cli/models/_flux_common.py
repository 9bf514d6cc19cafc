"""What FLUX.1-dev and FLUX.1-Kontext-dev share: :class:`FluxModel`, the component both adapters hold.

FLUX.1 (Black Forest Labs, 2024; Labs et al. 2025, "FLUX.1 Kontext: Flow Matching for In-Context Image
Generation and Editing in Latent Space") is a rectified-flow MMDiT: double-stream blocks, then
single-stream blocks over the joint text + image sequence, with 3-axis RoPE position ids. Conventions
reproduced from diffusers' ``FluxPipeline`` (0.42):

* **Packing.** The VAE latent (B, C, h, w) is cut into 2×2 patches, so the policy's ``x`` is the packed
  token sequence (B, h/2·w/2, 4C); image ids are (0, row, col) per token, text ids are zeros.
* **Schedule.** ``linspace(1, 1/T, T)`` with the dynamic exponential shift μ linear in the image token
  count (docs/maths.md §1.3). ``model.shift > 0`` selects a static SD3-style shift of ``linspace(1, 0, T+1)``
  instead (DanceGRPO / MixGRPO use 3).
* **Timestep.** The transformer takes t = σ (diffusers passes ``timesteps / 1000`` with timesteps = σ·1000
  and multiplies by 1000 inside); the guidance-distilled models embed the guidance scale the same way.
  There is NO classifier-free-guidance branch: one transformer call per velocity.

Precision: FLUX must run in bf16 (fp16 overflows its activations; upstream Flow-GRPO uses bf16). The
frozen weights and the forward run in ``model.dtype`` under autocast, LoRA / fully trained weights are
fp32, latents are fp32 between steps and ``velocity`` returns fp32, so the SDE step and its log-prob are
computed in fp32 on both the sampling and the training path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rlgen_cli.models._latent_grid import PackedModel, config_mu, static_shift_sigmas
from rlgen_cli.models.base import Cond
from rlgen_cli.models.loading import (
    decode_shifted,
    pack,
    unpack,
)
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME as LORA_WEIGHTS_NAME  # re-exported
from rlgen_cli.models.trainable import DiffusersCheckpoint, TrainableTransformer, autocast
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.schedule import dynamic_shift_sigmas

FLUX_LORA_TARGETS = [
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]
"""Flow-GRPO's FLUX.1-dev LoRA targets: attention (double and single blocks) and both feed-forwards."""


def image_ids(h: int, w: int, index: int, device: torch.device) -> Tensor:
    """RoPE ids (h/2·w/2, 3) of a packed h×w latent: (index, row, col); index 1 marks Kontext's source."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 0] = index
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3)


def dead_context_outputs(transformer: nn.Module) -> list[str]:
    """LoRA modules that can never get a gradient: without single-stream blocks the last double block's
    text-stream outputs (``attn.to_add_out``, ``ff_context``) are discarded. Empty for real FLUX."""
    if len(transformer.single_transformer_blocks) > 0 or len(transformer.transformer_blocks) == 0:
        return []
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
    return [f"{last}.attn.to_add_out", f"{last}.ff_context.net.0.proj", f"{last}.ff_context.net.2"]


def flux_sigmas(num_steps: int, image_tokens: int, scheduler_config: Any, shift: float = 0.0) -> Tensor:
    """(T+1,) sigmas ending at 0: the dynamic shift μ(image tokens) of the pipeline's scheduler config, or
    a static SD3-style ``shift > 0`` of ``linspace(1, 0, T+1)``."""
    if shift > 0:
        return static_shift_sigmas(num_steps, shift)
    config = scheduler_config
    mu = config_mu(image_tokens, config)
    return dynamic_shift_sigmas(num_steps, mu)


class FluxModel(PackedModel):
    """A FLUX pipeline set up for training: frozen encoders and VAE, the trainable transformer
    (:attr:`trainable`), the packed-latent geometry (:class:`PackedModel`) and the one transformer call.
    ``x`` is the packed latent (B, L, D) in fp32.

    Args:
        pipeline: A ``FluxPipeline`` or ``FluxKontextPipeline`` (moved to ``device``).
        cfg: The model config (size, dtype, LoRA, shift, sequence length).
        pipeline_class: The diffusers pipeline class whose ``load_lora_weights`` reads the checkpoints.
    """

    grid_reason = "FLUX packs 2×2 patches of the {factor}× downsampled latent"
    encoders = ("vae", "text_encoder", "text_encoder_2")
    fp32_vae = False
    sigmas = staticmethod(flux_sigmas)

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device, pipeline_class: str) -> None:
        super().__init__(pipeline, cfg, device)
        self.trainable = TrainableTransformer(
            pipeline,
            cfg,
            checkpoint=DiffusersCheckpoint(pipeline_class, "FluxTransformer2DModel"),
            exclude=dead_context_outputs(pipeline.transformer) if cfg.lora.enabled else (),
        )

    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        """T5 token embeddings (B, S, 4096) and the pooled CLIP embedding (B, 768) (real sizes)."""
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.cfg.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled": pooled}

    @torch.no_grad()
    def encode_image(self, images: Tensor, index: int) -> tuple[Tensor, Tensor]:
        """Images (B, 3, H, W) in [0, 1] → packed fp32 VAE latents (B, L', D) (posterior mode, then shift
        and scale, as ``FluxKontextPipeline._encode_vae_image``) and their (L', 3) ids on RoPE axis ``index``."""
        vae = self.pipeline.vae
        h = self.latent_side(images.shape[2], "height")
        w = self.latent_side(images.shape[3], "width")
        pixels = (images.to(self.device, vae.dtype) * 2 - 1).clamp(-1, 1)
        latents = vae.encode(pixels).latent_dist.mode()  # sample_mode="argmax", as the pipeline
        latents = (latents.float() - vae.config.shift_factor) * vae.config.scaling_factor
        return pack(latents), image_ids(h, w, index=index, device=self.device)

    def velocity(
        self,
        x: Tensor,
        sigma: Tensor,
        cond: Cond,
        guidance_scale: float,
        context: tuple[Tensor, Tensor] | None,
    ) -> Tensor:
        """v(x, σ) for packed x (B, L, D) fp32, sigma 0-d or (B,); returns the target tokens' fp32 (B, L, D).

        ``context``: extra (B, L', D) tokens and their (L', 3) ids appended after the target tokens
        (Kontext's source image); the transformer sees the whole sequence.
        """
        batch, length = x.shape[:2]
        embeds, pooled = cond.tensors["prompt_embeds"], cond.tensors["pooled"]
        timestep = sigma.float().reshape(-1).expand(batch).to(self.device)  # t = σ = timesteps / 1000
        guidance = None
        if self.pipeline.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), guidance_scale, device=self.device, dtype=torch.float32)
        hidden, ids = x, image_ids(*self.latent_hw, index=0, device=self.device)
        if context is not None:
            hidden, ids = torch.cat([x, context[0].to(x.dtype)], dim=1), torch.cat([ids, context[1]])
        text_ids = torch.zeros(embeds.shape[1], 3, device=self.device)
        with autocast(self.device, self.dtype):
            out = self.trainable.forward_module()(
                hidden_states=hidden.to(self.dtype),
                timestep=timestep,
                guidance=guidance,
                pooled_projections=pooled,
                encoder_hidden_states=embeds,
                txt_ids=text_ids,
                img_ids=ids,
                return_dict=False,
            )[0]
        return out[:, :length].float()

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Packed latents (B, L, D) → images (B, 3, H, W) in [0, 1], fp32."""
        return decode_shifted(self.pipeline.vae, unpack(x0, *self.latent_hw))
