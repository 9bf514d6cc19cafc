"""What Qwen-Image and Qwen-Image-Edit share: :class:`QwenModel`, the component both adapters hold.

Qwen-Image (Wu et al. 2025, "Qwen-Image Technical Report") is a 20 B double-stream MMDiT conditioned on
the last hidden state of a Qwen2.5-VL-7B encoder, over a 16-channel causal video VAE (8× downsampling).
Conventions reproduced from diffusers' ``QwenImagePipeline`` / ``QwenImageEditPipeline`` (0.42):

* **Packing.** The VAE latent (B, C, h, w) is cut into 2×2 patches, so the policy's ``x`` is the packed
  token sequence (B, h/2·w/2, 4C); RoPE positions come from ``img_shapes`` [(frame, h/2, w/2), ...].
* **Text.** The prompt goes through the pipeline's chat template; hidden states after the template
  prefix are the tokens, with a padding mask. rlgen pads every batch to ``model.max_sequence_length``
  (so conditionings of different batches join with ``Cond.cat``) and ``velocity`` trims the batch to its
  longest valid prompt, as upstream Flow-GRPO does; masked tokens never reach the image tokens.
* **Schedule.** ``linspace(1, 1/T, T)`` with the exponential dynamic shift μ linear in the image token
  count (scheduler config: 256…8192 tokens, shift 0.5…0.9), then stretched so the last non-zero σ is
  ``shift_terminal`` (0.02), exactly as ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas, mu)``.
* **True CFG.** Both branches run in one batched call; the combination u + g·(c − u) is rescaled per token
  to the conditional prediction's norm (``QwenImagePipeline.__call__``). Guidance 1 runs no negative branch.
* **Timestep.** The transformer takes t = σ (diffusers passes ``timesteps / 1000``).

Precision: the frozen transformer and text encoder run in ``model.dtype`` (bf16 upstream) under
autocast; the VAE runs in fp32 (as upstream Flow-GRPO); LoRA / fully trained weights are fp32. Latents
are fp32 between steps and ``velocity`` upcasts both branches to fp32 before the CFG combination and the
norm rescale (upstream casts latents to bf16 between steps and combines in bf16; storing fp32 is what
makes the recomputed log-prob equal the sampled one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models._component_policy import ComponentPolicy
from rlgen_cli.models._latent_grid import PackedModel, config_mu, static_shift_sigmas
from rlgen_cli.models.base import Cond, cfg_combine, uncond_takes_grad
from rlgen_cli.models.loading import (
    latent_statistics,
    pack,
    to_unit,
    unpack,
)
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME as LORA_WEIGHTS_NAME  # re-exported
from rlgen_cli.models.trainable import TRANSFORMER_DIR as TRANSFORMER_DIR  # re-exported
from rlgen_cli.models.trainable import DiffusersCheckpoint, TrainableTransformer, autocast
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.schedule import dynamic_shift_sigmas

QWEN_LORA_TARGETS = [
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
]
"""Flow-GRPO's Qwen-Image LoRA targets (``scripts/train_qwenimage.py``): both attention streams and MLPs."""


def pad_text(embeds: Tensor, mask: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
    """Right-pad (B, S, D) embeddings and their (B, S) mask (None = all valid) to ``length`` tokens."""
    batch, seq = embeds.shape[:2]
    if seq > length:
        raise UserError(
            f"the encoded prompt has {seq} tokens but model.max_sequence_length={length}; raise "
            "model.max_sequence_length (Qwen-Image accepts up to 1024) or shorten the prompts"
        )
    if mask is None:
        mask = torch.ones(batch, seq, dtype=torch.bool, device=embeds.device)
    return F.pad(embeds, (0, 0, 0, length - seq)), F.pad(mask.bool(), (0, length - seq), value=False)


def true_cfg(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
    """u + g·(c − u), rescaled per token (last dim) to the norm of the conditional prediction c."""
    combined = cfg_combine(uncond, cond, scale)
    return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


def qwen_sigmas(num_steps: int, image_seq_len: int, config: Any, shift: float = 0.0) -> Tensor:
    """(T+1,) sigmas ending at 0, equal to the pipeline's scheduler: dynamic exponential shift μ(tokens)
    and the ``shift_terminal`` stretch; ``shift > 0`` selects a static SD3 shift of linspace(1, 0, T+1)."""
    if shift > 0:
        return static_shift_sigmas(num_steps, shift)
    if not config.get("use_dynamic_shifting", False) or config.get("time_shift_type") != "exponential":
        raise UserError(
            "the pipeline's scheduler does not use the exponential dynamic shift Qwen-Image ships; use the "
            "original scheduler config or set model.shift > 0 for a static shift"
        )
    mu = config_mu(image_seq_len, config)
    sigmas = dynamic_shift_sigmas(num_steps, mu)
    terminal = config.get("shift_terminal")
    if terminal:
        one_minus = 1.0 - sigmas[:-1].double()
        stretched = 1.0 - one_minus / (one_minus[-1] / (1.0 - terminal))
        sigmas = torch.cat([stretched.float(), sigmas.new_zeros(1)])
    return sigmas


def dead_text_outputs(transformer: nn.Module) -> list[str]:
    """LoRA modules that can never get a gradient: the model returns only the image stream, so the last
    block's text-stream outputs (its text queries, ``to_add_out`` and ``txt_mlp``) are discarded."""
    last = f"transformer_blocks.{len(transformer.transformer_blocks) - 1}"
    return [
        f"{last}.attn.add_q_proj",
        f"{last}.attn.to_add_out",
        f"{last}.txt_mlp.net.0.proj",
        f"{last}.txt_mlp.net.2",
    ]


def source_context(cond: Cond, mixed: str) -> tuple[Tensor, tuple[int, int, int]]:
    """An editing family's source latent tokens and their (frames, h/2, w/2) RoPE shape, which must be one
    for the whole batch (``mixed``: the error when it is not)."""
    shapes = cond.tensors["source_shape"]
    if not bool((shapes == shapes[0]).all()):
        raise UserError(mixed)
    frames, h, w = (int(v) for v in shapes[0])
    return cond.tensors["source_latents"], (frames, h, w)


TextEncoder = Callable[[list[str]], tuple[Tensor, Tensor | None]]
"""The pipeline's ``encode_prompt`` for a list of prompts: (embeds (B, S, D), mask (B, S) or None)."""


class QwenModel(PackedModel):
    """A Qwen-Image pipeline set up for training: frozen VL encoder, fp32 VAE, the trainable transformer
    (:attr:`trainable`), the packed-latent geometry (:class:`PackedModel`) and the transformer call with
    true CFG. ``x`` is the
    packed latent (B, L, D) in fp32.

    Args:
        pipeline: A ``QwenImagePipeline`` or ``QwenImageEditPipeline`` (moved to ``device``).
        cfg: The model config (size, dtype, LoRA, shift, sequence length, negative prompt).
        pipeline_class: The diffusers pipeline class whose ``load_lora_weights`` reads the checkpoints.
    """

    grid_reason = "Qwen-Image packs 2×2 patches of the {factor}× downsampled latent"
    encoders = ("vae", "text_encoder")
    fp32_vae = True  # upstream: fp32 VAE
    sigmas = staticmethod(qwen_sigmas)

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device, pipeline_class: str) -> None:
        super().__init__(pipeline, cfg, device)
        # Gradient checkpointing: upstream trains the 20 B transformer with activation checkpointing too.
        self.trainable = TrainableTransformer(
            pipeline,
            cfg,
            checkpoint=DiffusersCheckpoint(pipeline_class, "QwenImageTransformer2DModel"),
            exclude=dead_text_outputs(pipeline.transformer) if cfg.lora.enabled else (),
        )

    # -- conditioning -------------------------------------------------------------------------
    def text_branches(
        self, encode_one: TextEncoder, prompts: Sequence[str], cfg_branch: bool
    ) -> dict[str, Tensor]:
        """Padded embeddings + masks of the prompts and, with ``cfg_branch``, of ``model.negative_prompt``."""
        length = self.cfg.max_sequence_length
        embeds, mask = pad_text(*encode_one(list(prompts)), length)
        tensors = {"prompt_embeds": embeds, "prompt_mask": mask}
        if cfg_branch:
            neg, neg_mask = pad_text(*encode_one([self.cfg.negative_prompt] * len(prompts)), length)
            tensors |= {"neg_prompt_embeds": neg, "neg_prompt_mask": neg_mask}
        return tensors

    @torch.no_grad()
    def encode_image(self, images: Tensor, what: str) -> tuple[Tensor, Tensor]:
        """Packed, normalised VAE latents (B, L', 4C) fp32 of images (B, 3, H, W) in [0, 1] (posterior
        mode) and their (1, 3) RoPE shape (frame 1, h/2, w/2); ``what`` names the images in errors."""
        h = self.latent_side(images.shape[2], f"height ({what})")
        w = self.latent_side(images.shape[3], f"width ({what})")
        vae = self.pipeline.vae
        pixels = (images.to(self.device, vae.dtype) * 2 - 1).unsqueeze(2)  # (B, 3, 1, H, W) in [-1, 1]
        mean, std = latent_statistics(self.pipeline.vae, self.device)
        latents = (vae.encode(pixels).latent_dist.mode().float() - mean) / std  # (B, C, 1, h, w)
        shape = torch.tensor([[1, h // 2, w // 2]], device=self.device)
        return pack(latents[:, :, 0]), shape

    # -- the one transformer call -------------------------------------------------------------
    def velocity(
        self,
        x: Tensor,
        sigma: Tensor,
        cond: Cond,
        guidance_scale: float,
        context: tuple[Tensor, tuple[int, int, int]] | None,
    ) -> Tensor:
        """v(x, σ) for packed x (B, L, D) fp32, sigma 0-d or (B,); true CFG folded in; fp32 (B, L, D).

        ``context``: extra (B, L', D) tokens appended after the target tokens and their (frame, h/2, w/2)
        RoPE shape (Edit's source image); only the target tokens' prediction is returned.
        """
        batch, length = x.shape[:2]
        timestep = sigma.float().reshape(-1).expand(batch).to(self.device)  # t = σ = timesteps / 1000
        shapes = [(1, self.latent_hw[0] // 2, self.latent_hw[1] // 2)]
        hidden = x
        if context is not None:
            hidden, shapes = torch.cat([x, context[0].to(x.dtype)], dim=1), [*shapes, context[1]]
        embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_mask"]
        if guidance_scale <= 1.0:
            return self._forward(hidden, timestep, embeds, mask, shapes)[:, :length]
        neg_embeds, neg_mask = cond.tensors["neg_prompt_embeds"], cond.tensors["neg_prompt_mask"]
        if not uncond_takes_grad():  # a separate no-grad unconditional pass (see SD3Policy.velocity)
            with torch.no_grad():
                uncond_v = self._forward(hidden, timestep, neg_embeds, neg_mask, shapes)[:, :length]
            cond_v = self._forward(hidden, timestep, embeds, mask, shapes)[:, :length]
            return true_cfg(cond_v, uncond_v, guidance_scale)
        out = self._forward(
            torch.cat([hidden, hidden]),
            torch.cat([timestep, timestep]),
            torch.cat([embeds, neg_embeds]),
            torch.cat([mask, neg_mask]),
            shapes,
        )[:, :length]
        cond_v, uncond_v = out.chunk(2)
        return true_cfg(cond_v, uncond_v, guidance_scale)

    def _forward(
        self, hidden: Tensor, timestep: Tensor, embeds: Tensor, mask: Tensor, shapes: list
    ) -> Tensor:
        """One transformer pass in the model dtype, fp32 out, over the text tokens some prompt of the
        batch uses (the padding every prompt shares is dropped)."""
        keep = max(int(mask.sum(dim=1).max()), 1)
        with autocast(self.device, self.dtype):
            out = self.trainable.forward_module()(
                hidden_states=hidden.to(self.dtype),
                timestep=timestep,
                encoder_hidden_states=embeds[:, :keep],
                encoder_hidden_states_mask=mask[:, :keep],
                img_shapes=[shapes] * hidden.shape[0],
                return_dict=False,
            )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Packed latents (B, L, D) → images (B, 3, H, W) in [0, 1], fp32."""
        vae = self.pipeline.vae
        mean, std = latent_statistics(self.pipeline.vae, self.device)
        latents = unpack(x0.float(), *self.latent_hw).unsqueeze(2) / (1.0 / std) + mean  # (B, C, 1, h, w)
        return to_unit(vae.decode(latents.to(vae.dtype), return_dict=False)[0][:, :, 0])


class QwenPolicy(ComponentPolicy):
    """The Qwen-Image adapters' common half: a :class:`QwenModel` component, true CFG when guidance > 1."""

    component = QwenModel
    true_cfg = True

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.model.latent_hw
