"""Tiny FLUX.2-dev and FLUX.2-klein pipelines: the real diffusers / transformers classes, scaled-down
configs, random weights deterministic in ``seed``, offline tokenizers.

Both share the FLUX.2 transformer and VAE: the VAE has two levels (scale factor 2) and 2 latent
channels, so a 32 px image is a 16×16 latent, patchified to (8, 8, 8): 64 image tokens of 8 channels
(the transformer's ``in_channels``). Its batch-norm statistics are random, so the (de)normalisation the
pipeline applies around the VAE is exercised. The text encoders keep the real depth the pipelines tap
(hidden states 10 / 20 / 30 of Mistral-Small-3.x, 9 / 18 / 27 of Qwen3) at width 16, so the pipelines'
default ``text_encoder_out_layers`` work unchanged and the transformer reads 3·16 = 48 text channels.
"""

from __future__ import annotations

from typing import Any

import torch

from rlgen_cli.models.tiny.vlm import tiny_qwen_tokenizer

TEXT_WIDTH = 16
"""Hidden size of the tiny text encoders; the transformer's ``joint_attention_dim`` is 3× this."""

QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""Qwen3's chat layout for the tiny tokenizer (``enable_thinking=False`` appends an empty think block)."""

MISTRAL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/INST]"
    "{% endif %}{% endfor %}"
)
"""Mistral-Small-3.x's system / instruction markers over the list-of-parts messages the pipeline sends."""


def tiny_flux2_transformer(guidance_embeds: bool) -> Any:
    """A 1 + 1-block ``Flux2Transformer2DModel`` (width 32, 4-axis RoPE of 4 dims each)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * TEXT_WIDTH,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def tiny_flux2_vae() -> Any:
    """An ``AutoencoderKLFlux2`` with 2 levels and 2 latent channels; random batch-norm statistics."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(4, 4),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=2,
        norm_num_groups=1,
        sample_size=32,
    )
    vae.bn.running_mean.normal_(0.0, 0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def flux2_scheduler() -> Any:
    """The scheduler FLUX.2 ships: exponential dynamic shift (μ is set by the pipeline per call)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        base_shift=0.5,
        max_shift=1.15,
        time_shift_type="exponential",
    )


def tiny_mistral_processor() -> Any:
    """A ``PixtralProcessor`` over the byte-level tiny tokenizer; the pipeline's system prompt is one
    added token, so a short ``max_sequence_length`` still keeps the user's prompt (as with the real
    tokenizer, whose system prompt is a few dozen tokens)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import AddedToken
    from transformers import PixtralImageProcessor, PixtralProcessor

    tokenizer = tiny_qwen_tokenizer()
    markers = [
        "[SYSTEM_PROMPT]",
        "[/SYSTEM_PROMPT]",
        "[INST]",
        "[/INST]",
        "[IMG]",
        "[IMG_BREAK]",
        "[IMG_END]",
    ]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    tokenizer.add_tokens([AddedToken(SYSTEM_MESSAGE, normalized=False, special=False)])
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(),
        tokenizer=tokenizer,
        patch_size=16,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )


def tiny_mistral3(vocab_size: int, pad_token_id: int) -> Any:
    """A random ``Mistral3ForConditionalGeneration``: 30 text layers of width 16, a 1-layer Pixtral tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(
        vocab_size=vocab_size, hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=30,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
        pad_token_id=pad_token_id,
    )  # fmt: skip
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=16
    )
    config = Mistral3Config(
        text_config={"model_type": "mistral", **text},
        vision_config={"model_type": "pixtral", **vision},
        projector_hidden_act="gelu",
        spatial_merge_size=1,
    )
    return Mistral3ForConditionalGeneration(config).eval()


def tiny_qwen3(vocab_size: int, pad_token_id: int) -> Any:
    """A random ``Qwen3ForCausalLM``: 27 layers of width 16, initialised wide (σ 0.5, not 0.02) so the
    un-normalised hidden states the pipeline taps, and so the prompt, move the velocity visibly."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=TEXT_WIDTH,
        intermediate_size=32,
        num_hidden_layers=27,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        pad_token_id=pad_token_id,
        tie_word_embeddings=True,
        initializer_range=0.5,
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_flux2_pipeline(seed: int = 0) -> Any:
    """A tiny ``Flux2Pipeline`` (FLUX.2-dev: guidance embedded, Mistral-3 text encoder), from ``seed``."""
    from diffusers import Flux2Pipeline

    processor = tiny_mistral_processor()
    tokenizer = processor.tokenizer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer, vae = tiny_flux2_transformer(guidance_embeds=True), tiny_flux2_vae()
        text_encoder = tiny_mistral3(len(tokenizer), tokenizer.pad_token_id)
    return Flux2Pipeline(
        scheduler=flux2_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=transformer,
    )


def tiny_flux2_klein_pipeline(seed: int = 0, is_distilled: bool = False) -> Any:
    """A tiny ``Flux2KleinPipeline`` (the base variant: true CFG, Qwen3 text encoder), from ``seed``;
    ``is_distilled=True`` marks it as the step-distilled variant (what the real distilled checkpoints'
    ``model_index.json`` says)."""
    from diffusers import Flux2KleinPipeline

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer, vae = tiny_flux2_transformer(guidance_embeds=False), tiny_flux2_vae()
        text_encoder = tiny_qwen3(len(tokenizer), tokenizer.pad_token_id)
    return Flux2KleinPipeline(
        scheduler=flux2_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=is_distilled,
    )
