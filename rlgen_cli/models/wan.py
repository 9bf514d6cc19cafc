"""Wan2.1 text-to-video behind the flow-policy protocol (family ``wan2_1``).

Real weights load through ``WanPipeline.from_pretrained`` (hub id ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` or a
local directory, ``local_files_only`` and dtype honoured; the VAE is kept in fp32 like upstream Flow-GRPO);
``models/tiny.py`` builds the same classes (``WanTransformer3DModel``, ``AutoencoderKLWan``, UMT5) from
tiny configs with random weights and the offline T5 tokenizer.

Geometry: ``x`` is the video latent (B, C, F', H', W') with F' = (F − 1)/4 + 1 and H', W' = H/8, W/8
for the real VAE; noise is drawn per sample in fp32.

Schedule: WanPipeline ships ``UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=s)`` (s = 3.0 for
Wan2.1-T2V-1.3B at 480p). rlgen samples with its own SDE/ODE steps, on that scheduler's σ grid:
``linspace(1, 1/1000, T + 1)[:-1]`` shifted by ``s·σ/(1 + (s − 1)·σ)``, then 0 (:func:`wan_sigmas`). UniPC
nudges σ₀ to 1 − 1e-6 to keep its log-SNR finite; rlgen keeps σ₀ = 1 (``flow_sde`` substitutes σ₁ there).
The transformer gets UniPC's integer timesteps ⌊1000·σ⌋ (:func:`wan_timestep`), as in WanPipeline.

CFG: two separate transformer forwards (conditional, then unconditional) at the policy's batch size, in
the model dtype, combined inside :meth:`WanPolicy.velocity` — upstream WanPipeline and Flow-GRPO's Wan
trainer do the same. A batch concat would change the batch composition of every GEMM (outputs then
differ from WanPipeline's at the last bits) and doubles the peak activation memory of no-grad rollouts,
where a 33-frame 240×416 sample is already ~3.5 k tokens; one code path for sampling and training keeps
the on-policy ratio exactly 1 either way.

LoRA (Flow-GRPO's Wan settings: r 32, α 64, gaussian init) goes on the self- and cross-attention
projections of every block: ``attn1.{to_q,to_k,to_v,to_out.0}`` and ``attn2.{…}`` (T2V blocks have no
``add_k_proj``/``add_v_proj``; those exist only with image conditioning). It is saved in the format
``WanPipeline.load_lora_weights`` reads, adapter config in the safetensors metadata.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import TORCH_DTYPES, Capabilities, Cond, cfg_two_passes
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import (
    cast_as_loaded,
    freeze_on,
    image_size,
    latent_statistics,
    load_dtypes,
    vae_dtype,
)
from rlgen_cli.models.tiny import tiny_wan_pipeline
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME as LORA_WEIGHTS_NAME  # re-exported
from rlgen_cli.models.trainable import TRANSFORMER_DIR as TRANSFORMER_DIR  # re-exported
from rlgen_cli.models.trainable import DiffusersCheckpoint, TrainableTransformer, autocast
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal
from rlgen_cli.sde.schedule import shift_sigmas

log = logging.getLogger(__name__)

DEFAULT_PATH = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
WAN_LORA_TARGETS = [f"attn{i}.{proj}" for i in (1, 2) for proj in ("to_q", "to_k", "to_v", "to_out.0")]
NUM_TRAIN_TIMESTEPS = 1000


def wan_sigmas(num_steps: int, shift: float) -> Tensor:
    """WanPipeline's UniPC flow-sigma grid, (T+1,) fp32 from 1 down to a final 0.

    ``linspace(1, 1/1000, T + 1)[:-1]`` shifted by ``s·σ/(1 + (s − 1)·σ)`` (diffusers'
    ``UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=s)``), without UniPC's σ₀ = 1 − 1e-6 nudge.

    Args:
        num_steps: Denoising steps T ≥ 1.
        shift: Flow shift s > 0 (3.0 for Wan2.1 at 480p, 5.0 at 720p).

    Returns:
        Sigmas of shape (T + 1,), float32.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer ≥ 1, got {num_steps!r}; pass e.g. 20")
    base = torch.linspace(1.0, 1.0 / NUM_TRAIN_TIMESTEPS, num_steps + 1, dtype=torch.float64)[:-1]  # (T,)
    return torch.cat([shift_sigmas(base, shift), torch.zeros(1)])  # (T + 1,)


def wan_timestep(sigma: Tensor) -> Tensor:
    """The transformer's timestep at σ as WanPipeline feeds it: ⌊1000·σ⌋, at most 999 (fp32).

    UniPC hands the transformer its int64 timesteps ``int(1000·σ)``, with σ₀ = 1 nudged to 1 − 1e-6, so
    t₀ = 999; Flow-GRPO's Wan sampler feeds the same integers. σ arrives in fp32: the 1e-4 absorbs its
    rounding (≤ 6e-5 after × 1000), so σ = 0.7 gives 700 as the float64 grid does. Where 1000·σ lies
    within that rounding of an integer the two can differ by 1 (1 step in 2·10⁴ on the shift-3 grids).
    """
    steps = torch.floor(sigma.double() * NUM_TRAIN_TIMESTEPS + 1e-4)
    return steps.clamp(max=NUM_TRAIN_TIMESTEPS - 1).float()


def load_wan_pipeline(cfg: ModelConfig):  # -> diffusers.WanPipeline
    """Load a real Wan2.1 pipeline from ``cfg.path`` (hub id or local directory); the VAE stays fp32."""
    from diffusers import WanPipeline

    path = cfg.path or DEFAULT_PATH
    try:
        pipeline = WanPipeline.from_pretrained(
            path,
            torch_dtype=load_dtypes(cfg),
            local_files_only=cfg.local_files_only,
            revision=cfg.revision,
        )
    except (OSError, ValueError) as err:
        raise UserError(
            f"could not load a Wan pipeline from model.path={path!r}: {err}. Pass a local directory saved "
            "with save_pretrained, or a hub id with network access (model.local_files_only=false)"
        ) from err
    cast_as_loaded(
        pipeline.vae, vae_dtype(cfg, fp32_by_default=True)
    )  # fragile in bf16; upstream keeps it fp32
    _warn_on_shift_mismatch(pipeline, cfg.shift)
    return pipeline


def _warn_on_shift_mismatch(pipeline, shift: float) -> None:
    """Log when ``model.shift`` differs from the checkpoint scheduler's ``flow_shift`` (both are valid)."""
    shipped = pipeline.scheduler.config.get("flow_shift")
    if shipped is not None and float(shipped) != float(shift):
        log.warning(
            "model.shift=%s but the checkpoint's scheduler uses flow_shift=%s; sampling uses model.shift",
            shift,
            shipped,
        )


def check_geometry(cfg: ModelConfig, pipeline) -> None:
    """Refuse sizes Wan cannot represent exactly (WanPipeline rounds them silently)."""
    temporal, spatial = pipeline.vae_scale_factor_temporal, pipeline.vae_scale_factor_spatial
    _, patch_h, patch_w = pipeline.transformer.config.patch_size
    height, width = image_size(cfg)
    if height % (spatial * patch_h) or width % (spatial * patch_w):
        raise UserError(
            f"model.height×width={height}×{width} must be multiples of {spatial * patch_h}×{spatial * patch_w} "
            f"(VAE ×{spatial}, patch {patch_h}×{patch_w}); e.g. 240×416 for Wan2.1-T2V-1.3B"
        )
    if cfg.num_frames < 1 or (cfg.num_frames - 1) % temporal:
        raise UserError(
            f"model.num_frames={cfg.num_frames} must be {temporal}·k + 1 (the VAE compresses time ×{temporal} "
            f"after the first frame); e.g. 33 or 81"
        )


class WanPolicy:
    """Wan2.1 T2V behind the flow-policy protocol (see ``models/base.py`` and the module docstring)."""

    family = "wan2_1"

    def __init__(self, pipeline, cfg: ModelConfig, device: torch.device) -> None:
        check_geometry(cfg, pipeline)
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.guidance_scale = cfg.guidance_scale
        self.capabilities = Capabilities(has_cfg=cfg.guidance_scale > 1.0, is_video=True)
        freeze_on(pipeline, device, ("vae", "text_encoder"))  # the VAE keeps the loader's dtype
        self.pipeline = pipeline
        if cfg.lora.enabled:
            check_targets(
                pipeline.transformer,
                cfg.lora.target_modules,
                "WanTransformer3DModel (SD3's names do not apply)",
                "wan2_1",
            )
        # Checkpointing keeps 33-frame activations affordable during updates.
        self.trainable = TrainableTransformer(
            pipeline,
            cfg,
            checkpoint=DiffusersCheckpoint("WanPipeline", "WanTransformer3DModel"),
        )

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """UMT5 prompt embeddings (B, L, D) (+ the negative prompt's when guidance > 1)."""
        return Cond(umt5_text(self.pipeline, prompts, self.cfg, self.device))

    # -- sampling geometry --------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F', H', W') of one video latent."""
        return video_latent_shape(self.cfg, self.pipeline, self.transformer.config.in_channels)

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """Initial latents x_1 ~ N(0, I), fp32, (n, C, F', H', W'); one generator per sample or one for all."""
        return standard_normal(n, self.latent_shape(), generator, self.device)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """Wan's shifted flow sigmas (:func:`wan_sigmas` with ``model.shift``), (T+1,) ending at 0."""
        return wan_sigmas(num_steps, self.cfg.shift).to(self.device)

    # -- the one transformer call -------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) with CFG folded in; x (B, C, F', H', W') fp32, sigma 0-d or (B,); returns fp32 x-shaped."""
        timestep = wan_timestep(sigma.reshape(-1).expand(x.shape[0])).to(self.device)
        v_cond = self._forward(x, timestep, cond.tensors["prompt_embeds"])
        if self.guidance_scale <= 1.0:
            return v_cond
        unconditional = functools.partial(self._forward, x, timestep, cond.tensors["neg_prompt_embeds"])
        return cfg_two_passes(v_cond, unconditional, self.guidance_scale)

    def _forward(self, x: Tensor, timestep: Tensor, embeds: Tensor) -> Tensor:
        """One transformer pass in the model dtype; latents in and velocity out stay fp32 outside."""
        return wan_forward(self.trainable.forward_module, x, timestep, embeds, self.dtype)

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Latents (B, C, F', H', W') → videos (B, 3, F, H, W) in [0, 1], fp32.

        The Wan VAE decodes one latent frame at a time (causal caches), so a whole batch fits.
        """
        return decode_wan_latents(self.pipeline.vae, x0)


def umt5_text(pipeline, prompts: Sequence[str], cfg: ModelConfig, device: torch.device) -> dict[str, Tensor]:
    """WanPipeline's UMT5 prompt embeddings (B, L, D) in ``model.dtype``, and the negative prompt's
    (``neg_prompt_embeds``) when guidance > 1."""
    use_cfg = cfg.guidance_scale > 1.0
    embeds, neg_embeds = pipeline.encode_prompt(
        prompt=list(prompts),
        negative_prompt=[cfg.negative_prompt] * len(prompts) if use_cfg else None,
        do_classifier_free_guidance=use_cfg,
        max_sequence_length=cfg.max_sequence_length,
        device=device,
        dtype=TORCH_DTYPES[cfg.dtype],
    )
    return (
        {"prompt_embeds": embeds, "neg_prompt_embeds": neg_embeds} if use_cfg else {"prompt_embeds": embeds}
    )


def video_latent_shape(cfg: ModelConfig, pipeline, channels: int) -> tuple[int, int, int, int]:
    """(C, F', H', W') of one video latent with ``channels`` channels: F' = (F − 1)/t + 1, H', W' = H/s, W/s
    for the VAE's temporal and spatial factors t, s."""
    height, width = image_size(cfg)
    frames = (cfg.num_frames - 1) // pipeline.vae_scale_factor_temporal + 1
    spatial = pipeline.vae_scale_factor_spatial
    return (channels, frames, height // spatial, width // spatial)


def wan_forward(
    module: Callable[[], nn.Module], x: Tensor, timestep: Tensor, embeds: Tensor, dtype: torch.dtype
) -> Tensor:
    """One pass of the Wan transformer ``module()`` (asked per pass: DDP-wrapped only with grad) in ``dtype``;
    latents (with any I2V condition channels) in and velocity out stay fp32 outside."""
    with autocast(timestep.device, dtype):
        out = module()(
            hidden_states=x.to(dtype),
            timestep=timestep,
            encoder_hidden_states=embeds.to(dtype),
            return_dict=False,
        )[0]
    return out.float()


@torch.no_grad()
def decode_wan_latents(vae, x0: Tensor) -> Tensor:
    """Normalised latents (B, C, F', H', W') → videos (B, 3, F, H, W) in [0, 1], fp32."""
    mean, std = latent_statistics(vae, x0.device)  # x = (z − mean) / std
    latents = x0.float() * std + mean  # WanPipeline: x / (1/std) + mean
    videos = vae.decode(latents.to(vae.dtype), return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
    return (videos.float() / 2 + 0.5).clamp(0, 1)


def check_targets(transformer: nn.Module, targets: Sequence[str], layers: str, family: str) -> None:
    """Fail early, with the family's own target names, when no LoRA target names a Linear of the
    transformer (``layers`` names it in the error)."""
    names = [n for n, m in transformer.named_modules() if isinstance(m, nn.Linear)]
    if not any(n == t or n.endswith(f".{t}") for n in names for t in targets):
        raise UserError(
            f"model.lora.target_modules={list(targets)} matches no layer of {layers}; use "
            f"model={family}'s targets: {WAN_LORA_TARGETS}"
        )


def build(cfg: ModelConfig, device: torch.device) -> WanPolicy:
    """The registry's entry point: random-init, tiny or loaded pipeline (``models/building.py``), the VAE in
    fp32 as :func:`load_wan_pipeline` keeps it."""
    tiny = functools.partial(tiny_wan_pipeline, max_sequence_length=cfg.max_sequence_length)
    pipeline = family_pipeline(cfg, device, tiny, load_wan_pipeline, keep_fp32=("vae",))
    return with_prompt_cache(WanPolicy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
