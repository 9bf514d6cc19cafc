"""Qwen-Image 2.x (text-to-image) behind the flow-policy protocol.

Qwen-Image 2.1 (Qwen team, 2026) is a single-stream transformer over ONE joint sequence: the prompt's
Qwen3-VL hidden states, then the target image's latent tokens. Attention is block-causal (causal over the
sequence, bidirectional inside an image block) and, with ``causal_condition``, text tokens are modulated
at t = 0, so they never depend on the image or the step. Conventions reproduced from diffusers'
``QwenImage21Pipeline`` (0.42):

* **Latents.** A 64-channel RGBA VAE with 16× compression; the transformer takes the latent unpatched, so
  ``x`` is the latent flattened to (B, h·w, C) fp32. Each 2×2 group of latent tokens has one slot in the
  encoder's sequence (``img_mask``), so h and w are even: image sides are multiples of 32 px.
* **Text.** The prompt in the pipeline's raw template (system turn dropped), the last decoder layer's
  output before the final norm. The image block's RoPE frame position is the length of the text before
  it, padding included, so padding changes the prediction: ``velocity`` runs each prompt length as a call
  of its own with no padding — what the pipeline computes for one prompt at a time — and every sample's
  velocity is independent of its batch. ``encode`` encodes one prompt at a time for the same reason
  (left padding moves the encoder's positions) and pads the results to ``model.max_sequence_length``
  with a mask, so conditionings of different batches join with ``Cond.cat``.
* **CFG.** Plain u + g·(c − u) over two separate calls (the negative prompt has its own length); no norm
  rescale, unlike Qwen-Image 1.x. The pipeline samples without guidance by default (``true_cfg_scale`` 1).
* **Timestep.** The transformer takes t = σ (the pipeline passes ``timesteps / 1000``).
* **Schedule.** The checkpoint's own scheduler, run on a copy: ``set_timesteps(sigmas=grid, mu=μ(h·w))``
  with the grid the pipeline uses — the checkpoint's ``sample_sigmas`` when it ships a grid of
  ``num_steps`` entries, else ``linspace(1, 1/T, T)``; ``model.shift > 0`` replaces it by a static shift.
* **Decode.** The VAE decodes RGBA; ``decode`` composites it over white (as the pipeline flattens RGBA
  condition images for its encoder), so rewards see RGB.
* **No KV cache.** The pipeline caches the text keys and values after the first step; a cache made under
  ``no_grad`` cannot be replayed through a trained LoRA, so every call recomputes them (the cache-free
  prediction is the pipeline's ``use_kv_cache=False``).

Precision: the frozen transformer and text encoder run in ``model.dtype`` under autocast, the VAE in
fp32; latents stay fp32 between steps and both CFG branches are combined in fp32. Editing with a condition
image (the pipeline's ``image=``) is the family ``qwen_image_2_edit`` (``models/qwen_image_2_edit.py``), which
shares this policy's text encoding, per-length calls and transformer call (:meth:`QwenImage2Policy.branch`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models._latent_grid import LatentGrid, config_mu, static_shift_sigmas
from rlgen_cli.models._qwen_common import pad_text
from rlgen_cli.models.base import Capabilities, Cond, cfg_two_passes
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import (
    latent_statistics,
    load_pipeline,
    to_unit,
)
from rlgen_cli.models.tiny.qwen_image_2 import tiny_qwen_image_2_pipeline
from rlgen_cli.models.trainable import DiffusersCheckpoint, TrainableTransformer, autocast
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal

log = logging.getLogger(__name__)

Source = tuple[Tensor, tuple[int, int]]
"""Condition images' latent tokens (B, h·w, C) and their (h, w) latent grid (one size per batch)."""

QWEN_IMAGE_2_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "img_mlp.proj",
    "img_mlp.gate_layer",
    "img_mlp.out",
]
"""Every attention and SwiGLU projection of each single-stream block: Flow-Factory's default targets for
Qwen-Image 2.1 (``models/qwen_image_21``); text and image tokens share these weights."""


def load_qwen_image_2_pipeline(cfg: ModelConfig) -> Any:
    """Load a real ``QwenImage21Pipeline`` from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import QwenImage21Pipeline

    return load_pipeline(QwenImage21Pipeline, cfg, "Qwen-Image 2.x")


def sigma_grid(num_steps: int, shipped: Sequence[float] | None) -> np.ndarray:
    """The T sigmas before the scheduler's shift: the checkpoint's ``sample_sigmas`` when it ships a grid
    of ``num_steps`` entries, else ``linspace(1, 1/T, T)`` (the pipeline's grid without one)."""
    if shipped is not None and len(shipped) == num_steps:
        return np.asarray(shipped, dtype=np.float64)
    return np.linspace(1.0, 1.0 / num_steps, num_steps)


def qwen_image_2_sigmas(
    num_steps: int,
    image_seq_len: int,
    scheduler: Any,
    shipped: Sequence[float] | None = None,
    shift: float = 0.0,
) -> Tensor:
    """(T+1,) sigmas ending at 0, equal to the pipeline's: a copy of ``scheduler`` (its config as shipped:
    static or dynamic shift, terminal stretch) set to :func:`sigma_grid` with μ from the image token count.
    ``shift > 0`` selects a static SD3 shift of linspace(1, 0, T+1) instead."""
    if shift > 0:
        return static_shift_sigmas(num_steps, shift)
    config = scheduler.config
    mu = config_mu(image_seq_len, config)
    fresh = type(scheduler).from_config(config)  # the pipeline's own scheduler keeps its state
    fresh.set_timesteps(sigmas=sigma_grid(num_steps, shipped), mu=mu)
    return fresh.sigmas.float()


def over_white(rgba: Tensor) -> Tensor:
    """(B, 4, H, W) RGBA in [0, 1] → (B, 3, H, W) RGB composited over a white background."""
    rgb, alpha = rgba[:, :3], rgba[:, 3:4]
    return rgb * alpha + (1.0 - alpha)


class QwenImage2Policy(LatentGrid):
    """Qwen-Image 2.x: Qwen3-VL text conditioning, one block-causal sequence, plain CFG in ``velocity``."""

    family = "qwen_image_2"
    fp32_vae = True
    grid_reason = "Qwen-Image 2.x gives each 2×2 group of the {factor}× downsampled latent one encoder slot"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__(pipeline, cfg, device)
        self.guidance_scale = cfg.guidance_scale
        self.capabilities = Capabilities(has_cfg=cfg.guidance_scale > 1.0)
        self._warn_about_a_shipped_grid()
        self.trainable = TrainableTransformer(
            pipeline,
            cfg,
            checkpoint=DiffusersCheckpoint("QwenImage21Pipeline", "QwenImage21Transformer2DModel"),
        )

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def _warn_about_a_shipped_grid(self) -> None:
        shipped = self.pipeline.config.get("sample_sigmas")
        steps = {self.cfg.num_steps, self.cfg.eval_num_steps}
        if shipped is not None and steps != {len(shipped)}:
            log.warning(
                "the checkpoint ships a %d-step sampling grid (sample_sigmas), used for runs of %d steps; "
                "model.num_steps=%d / eval_num_steps=%d other than that sample linspace(1, 1/T, T) through "
                "the scheduler, as the pipeline does when called with sigmas=linspace(1, 1/T, T)",
                len(shipped),
                len(shipped),
                self.cfg.num_steps,
                self.cfg.eval_num_steps,
            )

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Prompt hidden states + masks, padded to ``model.max_sequence_length`` (negative branch when g > 1).

        Keys: ``prompt_embeds`` (B, S, D) in the encoder's dtype, ``prompt_mask`` (B, S) bool and, with
        CFG, ``neg_prompt_embeds`` / ``neg_prompt_mask`` of ``model.negative_prompt``.
        """
        embeds, mask = self._texts(prompts)
        tensors = {"prompt_embeds": embeds, "prompt_mask": mask}
        if self.guidance_scale > 1.0:
            neg, neg_mask = self._texts([self.cfg.negative_prompt])
            n = len(prompts)
            tensors |= {"neg_prompt_embeds": neg.repeat(n, 1, 1), "neg_prompt_mask": neg_mask.repeat(n, 1)}
        return Cond(tensors)

    def _texts(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """Each prompt encoded on its own (no padding reaches the encoder), padded to the model length."""
        rows = [self._text(prompt)[:2] for prompt in prompts]
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])

    def _text(self, prompt: str, images: list | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One prompt (with its condition ``images``, if any) encoded alone: embeddings, valid-token mask and
        the mask of the encoder's image slots, each padded to ``model.max_sequence_length``."""
        embeds, mask, image_slots = self.pipeline.encode_prompt(
            prompt=[prompt], image=images, device=self.device
        )
        length = self.cfg.max_sequence_length
        if embeds.shape[1] > length:
            raise UserError(
                f"a prompt encodes to {embeds.shape[1]} tokens (template included) but "
                f"model.max_sequence_length={length}; raise model.max_sequence_length or shorten the prompt"
            )
        embeds, mask = pad_text(embeds, mask, length)
        return embeds, mask, F.pad(image_slots.bool(), (0, length - image_slots.shape[1]), value=False)

    # -- sampling geometry --------------------------------------------------------------------
    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """x_1 ~ N(0, I) drawn in the latent shape (n, C, h, w), flattened: fp32 (n, h·w, C)."""
        shape = (self.transformer.config.in_channels, *self.latent_hw)
        return standard_normal(n, shape, generator, self.device).flatten(2).transpose(1, 2)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """(T+1,) sigmas ending at 0 for the image tokens of ``x`` (see :func:`qwen_image_2_sigmas`)."""
        shipped = self.pipeline.config.get("sample_sigmas")
        sigmas = qwen_image_2_sigmas(num_steps, x.shape[1], self.pipeline.scheduler, shipped, self.cfg.shift)
        return sigmas.to(self.device)

    # -- the one transformer call -------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) for x (B, L, C) fp32 and sigma 0-d or (B,), CFG folded in; fp32 (B, L, C)."""
        t = sigma.float().reshape(-1).expand(x.shape[0]).to(self.device)  # t = σ = timesteps / 1000
        cond_v = self._by_prompt_length(x, t, *self.branch(cond, negative=False))
        if self.guidance_scale <= 1.0:
            return cond_v
        unconditional = functools.partial(self._by_prompt_length, x, t, *self.branch(cond, negative=True))
        return cfg_two_passes(cond_v, unconditional, self.guidance_scale)

    def branch(self, cond: Cond, negative: bool) -> tuple[Tensor, Tensor, Tensor | None, Source | None]:
        """One CFG branch of ``cond``: prompt embeddings and mask, then (editing only) the mask of the encoder's
        image slots and the condition images' latent tokens with their (h, w) grid."""
        prefix = "neg_" if negative else ""
        return cond.tensors[f"{prefix}prompt_embeds"], cond.tensors[f"{prefix}prompt_mask"], None, None

    def _by_prompt_length(
        self,
        x: Tensor,
        t: Tensor,
        embeds: Tensor,
        mask: Tensor,
        image_slots: Tensor | None,
        source: Source | None,
    ) -> Tensor:
        """One transformer call per distinct prompt length, each prompt unpadded; rows back in order."""
        lengths = mask.sum(dim=1)
        outputs, rows = [], []
        for length in lengths.unique().tolist():
            index = (lengths == length).nonzero().squeeze(1)
            slots = None if image_slots is None else image_slots[index, : int(length)]
            rows_source = None if source is None else (source[0][index], source[1])
            outputs.append(
                self._forward(x[index], t[index], embeds[index, : int(length)], slots, rows_source)
            )
            rows.append(index)
        return torch.cat(outputs)[torch.argsort(torch.cat(rows))]

    def _forward(
        self, x: Tensor, t: Tensor, embeds: Tensor, image_slots: Tensor | None, source: Source | None
    ) -> Tensor:
        """One pass in the model dtype over [prompt tokens, image tokens]; the target tokens' fp32 output.
        ``image_slots`` marks the prompt positions the condition images' tokens fill, and ``source`` holds
        those tokens (before the target's in the sequence) with their (h, w) grid (editing only)."""
        batch, tokens = x.shape[:2]
        if image_slots is None:
            image_slots = torch.zeros(batch, embeds.shape[1], dtype=torch.bool, device=self.device)
        slots = torch.cat(
            [image_slots, torch.ones(batch, tokens // 4, dtype=torch.bool, device=self.device)], dim=1
        )
        hidden, shapes = x, [(1, *self.latent_hw)]
        if source is not None:
            hidden, shapes = torch.cat([source[0].to(x.dtype), x], dim=1), [(1, *source[1]), *shapes]
        with autocast(self.device, self.dtype):
            out = self.trainable.forward_module()(
                hidden_states=hidden.to(self.dtype),
                encoder_hidden_states=embeds,
                timestep=t,
                img_shapes=[shapes] * batch,
                img_mask=slots,
                return_dict=False,
            )[0]
        return out[:, -tokens:].float()

    @torch.no_grad()
    def decode_rgba(self, x0: Tensor) -> Tensor:
        """Flattened latents (B, h·w, C) → the VAE's images (B, channels, H, W) in [0, 1], fp32."""
        vae = self.pipeline.vae
        batch, _, channels = x0.shape
        mean, std = latent_statistics(vae, self.device)
        latents = x0.float().transpose(1, 2).reshape(batch, channels, 1, *self.latent_hw) * std + mean
        return to_unit(vae.decode(latents.to(vae.dtype), return_dict=False)[0][:, :, 0])

    def decode(self, x0: Tensor) -> Tensor:
        """Flattened latents (B, h·w, C) → RGB images (B, 3, H, W) in [0, 1]: RGBA over white."""
        images = self.decode_rgba(x0)
        return over_white(images) if images.shape[1] == 4 else images


def build(cfg: ModelConfig, device: torch.device) -> QwenImage2Policy:
    """The registry's entry point: tiny or loaded pipeline (``models/building.py``)."""
    pipeline = family_pipeline(cfg, device, tiny_qwen_image_2_pipeline, load_qwen_image_2_pipeline)
    return with_prompt_cache(QwenImage2Policy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
