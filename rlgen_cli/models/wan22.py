"""Wan2.2 A14B behind the flow-policy protocol: two expert transformers switched by timestep (families
``wan2_2``, text-to-video, and ``wan2_2_i2v``, image-to-video).

Wan2.2 A14B splits denoising between a high-noise expert (``transformer``) and a low-noise expert
(``transformer_2``): WanPipeline runs the first while the integer timestep t = ⌊1000·σ⌋ is at least
``boundary_ratio``·1000 (0.875 for T2V, 0.9 for I2V) and the second below it. :meth:`Wan22Policy.velocity`
makes the same choice from the σ it is given, per sample, so a rollout, an SDE window straddling the
boundary and the recomputed log-probs all run the expert the pipeline would (the on-policy ratio stays
exactly 1 across the switch). Each expert takes its own CFG scale: ``model.guidance_scale`` (high noise)
and ``model.experts.guidance_scale_2`` (low noise; null = the same), with WanPipeline's rule that the
negative branch runs only when ``model.guidance_scale`` > 1.

Training: ``model.experts.train`` = ``both`` (LoRA, or full FT, on each expert), ``high_noise`` or
``low_noise`` (the other expert frozen in ``model.dtype``; its steps still shape the trajectory but give
no gradient). Checkpoints hold one directory per trained expert, ``high_noise/`` and ``low_noise/``, each
in the format ``WanPipeline.load_lora_weights`` reads (the low-noise one with ``load_into_transformer_2=True``).

Everything else is Wan2.1's (``models/wan.py``): the UniPC flow-sigma grid with ``model.shift``, the
integer timesteps, the fp32 VAE, the geometry checks and the LoRA targets (both experts share the
Wan2.1 block layout).

I2V: ``encode(prompts, images)`` takes the first frames (B, 3, H, W) in [0, 1] at the model resolution
and builds WanImageToVideoPipeline's conditioning: the first-frame mask (4 channels: 1 on the first
latent frame) and the VAE latent (mode) of the first frame followed by black frames, concatenated to the
noisy latent on the channel axis at every transformer call. Wan2.2's I2V experts take no CLIP image
embedding.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models.acceleration import prepare_frozen_transformer
from rlgen_cli.models.base import TORCH_DTYPES, Capabilities, Cond, cfg_two_passes
from rlgen_cli.models.building import family_pipeline, with_prompt_cache
from rlgen_cli.models.loading import cast_as_loaded, freeze_on, frozen_dtype, load_pipeline, vae_dtype
from rlgen_cli.models.tiny.wan22 import tiny_wan22_pipeline
from rlgen_cli.models.trainable import DiffusersCheckpoint, TrainableTransformer
from rlgen_cli.models.wan import (
    NUM_TRAIN_TIMESTEPS,
    check_geometry,
    check_targets,
    decode_wan_latents,
    latent_statistics,
    umt5_text,
    video_latent_shape,
    wan_forward,
    wan_sigmas,
    wan_timestep,
)
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal

__all__ = ["EXPERTS", "ExpertPair", "Wan22Policy", "build", "load_wan22_pipeline"]

T2V_PATH, I2V_PATH = "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "Wan-AI/Wan2.2-I2V-A14B-Diffusers"
EXPERTS = ("high_noise", "low_noise")
"""Expert names, in the pipeline's order: ``transformer`` then ``transformer_2``."""
_ATTRIBUTES = {"high_noise": "transformer", "low_noise": "transformer_2"}


def load_wan22_pipeline(cfg: ModelConfig, image_to_video: bool):  # -> WanPipeline | WanImageToVideoPipeline
    """Load a Wan2.2 A14B pipeline from ``cfg.path``; the VAE stays fp32 (as Wan2.1's)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    pipeline_cls = WanImageToVideoPipeline if image_to_video else WanPipeline
    pipeline = load_pipeline(pipeline_cls, cfg, "Wan2.2")
    cast_as_loaded(pipeline.vae, vae_dtype(cfg, fp32_by_default=True))
    return pipeline


def check_two_experts(pipeline, path: str | None) -> None:
    """Refuse a pipeline without the second expert or the boundary that switches to it."""
    parts = (pipeline.transformer, pipeline.transformer_2, pipeline.config.boundary_ratio)
    if any(part is None for part in parts):
        raise UserError(
            f"model.path={path!r} is not a two-expert Wan2.2 A14B pipeline (it needs transformer, transformer_2 "
            f"and boundary_ratio); use e.g. {T2V_PATH}, or model=wan2_1 for a one-transformer Wan"
        )


class _Slot:
    """The holder of one expert: ``TrainableTransformer`` trains ``slot.transformer`` and swaps it for a
    frozen copy in a full-FT ``reference()``; the policy always calls the slot's current module."""

    def __init__(self, transformer: nn.Module) -> None:
        self.transformer = transformer


class FrozenExpert:
    """An expert that is not trained: weights in ``model.frozen_dtype`` as loaded, no gradient, eval mode."""

    def __init__(self, transformer: nn.Module, dtype: torch.dtype) -> None:
        cast_as_loaded(transformer, dtype)
        self.module = transformer.requires_grad_(False).eval()

    def forward_module(self) -> nn.Module:
        return self.module


class ExpertPair:
    """The :class:`~rlgen_cli.models.base.Trainable` of a two-expert Wan: one ``TrainableTransformer`` per
    trained expert (``model.experts.train``), the other a :class:`FrozenExpert`."""

    def __init__(self, pipeline, cfg: ModelConfig) -> None:
        trained = EXPERTS if cfg.experts.train == "both" else (cfg.experts.train,)
        self.experts: dict[str, TrainableTransformer | FrozenExpert] = {}
        for name in EXPERTS:
            transformer = getattr(pipeline, _ATTRIBUTES[name])
            if name in trained:
                self.experts[name] = TrainableTransformer(
                    _Slot(transformer),
                    cfg,
                    checkpoint=DiffusersCheckpoint(type(pipeline).__name__, "WanTransformer3DModel"),
                )
            else:
                self.experts[name] = FrozenExpert(transformer, frozen_dtype(cfg))
                prepare_frozen_transformer(transformer, cfg)  # the trained expert's attention and compile
        self.trained = {n: e for n, e in self.experts.items() if isinstance(e, TrainableTransformer)}

    @property
    def module(self) -> nn.Module:
        """The trained experts by name (the frozen full-FT copies while ``reference()`` is active)."""
        return nn.ModuleDict({name: expert.module for name, expert in self.trained.items()})

    def parameters(self) -> list[nn.Parameter]:
        return [p for expert in self.trained.values() for p in expert.parameters()]

    def named(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, expert in self.trained.items():
            for param_name, param in expert.named():
                yield f"{name}.{param_name}", param

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Both experts as the frozen reference (adapters off, or the full-FT copies)."""
        with contextlib.ExitStack() as stack:
            for expert in self.trained.values():
                stack.enter_context(expert.reference())
            yield

    def save(self, directory: Path) -> None:
        """One sub-directory per trained expert (``high_noise/``, ``low_noise/``) in the diffusers format."""
        for name, expert in self.trained.items():
            expert.save(Path(directory) / name)

    def load(self, directory: Path) -> None:
        for name, expert in self.trained.items():
            expert.load(Path(directory) / name)

    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        for expert in self.trained.values():
            expert.distribute(wrap)

    def forward_module(self, name: str) -> nn.Module:
        """The module to call for expert ``name`` (its DDP wrapper when training)."""
        return self.experts[name].forward_module()


class Wan22Policy:
    """Wan2.2 A14B (T2V or I2V) behind the flow-policy protocol (see the module docstring)."""

    def __init__(self, pipeline, cfg: ModelConfig, device: torch.device) -> None:
        from diffusers import WanImageToVideoPipeline

        check_two_experts(pipeline, cfg.path)
        check_geometry(cfg, pipeline)
        self.image_to_video = isinstance(pipeline, WanImageToVideoPipeline)
        self.family = "wan2_2_i2v" if self.image_to_video else "wan2_2"
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.guidance_scale = cfg.guidance_scale
        _check_guidance(cfg)
        self.boundary_timestep = pipeline.config.boundary_ratio * NUM_TRAIN_TIMESTEPS
        self.capabilities = Capabilities(
            takes_source_images=self.image_to_video, has_cfg=cfg.guidance_scale > 1.0, is_video=True
        )
        freeze_on(pipeline, device, ("vae", "text_encoder"))  # the VAE keeps the loader's dtype
        self.pipeline = pipeline
        self._text = _text_pipeline(pipeline)
        if cfg.lora.enabled:
            check_targets(pipeline.transformer, cfg.lora.target_modules, "the Wan2.2 experts", "wan2_2")
        self.trainable = ExpertPair(pipeline, cfg)

    @property
    def guidance_scale_2(self) -> float:
        """The low-noise expert's CFG scale (WanPipeline: ``guidance_scale`` when not given)."""
        explicit = self.cfg.experts.guidance_scale_2
        return self.guidance_scale if explicit is None else explicit

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """UMT5 prompt embeddings (B, L, D) (+ the negative prompt's when guidance > 1); for I2V also the
        first-frame conditioning (B, 4 + C, F', H', W') fp32 from ``images`` (B, 3, H, W) in [0, 1]."""
        if self.image_to_video and images is None:
            raise UserError("Wan2.2 I2V animates a first frame: pass one source image per prompt")
        tensors = umt5_text(self._text, prompts, self.cfg, self.device)
        if images is not None:
            tensors["image_condition"] = self._first_frame_condition(images)
        return Cond(tensors)

    def _first_frame_condition(self, images: Tensor) -> Tensor:
        """WanImageToVideoPipeline's ``condition``: [mask (B, 4, F', H', W'), latent (B, C, F', H', W')]."""
        cfg, vae = self.cfg, self.pipeline.vae
        _, frames, height, width = self.latent_shape()
        if images.shape[-2:] != (cfg.height or cfg.resolution, cfg.width or cfg.resolution):
            raise UserError(
                f"source images are {tuple(images.shape[-2:])} but the model samples "
                f"{cfg.height or cfg.resolution}×{cfg.width or cfg.resolution}: resize them first"
            )
        first = images.to(self.device, torch.float32) * 2 - 1  # [0, 1] → the VAE's [-1, 1]
        black = first.new_zeros(first.shape[0], 3, cfg.num_frames - 1, *first.shape[-2:])
        video = torch.cat([first.unsqueeze(2), black], dim=2)  # (B, 3, F, H, W)
        latent = vae.encode(video.to(vae.dtype)).latent_dist.mode().float()
        mean, std = latent_statistics(vae, self.device)
        mask = latent.new_zeros(len(latent), self.pipeline.vae_scale_factor_temporal, frames, height, width)
        mask[:, :, 0] = 1  # the first latent frame is given
        return torch.cat([mask, (latent - mean) / std], dim=1)

    # -- sampling geometry --------------------------------------------------------------------
    def latent_shape(self) -> tuple[int, int, int, int]:
        """(C, F', H', W') of one video latent."""
        return video_latent_shape(self.cfg, self.pipeline, self.pipeline.vae.config.z_dim)

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """Initial latents x_1 ~ N(0, I), fp32, (n, C, F', H', W'); one generator per sample or one for all."""
        return standard_normal(n, self.latent_shape(), generator, self.device)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """Wan's shifted flow sigmas (``models/wan.py: wan_sigmas`` with ``model.shift``), (T+1,)."""
        return wan_sigmas(num_steps, self.cfg.shift).to(self.device)

    # -- the one transformer call -------------------------------------------------------------
    def expert_at(self, timestep: Tensor) -> Tensor:
        """True where the high-noise expert runs: t ≥ boundary_ratio·1000, as WanPipeline decides."""
        return timestep >= self.boundary_timestep

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) from the expert of each sample's timestep, CFG folded in; x (B, C, F', H', W') fp32,
        sigma 0-d or (B,); returns fp32 x-shaped."""
        timestep = wan_timestep(sigma.reshape(-1).expand(x.shape[0])).to(self.device)
        high = self.expert_at(timestep)
        if high.all() or not high.any():  # one expert for the whole batch (every sampling step)
            return self._expert_velocity(EXPERTS[0] if high.all() else EXPERTS[1], x, timestep, cond)
        v = x.new_empty(x.shape, dtype=torch.float32)  # per-sample σ on both sides (e.g. DPO, NFT)
        for name, rows in ((EXPERTS[0], high), (EXPERTS[1], ~high)):
            v[rows] = self._expert_velocity(name, x[rows], timestep[rows], cond.index(rows))
        return v

    def _expert_velocity(self, name: str, x: Tensor, timestep: Tensor, cond: Cond) -> Tensor:
        image = cond.tensors.get("image_condition")
        inputs = x if image is None else torch.cat([x, image], dim=1)  # I2V: latent, mask, first frame
        module = functools.partial(self.trainable.forward_module, name)
        forward = functools.partial(wan_forward, module, inputs, timestep, dtype=self.dtype)
        v_cond = forward(cond.tensors["prompt_embeds"])
        if self.guidance_scale <= 1.0:
            return v_cond
        scale = self.guidance_scale if name == EXPERTS[0] else self.guidance_scale_2
        return cfg_two_passes(v_cond, functools.partial(forward, cond.tensors["neg_prompt_embeds"]), scale)

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Latents (B, C, F', H', W') → videos (B, 3, F, H, W) in [0, 1], fp32."""
        return decode_wan_latents(self.pipeline.vae, x0)


def _text_pipeline(pipeline):  # -> WanPipeline
    """The pipeline whose ``encode_prompt`` the policy calls: ``pipeline`` itself for T2V; for I2V a
    ``WanPipeline`` over the same tokenizer and text encoder. Both compute the same UMT5 embeddings, but
    the I2V pipeline's prompt cleaning calls ``ftfy`` unconditionally, where WanPipeline uses it when
    installed."""
    from diffusers import WanPipeline

    if isinstance(pipeline, WanPipeline):
        return pipeline
    return WanPipeline(
        tokenizer=pipeline.tokenizer,
        text_encoder=pipeline.text_encoder,
        transformer=None,
        vae=None,
        scheduler=pipeline.scheduler,
    )


def _check_guidance(cfg: ModelConfig) -> None:
    """WanPipeline runs the negative branch only when ``guidance_scale`` > 1: a low-noise scale alone would
    be silently ignored there, so it is refused here."""
    scale_2 = cfg.experts.guidance_scale_2
    if scale_2 is not None and scale_2 > 1.0 and cfg.guidance_scale <= 1.0:
        raise UserError(
            f"model.experts.guidance_scale_2={scale_2} needs CFG on: set model.guidance_scale > 1 too "
            "(the negative branch runs only when it is > 1), or model.experts.guidance_scale_2=null"
        )


def build(cfg: ModelConfig, device: torch.device) -> Wan22Policy:
    """The registry's entry point for ``wan2_2`` and ``wan2_2_i2v``: tiny or loaded pipeline
    (``models/building.py``), the VAE in fp32 as :func:`load_wan22_pipeline` keeps it."""
    image_to_video = cfg.family == "wan2_2_i2v"
    tiny = functools.partial(
        tiny_wan22_pipeline, max_sequence_length=cfg.max_sequence_length, image_to_video=image_to_video
    )
    load = functools.partial(load_wan22_pipeline, image_to_video=image_to_video)
    pipeline = family_pipeline(cfg, device, tiny, load, keep_fp32=("vae",))
    return with_prompt_cache(Wan22Policy(pipeline, cfg, device), cfg, (pipeline.text_encoder,))
