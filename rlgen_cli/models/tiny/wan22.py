"""Tiny Wan2.2 A14B pipelines: two expert transformers switched at ``boundary_ratio``, text-to-video and
image-to-video, real diffusers classes with random weights deterministic in ``seed``."""

from __future__ import annotations

from typing import Any

import torch

from rlgen_cli.models.tokenizers import tiny_t5_tokenizer, vocab_size

TINY_BOUNDARY_RATIO = 0.875
"""Wan2.2-T2V-A14B's boundary; on the tiny 4-step shift-3 grid (timesteps 999, 900, 750, 500) the
high-noise expert takes the first two steps and the low-noise expert the last two."""
LATENT_CHANNELS = 16
I2V_CONDITION_CHANNELS = 4 + LATENT_CHANNELS
"""I2V inputs add the 4-channel first-frame mask and the encoded conditioning video to the latent."""


def _tiny_expert(in_channels: int) -> Any:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=LATENT_CHANNELS,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def tiny_wan22_pipeline(
    seed: int = 0,
    max_sequence_length: int = 32,
    *,
    image_to_video: bool = False,
    boundary_ratio: float = TINY_BOUNDARY_RATIO,
) -> Any:
    """A tiny Wan2.2 A14B ``WanPipeline`` (or ``WanImageToVideoPipeline`` when ``image_to_video``).

    The two experts (``transformer``: high noise, ``transformer_2``: low noise) share the tiny Wan2.1
    sizes but hold different random weights; the VAE keeps Wan's ×4 time / ×8 space compression, so 5
    frames of 32×48 pixels are a (16, 2, 4, 6) latent. The I2V experts take 36 input channels (latent,
    first-frame mask, conditioning latent) and, like Wan2.2's, no CLIP image embedding.
    """
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_t5_tokenizer(max_sequence_length)
    in_channels = LATENT_CHANNELS + (I2V_CONDITION_CHANNELS if image_to_video else 0)
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
        high_noise, low_noise = _tiny_expert(in_channels), _tiny_expert(in_channels)
        vae = AutoencoderKLWan(
            base_dim=3,
            z_dim=LATENT_CHANNELS,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            scale_factor_temporal=4,
            scale_factor_spatial=8,
        )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )
    parts = dict(
        tokenizer=tokenizer, text_encoder=text_encoder, transformer=high_noise, transformer_2=low_noise,
        vae=vae, scheduler=scheduler, boundary_ratio=boundary_ratio,
    )  # fmt: skip
    if image_to_video:
        return WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None)
    return WanPipeline(**parts)
