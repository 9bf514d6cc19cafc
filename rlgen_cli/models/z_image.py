"""Z-Image (text-to-image) behind the flow-policy protocol.

Z-Image (Tongyi-MAI, 2025) is a 6 B single-stream DiT: caption tokens (the second-to-last hidden state of
a Qwen3 encoder over the prompt in a chat user turn) and 2×2 patches of a 16-channel FLUX VAE latent run
through one transformer. Conventions reproduced from diffusers' ``ZImagePipeline`` (0.42):

* **Latents.** ``x`` is the unpacked VAE latent (B, C, h, w) in fp32; the transformer takes a list of
  (C, 1, h, w) frames and patchifies them itself.
* **Text.** Each prompt keeps only its valid tokens (no padding reaches the transformer). rlgen pads every
  batch to ``model.max_sequence_length`` with a mask (so conditionings of different batches join with
  ``Cond.cat``) and ``velocity`` hands the transformer each prompt's valid tokens, as the pipeline does.
* **Time and sign.** The transformer takes t = 1 − σ and predicts x₀ − ε, the negative of the velocity
  dx/dσ that rlgen integrates; ``velocity`` flips the sign.
* **CFG.** ``model.guidance_scale`` g is rlgen's u + g·(c − u) everywhere; the pipeline's
  ``guidance_scale`` is g − 1 (it writes c + g'·(c − u)), so the pipeline's 4.0 is rlgen's 5.0. The
  pipeline's optional ``cfg_normalization`` / ``cfg_truncation`` are off by default and not reproduced.
* **Schedule.** ``linspace(1, 1/T, T)`` through the scheduler's shift: the static shift the checkpoint's
  scheduler config names, or the exponential dynamic shift with μ linear in the image token count.

Precision: the frozen transformer and text encoder run in ``model.dtype`` under autocast, the VAE in
fp32; latents stay fp32 between steps and both CFG branches are combined in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models._latent_grid import LatentGrid, config_mu
from rlgen_cli.models.base import Capabilities, Cond, cfg_combine, uncond_takes_grad
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import (
    decode_shifted,
    load_pipeline,
)
from rlgen_cli.models.tiny import tiny_z_image_pipeline
from rlgen_cli.models.trainable import DiffusersCheckpoint, TrainableTransformer, autocast
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal
from rlgen_cli.sde.schedule import dynamic_shift_sigmas, shift_sigmas

Z_IMAGE_LORA_TARGETS = [
    "attention.to_k",
    "attention.to_q",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
]
"""Attention projections and the SwiGLU MLP of every block (Flow-Factory's Z-Image default targets)."""


def load_z_image_pipeline(cfg: ModelConfig) -> Any:
    """Load a real ``ZImagePipeline`` from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import ZImagePipeline

    return load_pipeline(ZImagePipeline, cfg, "Z-Image")


def z_image_sigmas(num_steps: int, image_seq_len: int, config: Any, shift: float = 0.0) -> Tensor:
    """(T+1,) sigmas ending at 0, equal to ``ZImagePipeline``'s scheduler: ``linspace(1, 1/T, T)`` through
    the static shift of the scheduler config (or ``shift > 0``, which overrides it), or the exponential
    dynamic shift with μ from the image token count when the config asks for it."""
    grid = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # its first T entries: 1 … 1/T
    if shift > 0:
        return shift_sigmas(grid, shift)
    if not config.get("use_dynamic_shifting", False):
        return shift_sigmas(grid, float(config.get("shift", 1.0)))
    if config.get("time_shift_type", "exponential") != "exponential" or config.get("shift_terminal"):
        raise UserError(
            "the pipeline's scheduler uses a time shift Z-Image does not ship (linear, or a terminal stretch); "
            "use the checkpoint's scheduler config or set model.shift > 0 for a static shift"
        )
    mu = config_mu(image_seq_len, config)
    return dynamic_shift_sigmas(num_steps, mu)


def pad_captions(captions: Sequence[Tensor], length: int) -> tuple[Tensor, Tensor]:
    """Ragged (S_i, D) caption embeddings → (B, length, D) right-padded and their (B, length) bool mask."""
    longest = max(c.shape[0] for c in captions)
    if longest >= length:
        raise UserError(
            f"a prompt fills model.max_sequence_length={length} tokens (chat template included), so the "
            "pipeline's tokenizer truncates it; raise model.max_sequence_length or shorten the prompt"
        )
    embeds = torch.stack([F.pad(c, (0, 0, 0, length - c.shape[0])) for c in captions])
    mask = torch.stack([torch.arange(length, device=c.device) < c.shape[0] for c in captions])
    return embeds, mask


class ZImagePolicy(LatentGrid):
    """Z-Image: Qwen3 caption features, single-stream transformer, CFG inside ``velocity``."""

    family = "z_image"
    fp32_vae = True
    grid_reason = "Z-Image patchifies 2×2 patches of the {factor}× downsampled latent"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__(pipeline, cfg, device)
        self.guidance_scale = cfg.guidance_scale
        self.capabilities = Capabilities(has_cfg=cfg.guidance_scale > 1.0)
        self.trainable = TrainableTransformer(
            pipeline,
            cfg,
            checkpoint=DiffusersCheckpoint("ZImagePipeline", "ZImageTransformer2DModel"),
        )

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Caption features padded to ``model.max_sequence_length`` (negative branch when g > 1).

        Keys: ``prompt_embeds`` (B, S, D) in the encoder's dtype, ``prompt_mask`` (B, S) bool and, with CFG,
        ``neg_prompt_embeds`` / ``neg_prompt_mask`` of ``model.negative_prompt``.
        """
        embeds, mask = self._captions(prompts)
        tensors = {"prompt_embeds": embeds, "prompt_mask": mask}
        if self.guidance_scale > 1.0:
            neg, neg_mask = self._captions([self.cfg.negative_prompt] * len(prompts))
            tensors |= {"neg_prompt_embeds": neg, "neg_prompt_mask": neg_mask}
        return Cond(tensors)

    def _captions(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        # the pipeline rewrites the list it is given in place (chat template), so it gets a copy
        captions = self.pipeline.encode_prompt(
            prompt=list(prompts),
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.cfg.max_sequence_length,
        )[0]
        return pad_captions(captions, self.cfg.max_sequence_length)

    # -- sampling geometry --------------------------------------------------------------------
    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """x_1 ~ N(0, I), fp32 (n, C, h, w); one generator per sample or one for all."""
        shape = (self.transformer.config.in_channels, *self.latent_hw)
        return standard_normal(n, shape, generator, self.device)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """(T+1,) sigmas ending at 0 for the 2×2-patch token count of ``x`` (see :func:`z_image_sigmas`)."""
        tokens = (x.shape[2] // 2) * (x.shape[3] // 2)
        sigmas = z_image_sigmas(num_steps, tokens, self.pipeline.scheduler.config, self.cfg.shift)
        return sigmas.to(self.device)

    # -- the one transformer call -------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """dx/dσ at (x, σ) for x (B, C, h, w) fp32 and sigma 0-d or (B,), CFG folded in; fp32 (B, C, h, w)."""
        batch = x.shape[0]
        t = 1.0 - sigma.float().reshape(-1).expand(batch).to(self.device)  # the transformer's time
        embeds, mask = cond.tensors["prompt_embeds"], cond.tensors["prompt_mask"]
        if self.guidance_scale <= 1.0:
            return -self._forward(x, t, embeds, mask)
        neg, neg_mask = cond.tensors["neg_prompt_embeds"], cond.tensors["neg_prompt_mask"]
        if not uncond_takes_grad():  # a separate no-grad unconditional pass (see SD3Policy.velocity)
            with torch.no_grad():
                uncond = self._forward(x, t, neg, neg_mask)
            return -cfg_combine(uncond, self._forward(x, t, embeds, mask), self.guidance_scale)
        out = self._forward(
            torch.cat([x, x]), torch.cat([t, t]), torch.cat([embeds, neg]), torch.cat([mask, neg_mask])
        )
        cond_v, uncond = out.chunk(2)
        return -cfg_combine(uncond, cond_v, self.guidance_scale)

    def _forward(self, x: Tensor, t: Tensor, embeds: Tensor, mask: Tensor) -> Tensor:
        """One transformer pass in the model dtype over each prompt's valid tokens; fp32 (B, C, h, w) out."""
        frames = list(x.to(self.dtype).unsqueeze(2).unbind(0))  # (C, 1, h, w) each
        captions = [e[m] for e, m in zip(embeds, mask, strict=True)]
        with autocast(self.device, self.dtype):
            out = self.trainable.forward_module()(frames, t, captions, return_dict=False)[0]
        return torch.stack(out).squeeze(2).float()

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Latents (B, C, h, w) → images (B, 3, H, W) in [0, 1], fp32."""
        return decode_shifted(self.pipeline.vae, x0.float())


def build(cfg: ModelConfig, device: torch.device) -> ZImagePolicy:
    """The registry's entry point: tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_z_image_pipeline, load_z_image_pipeline)
    return with_prompt_cache(ZImagePolicy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
