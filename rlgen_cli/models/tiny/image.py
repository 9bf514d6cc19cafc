"""Tiny flow-family pipelines and the ShapesEval UNet: real diffusers classes, scaled-down configs,
random weights deterministic in ``seed``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from rlgen_cli.models.tiny.vlm import tiny_qwen_tokenizer, tiny_vlm, tiny_vlm_processor
from rlgen_cli.models.tokenizers import tiny_clip_tokenizer, tiny_t5_tokenizer, vocab_size

log = logging.getLogger(__name__)


# -- SD3 ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SD3Sizes:
    """The sizes of a tiny SD3 pipeline. The defaults are diffusers' own test sizes: 4×32×32 latents and
    a VAE that does not downsample, so images are 32×32; larger geometries (the benchmarks') override."""

    clip_intermediate_size: int = 37
    t5_d_kv: int = 8
    t5_d_ff: int = 37
    patch_size: int = 1
    num_layers: int = 1
    attention_head_dim: int = 8
    caption_projection_dim: int = 32
    vae_sample_size: int = 32
    vae_block_out_channels: tuple[int, ...] = (4,)
    """One VAE level per entry: each level after the first halves the image side."""
    vae_norm_groups: int = 1


def tiny_sd3_pipeline(seed: int = 0, *, sizes: SD3Sizes = SD3Sizes()) -> Any:
    """A tiny ``StableDiffusion3Pipeline`` of ``sizes``, deterministic in ``seed``."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tok, t5_tok = tiny_clip_tokenizer(77), tiny_t5_tokenizer(512)
    levels = len(sizes.vae_block_out_channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip_config = CLIPTextConfig(
            vocab_size=vocab_size(clip_tok),
            hidden_size=32,
            intermediate_size=sizes.clip_intermediate_size,
            num_attention_heads=4,
            num_hidden_layers=2,
            projection_dim=32,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_act="gelu",
        )
        t5_config = T5Config(
            vocab_size=vocab_size(t5_tok),
            d_model=64,
            d_kv=sizes.t5_d_kv,
            d_ff=sizes.t5_d_ff,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
        transformer = SD3Transformer2DModel(
            sample_size=32,
            patch_size=sizes.patch_size,
            in_channels=4,
            num_layers=sizes.num_layers,
            attention_head_dim=sizes.attention_head_dim,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=sizes.caption_projection_dim,
            pooled_projection_dim=64,
            out_channels=4,
        )
        vae = AutoencoderKL(
            sample_size=sizes.vae_sample_size,
            in_channels=3,
            out_channels=3,
            block_out_channels=sizes.vae_block_out_channels,
            down_block_types=("DownEncoderBlock2D",) * levels,
            up_block_types=("UpDecoderBlock2D",) * levels,
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=sizes.vae_norm_groups,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
        encoders = {
            "text_encoder": CLIPTextModelWithProjection(clip_config),
            "text_encoder_2": CLIPTextModelWithProjection(clip_config),
            "text_encoder_3": T5EncoderModel(t5_config),
        }
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer,
        vae=vae,
        tokenizer=clip_tok,
        tokenizer_2=tiny_clip_tokenizer(77),
        tokenizer_3=t5_tok,
        **encoders,
    )


# -- FLUX.1 / FLUX.1-Kontext ----------------------------------------------------------------------
def tiny_flux_components(seed: int = 0) -> dict[str, Any]:
    """The modules of a tiny FLUX pipeline (diffusers' test-suite transformer), deterministic in ``seed``.

    The VAE has two levels (scale factor 2) and 2 latent channels, so the transformer's ``in_channels``
    8 is 4·latent_channels (2×2 packing); a 32 px image is a 16×16 latent and 64 image tokens.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = tiny_clip_tokenizer(77), tiny_t5_tokenizer(512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip_config = CLIPTextConfig(
            vocab_size=vocab_size(clip_tok),
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            projection_dim=32,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_act="gelu",
        )
        t5_config = T5Config(
            vocab_size=vocab_size(t5_tok),
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=8,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8],
            guidance_embeds=True,
        )
        vae = AutoencoderKL(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            block_out_channels=(4, 4),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            layers_per_block=1,
            latent_channels=2,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        )
        text_encoder, text_encoder_2 = CLIPTextModel(clip_config), T5EncoderModel(t5_config)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        base_shift=0.5,
        max_shift=1.15,
    )
    return {
        "scheduler": scheduler,
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": clip_tok,
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": t5_tok,
        "transformer": transformer,
    }


def tiny_flux_pipeline(seed: int = 0) -> Any:
    """A tiny ``FluxPipeline`` (≈ 0.1 M-parameter transformer, 32 px images), deterministic in ``seed``."""
    from diffusers import FluxPipeline

    return FluxPipeline(**tiny_flux_components(seed))


def tiny_flux_kontext_pipeline(seed: int = 0) -> Any:
    """A tiny ``FluxKontextPipeline`` (the tiny FLUX modules), deterministic in ``seed``."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**tiny_flux_components(seed))


# -- Qwen-Image / Qwen-Image-Edit -----------------------------------------------------------------
QWEN_SCHEDULER = dict(
    base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5, max_shift=0.9, shift=1.0,
    shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential",
)  # fmt: skip
"""The scheduler config Qwen/Qwen-Image ships."""


def template_tokenizer(template: str, drop_idx: int) -> Any:
    """:func:`tiny_qwen_tokenizer`, plus added tokens that make the pipeline's template prefix (through
    ``user\\n``) exactly ``drop_idx`` tokens long, as with the real tokenizer.

    The pipeline drops its first ``drop_idx`` hidden states; with one token per byte it would keep most of
    the system prompt (≈ 120 tokens). Cutting the system text into ``drop_idx − 9`` added pieces makes the
    kept tokens start at the user's prompt, as for the real model, and keeps the tiny sequences short.
    """
    from tokenizers import AddedToken

    tokenizer = tiny_qwen_tokenizer()
    head = template[: template.index("user\n") + len("user\n")]
    system = head[len("<|im_start|>") : head.index("<|im_end|>")]
    pieces = drop_idx - len(tokenizer(head.replace(system, "")).input_ids)
    bounds = [round(i * len(system) / pieces) for i in range(pieces + 1)]
    chunks = [system[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    tokenizer.add_tokens([AddedToken(c, normalized=False, special=False) for c in chunks])
    if len(tokenizer(head).input_ids) != drop_idx:
        raise RuntimeError(f"the tiny tokenizer splits the template prefix into other than {drop_idx} tokens")
    return tokenizer


def tiny_qwen_pipeline(pipeline_cls: type, seed: int = 0) -> Any:
    """A tiny ``pipeline_cls`` (``QwenImagePipeline`` or ``QwenImageEditPipeline``), deterministic in ``seed``.

    The Qwen2.5-VL encoder (hidden 32) and 4-px-patch processor are :func:`tiny_vlm`'s, with the
    tokenizer of :func:`template_tokenizer`; the VAE has z_dim 4 and scale factor 4, so a 32 px image is
    an 8×8 latent: 16 packed tokens of 16 channels (the transformer's ``in_channels``).
    """
    import inspect

    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
        vae = AutoencoderKLQwenImage(
            base_dim=4,
            z_dim=4,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.8, 1.2, 1.0],
        )
        parts = {"scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), "vae": vae,
                 "transformer": transformer, "text_encoder": None, "tokenizer": None}  # fmt: skip
        if "processor" in inspect.signature(pipeline_cls.__init__).parameters:
            parts["processor"] = None
        probe = pipeline_cls(**parts)  # only to read its prompt template
        processor = tiny_vlm_processor(max_pixels=32 * 32)
        processor.tokenizer = template_tokenizer(
            probe.prompt_template_encode, probe.prompt_template_encode_start_idx
        )
        parts |= {
            "tokenizer": processor.tokenizer,
            "text_encoder": tiny_vlm(processor, hidden_size=32, seed=seed),
        }
    if "processor" in parts:
        parts["processor"] = processor
    return pipeline_cls(**parts)


def tiny_qwen_image_pipeline(seed: int = 0) -> Any:
    """A tiny ``QwenImagePipeline`` (32 px images, 8×8×4 latents), deterministic in ``seed``."""
    from diffusers import QwenImagePipeline

    return tiny_qwen_pipeline(QwenImagePipeline, seed)


def tiny_qwen_image_edit_pipeline(seed: int = 0) -> Any:
    """A tiny ``QwenImageEditPipeline`` (32 px images; the VL processor sees ≤ 32×32 px), from ``seed``."""
    from diffusers import QwenImageEditPipeline

    return tiny_qwen_pipeline(QwenImageEditPipeline, seed)


# -- Wan2.1 ---------------------------------------------------------------------------------------
def tiny_wan_pipeline(seed: int = 0, max_sequence_length: int = 32) -> Any:
    """A tiny Wan2.1 pipeline (diffusers' own test sizes), deterministic in ``seed``.

    The VAE keeps Wan's compression (×4 in time, ×8 in space, 16 latent channels), so 5 frames of 32×48
    pixels are a (16, 2, 4, 6) latent; the transformer has 2 blocks of width 24.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_t5_tokenizer(max_sequence_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_config = UMT5Config(
            vocab_size=vocab_size(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
        text_encoder = UMT5EncoderModel(text_config)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
        vae = AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            scale_factor_temporal=4,
            scale_factor_spatial=8,
        )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
    )
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae, scheduler=scheduler
    )


# -- ShapesEval -----------------------------------------------------------------------------------
def tiny_shapes_unet(seed: int = 0) -> Any:
    """The ShapesEval UNet (default sizes) with random weights, deterministic in ``seed``."""
    from rlgen_cli.models.shapes_unet import ShapesUNet

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ShapesUNet()
