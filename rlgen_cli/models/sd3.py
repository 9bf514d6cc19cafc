"""Stable Diffusion 3 / 3.5 behind the flow-policy protocol.

Real weights load through ``StableDiffusion3Pipeline.from_pretrained`` (hub id or local directory,
``local_files_only`` honoured); ``tiny_sd3_pipeline`` builds the same classes from tiny configs with
random weights and offline tokenizers. LoRA follows Flow-GRPO (r 32, α 64, attention projections,
gaussian init) and is saved in the format ``StableDiffusion3Pipeline.load_lora_weights`` reads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from rlgen_cli.models.base import TORCH_DTYPES, Cond, cfg_combine, uncond_takes_grad
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.models.prompt_cache import PromptCache
from rlgen_cli.models.tokenizers import tiny_clip_tokenizer, tiny_t5_tokenizer, vocab_size
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME as LORA_WEIGHTS_NAME  # re-exported
from rlgen_cli.models.trainable import TRANSFORMER_DIR as TRANSFORMER_DIR  # re-exported
from rlgen_cli.models.trainable import TrainableTransformer, autocast
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import ModelConfig
from rlgen_cli.sde.noise import randn_per_sample
from rlgen_cli.sde.schedule import sd3_sigmas

log = logging.getLogger(__name__)


def tiny_sd3_pipeline(seed: int = 0, max_sequence_length: int = 32):
    """A tiny SD3 pipeline (diffusers' own test sizes), deterministic in ``seed``.

    Latents are 4×32×32 and the VAE does not downsample, so images are 32×32.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tok, t5_tok = tiny_clip_tokenizer(77), tiny_t5_tokenizer(512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip_config = CLIPTextConfig(
            vocab_size=vocab_size(clip_tok), hidden_size=32, intermediate_size=37, num_attention_heads=4,
            num_hidden_layers=2, projection_dim=32, max_position_embeddings=77,
            bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_act="gelu",
        )  # fmt: skip
        t5_config = T5Config(
            vocab_size=vocab_size(t5_tok), d_model=64, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, decoder_start_token_id=0,
        )  # fmt: skip
        components = {
            "transformer": SD3Transformer2DModel(
                sample_size=32,
                patch_size=1,
                in_channels=4,
                num_layers=1,
                attention_head_dim=8,
                num_attention_heads=4,
                joint_attention_dim=64,
                caption_projection_dim=32,
                pooled_projection_dim=64,
                out_channels=4,
            ),  # fmt: skip
            "vae": AutoencoderKL(
                sample_size=32,
                in_channels=3,
                out_channels=3,
                block_out_channels=(4,),
                layers_per_block=1,
                latent_channels=4,
                norm_num_groups=1,
                use_quant_conv=False,
                use_post_quant_conv=False,
                shift_factor=0.0609,
                scaling_factor=1.5035,
            ),  # fmt: skip
            "text_encoder": CLIPTextModelWithProjection(clip_config),
            "text_encoder_2": CLIPTextModelWithProjection(clip_config),
            "text_encoder_3": T5EncoderModel(t5_config),
        }
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        tokenizer=clip_tok,
        tokenizer_2=tiny_clip_tokenizer(77),
        tokenizer_3=t5_tok,
        **components,
    )


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
    takes_source_images = False

    def __init__(self, pipeline, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.guidance_scale = cfg.guidance_scale
        self._negatives = PromptCache(int(cfg.prompt_cache_mb * 2**20)) if cfg.prompt_cache_mb > 0 else None
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for part in (pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3):
            if part is not None:
                part.requires_grad_(False).eval()
        self.pipeline = pipeline
        self._train = TrainableTransformer(
            pipeline, cfg, pipeline_class="StableDiffusion3Pipeline", transformer_class="SD3Transformer2DModel",
            exclude=dead_context_queries(pipeline.transformer) if cfg.lora.enabled else (),
        )  # fmt: skip

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Route gradient-carrying forwards through ``wrap(transformer)`` (DDP: averaged gradients)."""
        self._train.distribute(wrap)

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning (+ the negative branch when guidance > 1); ``images`` are not used by SD3."""
        if images is not None:
            raise UserError("SD3 is a text-to-image model: it takes no reference images")
        tensors = self._encode_text(prompts).tensors
        if self.guidance_scale > 1.0:
            negative = self._negative(len(prompts)).tensors
            tensors |= {"neg_prompt_embeds": negative["prompt_embeds"], "neg_pooled": negative["pooled"]}
        return Cond(tensors)

    def _encode_text(self, prompts: Sequence[str]) -> Cond:
        """The pipeline's prompt embeddings (B, L, D) and pooled embeddings (B, D') of ``prompts``; the
        pipeline encodes a negative prompt with these same calls."""
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.cfg.max_sequence_length,
        )  # fmt: skip
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
        if generator is None or isinstance(generator, torch.Generator):
            return torch.randn((n, *self.latent_shape()), generator=generator, device=self.device)
        return randn_per_sample(self.latent_shape(), generator[:n], self.device)

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
            torch.cat([x, x]), torch.cat([timestep, timestep]), torch.cat([neg_embeds, embeds]),
            torch.cat([neg_pooled, pooled]),
        )  # fmt: skip
        uncond, cond_v = out.chunk(2)
        return cfg_combine(uncond, cond_v, self.guidance_scale)

    def _forward(self, x: Tensor, timestep: Tensor, embeds: Tensor, pooled: Tensor) -> Tensor:
        """One transformer pass in the model dtype; latents in and velocity out stay fp32 outside."""
        with autocast(self.device, self.dtype):
            return self._train.forward_module()(
                hidden_states=x.to(self.dtype), timestep=timestep, encoder_hidden_states=embeds,
                pooled_projections=pooled, return_dict=False,
            )[0].float()  # fmt: skip

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Latents (B, C, h, w) → images (B, 3, H, W) in [0, 1], fp32."""
        vae = self.pipeline.vae
        latents = x0 / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    # -- training surface (delegated to the shared component) ---------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return self._train.parameters

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Within this context ``velocity`` runs the frozen reference (LoRA disabled or a frozen copy)."""
        return self._train.reference()

    def save_trainable(self, directory: Path) -> None:
        """LoRA → ``pytorch_lora_weights.safetensors`` (diffusers format); full FT → ``transformer/``."""
        self._train.save(directory)

    def load_trainable(self, directory: Path) -> None:
        """Load what ``save_trainable`` wrote into the live modules (shapes must match)."""
        self._train.load(directory)

    def named_trainable(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self._train.named_trainable()


def build(cfg: ModelConfig, device: torch.device) -> SD3Policy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, else the loaded one."""
    pipeline = (
        in_model_dtype(tiny_sd3_pipeline(cfg.tiny_seed, cfg.max_sequence_length), cfg)
        if cfg.tiny
        else load_sd3_pipeline(cfg)
    )
    return SD3Policy(pipeline, cfg, device)
