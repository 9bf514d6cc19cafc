"""Real-size models without weights: a published checkpoint's architecture, random weights, no download.

``model.weights=random_init`` builds the pipeline of ``model.variant`` (``model.variant=auto``: the
checkpoint the family's ``conf/model`` option names) from the config values that checkpoint publishes in
its diffusers / transformers ``config.json``, written out below (a native family's — BAGEL's — in its own
package, which builds it: ``Variant.native``), with random weights drawn from
``model.tiny_seed``. Every recipe then runs at production shapes and cost — parameter counts, memory,
FLOPs, step times — on a machine that holds no weights and reaches no hub (``benchmarks/real_size.py``,
docs/real_size.md). The samples are noise: this measures, it does not generate.

Design choices:

* **Transformer and VAE: always real size.** They are what training and sampling cost.
* **Text encoders: ``model.text_encoders``.** ``real_size`` (default) builds them at their published size
  too (T5-XXL 4.76 B, UMT5-XXL 5.7 B, Qwen2.5-VL-7B 8.3 B): the whole pipeline's memory, as a real run
  holds it. ``stand_in`` builds two-layer encoders of the *same output widths* (hidden size, pooled
  projection) with narrow insides and the stand-in tokenizers' vocabularies: the transformer receives
  conditioning of production shape ((B, 77 + max_sequence_length, 4096) for SD3) from encoders of a few
  million parameters, so a benchmark fits a small host (an fp32 T5-XXL alone is 19 GB). The tiny
  builders' encoders cannot serve: their widths (32, 64) do not match a real transformer's inputs.
* **Tokenizers: always the offline stand-ins** the tiny variants use (``models/tokenizers.py``, the byte-
  level Qwen tokenizer of ``models/tiny/vlm.py``). Padded encoders (CLIP to 77, T5 / UMT5 to
  ``max_sequence_length``) give production sequence lengths exactly; unpadded ones (Qwen-Image's Qwen2.5-VL,
  the VLM policies) see one token per character or byte, about 3–4× as many as the real BPE makes.
  Special-token ids come from the stand-in; vocabularies keep their published size (embedding rows).
* **Where and how it is built:** directly on the run's device in ``model.dtype`` (torch's default dtype
  during construction), so a 20 B transformer never passes through host memory in fp32; the modules a
  checkpoint keeps in fp32 are then cast back by the family's loader as for real weights. Built under
  ``torch.device("meta")`` (:func:`flow_components`, :func:`vlm_model`), nothing is allocated: that is how
  the tests count every variant's parameters against :data:`VARIANTS`' published figures.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import TORCH_DTYPES
from rlgen_cli.models.tiny.image import QWEN_SCHEDULER, template_tokenizer
from rlgen_cli.models.tokenizers import tiny_clip_tokenizer, tiny_t5_tokenizer, vocab_size
from rlgen_cli.schema.run import REAL_SIZE_VARIANTS, ModelConfig

# -- published configs: VAEs --------------------------------------------------------------------------
SD3_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=1.5305,
    shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
    mid_block_add_attention=True,
)  # fmt: skip
"""``stabilityai/stable-diffusion-3.5-{medium,large}/vae/config.json`` (``AutoencoderKL``)."""
FLUX_VAE = SD3_VAE | dict(scaling_factor=0.3611, shift_factor=0.1159)
"""``black-forest-labs/FLUX.1-dev/vae/config.json``: SD3's VAE with FLUX's latent scale and shift."""
WAN_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
WAN_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]  # fmt: skip
WAN_VAE = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, latents_mean=WAN_LATENTS_MEAN,
    latents_std=WAN_LATENTS_STD,
)  # fmt: skip
"""``Wan-AI/Wan2.1-T2V-*-Diffusers/vae/config.json`` (``AutoencoderKLWan``); Qwen-Image ships the same
values for its ``AutoencoderKLQwenImage``."""

# -- published configs: text encoders -------------------------------------------------------------------
CLIP_L = dict(
    vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, layer_norm_eps=1e-5,
)  # fmt: skip
"""CLIP ViT-L/14's text tower (SD3's ``text_encoder``, FLUX's ``text_encoder``)."""
CLIP_G = dict(
    vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
    max_position_embeddings=77, hidden_act="gelu", projection_dim=1280, layer_norm_eps=1e-5,
)  # fmt: skip
"""OpenCLIP bigG/14's text tower (SD3's ``text_encoder_2``)."""
T5_XXL = dict(
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6, dropout_rate=0.1, decoder_start_token_id=0,
)  # fmt: skip
"""T5 v1.1 XXL's encoder (SD3's ``text_encoder_3``, FLUX's ``text_encoder_2``)."""
UMT5_XXL = T5_XXL | dict(vocab_size=256384)
"""UMT5-XXL's encoder (Wan2.1's ``text_encoder``)."""

QWEN_VL_VISION_PATCH = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
QWEN2_5_VL_VISION = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, hidden_act="silu", window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, **QWEN_VL_VISION_PATCH,
)  # fmt: skip
QWEN2_VL_VISION = dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, hidden_act="quick_gelu",
                       **QWEN_VL_VISION_PATCH)  # fmt: skip
MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}


def qwen_text(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, max_positions: int
) -> dict[str, Any]:
    """A Qwen2 language-model config as the Qwen-VL checkpoints publish it (RMSNorm ε 1e-6, M-RoPE)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        rope_parameters=dict(MROPE),
    )


@dataclass(frozen=True)
class VLConfig:
    """A Qwen-VL checkpoint's ``config.json``: ``kind`` ``qwen2_vl`` | ``qwen2_5_vl``."""

    kind: str
    text: dict[str, Any]
    vision: dict[str, Any]
    tie_word_embeddings: bool


QWEN2_5_VL_7B = VLConfig(
    "qwen2_5_vl",
    qwen_text(3584, 18944, 28, 28, 4, 152064, 128000),
    QWEN2_5_VL_VISION | {"out_hidden_size": 3584},
    tie_word_embeddings=False,
)
"""``Qwen/Qwen2.5-VL-7B-Instruct`` (also Qwen-Image's text encoder)."""
VL_CONFIGS = {
    "qwen2_vl_2b": VLConfig(
        "qwen2_vl", qwen_text(1536, 8960, 28, 12, 2, 151936, 32768),
        QWEN2_VL_VISION | {"hidden_size": 1536}, tie_word_embeddings=True,
    ),
    "qwen2_vl_7b": VLConfig(
        "qwen2_vl", qwen_text(3584, 18944, 28, 28, 4, 152064, 32768),
        QWEN2_VL_VISION | {"hidden_size": 3584}, tie_word_embeddings=False,
    ),
    "qwen2_5_vl_3b": VLConfig(
        "qwen2_5_vl", qwen_text(2048, 11008, 36, 16, 2, 151936, 128000),
        QWEN2_5_VL_VISION | {"out_hidden_size": 2048}, tie_word_embeddings=True,
    ),
    "qwen2_5_vl_7b": QWEN2_5_VL_7B,
}  # fmt: skip
"""The VLM policies' checkpoints (``Qwen/Qwen2-VL-{2B,7B}-Instruct``, ``Qwen/Qwen2.5-VL-{3B,7B}-Instruct``)."""

# -- published configs: transformers --------------------------------------------------------------------
SD3_5_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)  # fmt: skip
SD3_5_LARGE = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
    pos_embed_max_size=192, dual_attention_layers=(), qk_norm="rms_norm",
)  # fmt: skip
FLUX_1 = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)  # fmt: skip
"""FLUX.1-dev's transformer; FLUX.1-Kontext-dev publishes the same values."""
QWEN_IMAGE = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
"""Qwen-Image's transformer; Qwen-Image-Edit publishes the same values."""
WAN_COMMON = dict(
    patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)  # fmt: skip
WAN2_1_1_3B = WAN_COMMON | dict(num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN2_1_14B = WAN_COMMON | dict(num_attention_heads=40, ffn_dim=13824, num_layers=40)


@dataclass(frozen=True)
class Variant:
    """A published checkpoint rlgen can build at random init.

    ``params`` is the parameter count of its trained network as published (the transformer of a flow
    model, the whole model of a VLM, the network of a native family: every tensor its weight file holds),
    the figure :func:`flow_components` / :func:`vlm_model` / the family's builder must reproduce.
    """

    family: str
    checkpoint: str
    params: float
    transformer: dict[str, Any] | None = None
    native: bool = False
    """Built by its family's own code from the family's published config (BAGEL:
    ``models/bagel/loading.py``), not from a diffusers / transformers class."""
    layers: int | None = None
    """A native variant's decoder depth when not the published one (:func:`with_layers`)."""


VARIANTS: dict[str, Variant] = {
    "sd3_5_medium": Variant("sd3", "stabilityai/stable-diffusion-3.5-medium", 2.24e9, SD3_5_MEDIUM),
    "sd3_5_large": Variant("sd3", "stabilityai/stable-diffusion-3.5-large", 8.06e9, SD3_5_LARGE),
    "flux_1_dev": Variant("flux", "black-forest-labs/FLUX.1-dev", 11.9e9, FLUX_1),
    "flux_1_kontext_dev": Variant("flux_kontext", "black-forest-labs/FLUX.1-Kontext-dev", 11.9e9, FLUX_1),
    "qwen_image": Variant("qwen_image", "Qwen/Qwen-Image", 20.4e9, QWEN_IMAGE),
    "qwen_image_edit": Variant("qwen_image_edit", "Qwen/Qwen-Image-Edit", 20.4e9, QWEN_IMAGE),
    "wan2_1_t2v_1_3b": Variant("wan2_1", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 1.42e9, WAN2_1_1_3B),
    "wan2_1_t2v_14b": Variant("wan2_1", "Wan-AI/Wan2.1-T2V-14B-Diffusers", 14.3e9, WAN2_1_14B),
    "qwen2_vl_2b": Variant("qwen2_vl", "Qwen/Qwen2-VL-2B-Instruct", 2.21e9),
    "qwen2_vl_7b": Variant("qwen2_vl", "Qwen/Qwen2-VL-7B-Instruct", 8.29e9),
    "qwen2_5_vl_3b": Variant("qwen2_5_vl", "Qwen/Qwen2.5-VL-3B-Instruct", 3.75e9),
    "qwen2_5_vl_7b": Variant("qwen2_5_vl", "Qwen/Qwen2.5-VL-7B-Instruct", 8.29e9),
    "bagel_7b_mot": Variant("bagel", "ByteDance-Seed/BAGEL-7B-MoT", 14.607e9, native=True),
}
"""Every variant; ``params`` is the published count of what the checkpoint's weight files hold, which the
names round (the Wan "1.3B" transformer holds 1.42 B, Wan "14B" 14.3 B, Qwen-Image's "20B" 20.4 B; BAGEL's
"7B" counts the parameters active per token, its ``ema.safetensors`` holds 14.6 B: two 7 B experts sharing
the embeddings, the ViT, the glue and the two sin-cos tables it stores as frozen parameters)."""
COMPONENT_PARAMS = {
    "clip_l": 123.65e6, "clip_g": 694.66e6, "t5_xxl": 4.762e9, "umt5_xxl": 5.681e9,
    "qwen2_5_vl_7b": 8.29e9, "sd3_vae": 83.65e6, "wan_vae": 126.9e6,
}  # fmt: skip
"""Published sizes of the shared components (text encoders with their projections, VAEs)."""


def variant_of(cfg: ModelConfig) -> str:
    """``model.variant``, with ``auto`` resolved to the family's default checkpoint."""
    if cfg.variant != "auto":
        return cfg.variant
    if cfg.family not in REAL_SIZE_VARIANTS:  # the schema stops this first; kept for direct callers
        raise UserError(f"model.family={cfg.family!r} has no real-size variant")
    return REAL_SIZE_VARIANTS[cfg.family][0]


@contextlib.contextmanager
def constructing(device: torch.device, dtype: torch.dtype, seed: int) -> Iterator[None]:
    """Modules created inside are created on ``device`` in ``dtype``, their random init drawn from ``seed``
    (the caller's random state is left as it was)."""
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if (device.type == "cuda")
        else []
    )
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


# -- text encoders ------------------------------------------------------------------------------------
def clip_encoder(config: dict[str, Any], tokenizer: Any, stand_in: bool, projection: bool) -> nn.Module:
    """A CLIP text tower of ``config`` (the stand-in tokenizer's special ids); ``stand_in``: 2 layers of
    the same width, narrow MLPs, the tokenizer's vocabulary."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    values = dict(config, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if stand_in:
        values |= dict(num_hidden_layers=2, intermediate_size=64, vocab_size=vocab_size(tokenizer))
    model_cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return model_cls(CLIPTextConfig(**values))


def t5_encoder(config: dict[str, Any], tokenizer: Any, stand_in: bool, umt5: bool = False) -> nn.Module:
    """A T5 (or UMT5) encoder of ``config``; ``stand_in``: 2 layers of the same width ``d_model``, 4 heads
    of 8, a 32-wide feed-forward, the tokenizer's vocabulary."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    values = dict(config)
    if stand_in:
        values |= dict(num_layers=2, num_heads=4, d_kv=8, d_ff=32, vocab_size=vocab_size(tokenizer))
    if umt5:
        return UMT5EncoderModel(UMT5Config(**values))
    return T5EncoderModel(T5Config(**values))


def qwen_vl(config: VLConfig, tokenizer: Any, stand_in: bool = False) -> nn.Module:
    """A Qwen2-VL / Qwen2.5-VL ``ForConditionalGeneration`` of ``config``, special-token ids from
    ``tokenizer``; ``stand_in`` (Qwen2.5-VL, as Qwen-Image's encoder): 2 text layers of the same width and
    heads with a 64-wide MLP, a 2-block 64-wide vision tower with the same patches and output width, the
    tokenizer's vocabulary."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    special = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
               "pad_token_id": ids["<|endoftext|>"]}  # fmt: skip
    text, vision = dict(config.text, **special), dict(config.vision)
    if stand_in:
        assert config.kind == "qwen2_5_vl", "stand-in encoders are Qwen2.5-VL's (Qwen-Image)"
        text |= dict(num_hidden_layers=2, intermediate_size=64, vocab_size=len(tokenizer))
        vision |= dict(depth=2, num_heads=2, hidden_size=64, intermediate_size=64, fullatt_block_indexes=[1])
    config_cls, model_cls = {
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
        "qwen2_vl": (Qwen2VLConfig, Qwen2VLForConditionalGeneration),
    }[config.kind]
    vl_config = config_cls(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=config.tie_word_embeddings,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        **special,
    )
    return model_cls(vl_config).eval()


def vl_processor(tokenizer: Any, chat_template: str | None, min_pixels: int, max_pixels: int) -> Any:
    """A ``Qwen2VLProcessor`` with the published geometry (14-px patches, 2×2 merge, 2 frames) over
    ``tokenizer``: what a real-size vision tower reads."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    geometry = {k: QWEN_VL_VISION_PATCH[k] for k in ("patch_size", "temporal_patch_size")}
    geometry["merge_size"] = QWEN_VL_VISION_PATCH["spatial_merge_size"]
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, **geometry),
        video_processor=Qwen2VLVideoProcessor(size=size, **geometry),
        tokenizer=tokenizer,
        chat_template=chat_template,
    )


# -- flow pipelines -----------------------------------------------------------------------------------
def on_cpu(scheduler_cls: type, **config: Any) -> Any:
    """A scheduler built on the CPU whatever device modules are being built on (schedulers keep their
    tables on the CPU and copy them there, which the meta device cannot)."""
    with torch.device("cpu"):
        return scheduler_cls(**config)


def sd3_components(variant: Variant, stand_in: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    clip_tok, clip_tok_2, t5_tok = tiny_clip_tokenizer(77), tiny_clip_tokenizer(77), tiny_t5_tokenizer(512)
    return {
        "transformer": SD3Transformer2DModel(**variant.transformer),
        "vae": AutoencoderKL(**SD3_VAE),
        "text_encoder": clip_encoder(CLIP_L, clip_tok, stand_in, projection=True),
        "text_encoder_2": clip_encoder(CLIP_G, clip_tok_2, stand_in, projection=True),
        "text_encoder_3": t5_encoder(T5_XXL, t5_tok, stand_in),
        "tokenizer": clip_tok,
        "tokenizer_2": clip_tok_2,
        "tokenizer_3": t5_tok,
        "scheduler": on_cpu(FlowMatchEulerDiscreteScheduler, shift=3.0),
    }


def flux_components(variant: Variant, stand_in: bool) -> dict[str, Any]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    clip_tok, t5_tok = tiny_clip_tokenizer(77), tiny_t5_tokenizer(512)
    scheduler = on_cpu(
        FlowMatchEulerDiscreteScheduler,
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        base_shift=0.5,
        max_shift=1.15,
    )
    return {
        "transformer": FluxTransformer2DModel(**variant.transformer),
        "vae": AutoencoderKL(**FLUX_VAE),
        "text_encoder": clip_encoder(CLIP_L, clip_tok, stand_in, projection=False),
        "tokenizer": clip_tok,
        "text_encoder_2": t5_encoder(T5_XXL, t5_tok, stand_in),
        "tokenizer_2": t5_tok,
        "scheduler": scheduler,
    }


def qwen_image_components(variant: Variant, stand_in: bool, pipeline_cls: type) -> dict[str, Any]:
    """Qwen-Image(-Edit): the pipeline's template-aligned stand-in tokenizer (``template_tokenizer``), and
    for the editing pipeline a processor with the encoder's published 14-px patches."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    parts: dict[str, Any] = {
        "transformer": QwenImageTransformer2DModel(**variant.transformer),
        "vae": AutoencoderKLQwenImage(**WAN_VAE), "scheduler": on_cpu(FlowMatchEulerDiscreteScheduler, **QWEN_SCHEDULER),
        "text_encoder": None, "tokenizer": None,
    }  # fmt: skip
    takes_processor = "processor" in inspect.signature(pipeline_cls.__init__).parameters
    if takes_processor:
        parts["processor"] = None
    probe = pipeline_cls(**parts)  # only to read its prompt template
    tokenizer = template_tokenizer(probe.prompt_template_encode, probe.prompt_template_encode_start_idx)
    parts |= {"tokenizer": tokenizer, "text_encoder": qwen_vl(QWEN2_5_VL_7B, tokenizer, stand_in)}
    if takes_processor:  # the published Qwen2.5-VL processor's pixel bounds
        parts["processor"] = vl_processor(tokenizer, None, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    return parts


def wan_components(variant: Variant, stand_in: bool, max_sequence_length: int) -> dict[str, Any]:
    """Wan2.1: the stand-in T5 tokenizer pads to ``max_sequence_length``, as the tiny Wan's does."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    tokenizer = tiny_t5_tokenizer(max_sequence_length)
    scheduler = on_cpu(
        UniPCMultistepScheduler,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
    )
    return {
        "transformer": WanTransformer3DModel(**variant.transformer),
        "vae": AutoencoderKLWan(**WAN_VAE),
        "text_encoder": t5_encoder(UMT5_XXL, tokenizer, stand_in, umt5=True),
        "tokenizer": tokenizer,
        "scheduler": scheduler,
    }


def pipeline_class(family: str) -> type:
    import diffusers

    return getattr(
        diffusers,
        {
            "sd3": "StableDiffusion3Pipeline",
            "flux": "FluxPipeline",
            "flux_kontext": "FluxKontextPipeline",
            "qwen_image": "QwenImagePipeline",
            "qwen_image_edit": "QwenImageEditPipeline",
            "wan2_1": "WanPipeline",
        }[family],
    )


def flow_components(name: str, stand_in: bool, max_sequence_length: int = 512) -> dict[str, Any]:
    """The pipeline components of flow variant ``name`` (modules on the current default device and dtype,
    e.g. inside :func:`constructing` or ``torch.device("meta")``); ``stand_in`` text encoders or real-size
    ones."""
    variant = VARIANTS[name]
    if variant.family == "sd3":
        return sd3_components(variant, stand_in)
    if variant.family in ("flux", "flux_kontext"):
        return flux_components(variant, stand_in)
    if variant.family in ("qwen_image", "qwen_image_edit"):
        return qwen_image_components(variant, stand_in, pipeline_class(variant.family))
    if variant.family == "wan2_1":
        return wan_components(variant, stand_in, max_sequence_length)
    raise UserError(f"model.variant={name} is a VLM: build it with the VLM policy, not a flow family")


def flow_pipeline(cfg: ModelConfig, device: torch.device) -> Any:
    """The family pipeline of ``cfg``'s variant at random init on ``device`` in ``model.dtype``, seeded by
    ``model.tiny_seed`` (the family's builder then casts it as its loader casts real weights)."""
    name = variant_of(cfg)
    with constructing(device, TORCH_DTYPES[cfg.dtype], cfg.tiny_seed):
        parts = flow_components(name, cfg.text_encoders == "stand_in", cfg.max_sequence_length)
    return pipeline_class(VARIANTS[name].family)(**parts)


# -- VLM policies ---------------------------------------------------------------------------------------
def vlm_model(name: str, tokenizer: Any) -> nn.Module:
    """The Qwen-VL model of VLM variant ``name`` (current default device and dtype), ids from ``tokenizer``."""
    if name not in VL_CONFIGS:
        raise UserError(f"model.variant={name} is a flow model, not a VLM")
    return qwen_vl(VL_CONFIGS[name], tokenizer)


def build_vlm_model(cfg: ModelConfig, tokenizer: Any, device: torch.device) -> nn.Module:
    """:func:`vlm_model` of ``cfg``'s variant at random init on ``device`` in ``model.dtype``, seeded by
    ``model.tiny_seed``."""
    with constructing(device, TORCH_DTYPES[cfg.dtype], cfg.tiny_seed):
        return vlm_model(variant_of(cfg), tokenizer)


# -- native families ------------------------------------------------------------------------------------
def with_layers(variant: Variant, layers: int) -> Variant:
    """``variant`` with ``layers`` decoder layers and every width as published: what a host too small for
    the whole model can still run (``benchmarks/real_size.py --layers``). Native families only (BAGEL:
    its MoT layers); a diffusers variant is cut through its ``transformer`` config."""
    from dataclasses import replace

    if not variant.native:
        raise UserError(f"--layers applies to BAGEL variants; {variant.checkpoint} is cut by its transformer")
    return replace(variant, layers=layers)


def count_parameters(module: nn.Module | None) -> int:
    """Distinct parameters of ``module`` (tied weights once); 0 for None."""
    return 0 if module is None else sum(p.numel() for p in module.parameters())
