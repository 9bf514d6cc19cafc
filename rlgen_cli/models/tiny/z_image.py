"""Tiny Z-Image: the real diffusers / transformers classes (``ZImagePipeline``, a Qwen3 text encoder),
scaled-down configs, random weights deterministic in ``seed``, an offline byte-level tokenizer."""

from __future__ import annotations

from typing import Any

import torch

from rlgen_cli.models.tiny.vlm import CHAT_TEMPLATE, SPECIAL_TOKENS, tiny_qwen_tokenizer

Z_IMAGE_TURBO_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
"""The scheduler config Tongyi-MAI/Z-Image-Turbo ships (a static shift)."""


def tiny_z_image_tokenizer() -> Any:
    """The byte-level Qwen tokenizer with a chat template (Z-Image wraps each prompt in a user turn)."""
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3_encoder(tokenizer: Any, hidden_size: int = 32, seed: int = 0) -> Any:
    """A random 2-layer ``Qwen3Model`` (4 heads, 2 KV heads) over ``tokenizer``'s vocabulary."""
    from transformers import Qwen3Config, Qwen3Model

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=1024,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3Model(config).eval()


def tiny_z_image_pipeline(seed: int = 0) -> Any:
    """A tiny ``ZImagePipeline``, deterministic in ``seed``.

    The VAE has three levels (scale factor 4) and 4 latent channels, so a 32 px image is an 8×8 latent the
    transformer cuts into 16 tokens of 2×2 patches; the Qwen3 encoder (hidden 32) feeds ``cap_feat_dim``.
    The scheduler is the static shift 3 Z-Image-Turbo ships.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )

    tokenizer = tiny_z_image_tokenizer()
    text_encoder = tiny_qwen3_encoder(tokenizer, hidden_size=32, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=4,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=32,
            axes_dims=[8, 4, 4],
            axes_lens=[1024, 64, 64],
        )
        vae = AutoencoderKL(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            block_out_channels=(4, 4, 4),
            down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.1159,
            scaling_factor=0.3611,
        )
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_TURBO_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
