"""Configuration values of BAGEL (ByteDance-Seed, 2025): the released BAGEL-7B-MoT and rlgen's tiny one.

BAGEL is one decoder-only Mixture-of-Transformers: a Qwen2 language model whose every layer holds two
experts of identical shape — *understanding* (text and ViT tokens) and *generation* (VAE latent tokens) —
with separate q/k/v/o projections, q/k RMS norms, MLPs and layer norms but one shared attention over the
whole sequence. Around it: a SigLIP ViT (NaViT-style flattened patches) for understanding, a FLUX
autoencoder (16 channels, 8× down) whose 2×2 latent patches are the generation tokens, a sinusoidal
timestep embedder and two linear maps latent ↔ hidden.

The released checkpoint directory holds ``llm_config.json`` (a Qwen2 config), ``vit_config.json`` (a
SigLIP vision config), ``ae.safetensors`` (the FLUX autoencoder), ``ema.safetensors`` (the EMA weights
of everything else; ``model.safetensors`` or a sharded ``*.safetensors.index.json`` when a release has
no EMA file) and the Qwen2 tokenizer files. :func:`from_directory` reads the two JSON files and applies
the fixed choices the reference inference makes on top of them (q/k norm on, the MoT layer, untied
embeddings, the ViT's last layer dropped, learned ViT positions instead of 2-D RoPE).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlgen_cli.errors import UserError

LLM_CONFIG = "llm_config.json"
VIT_CONFIG = "vit_config.json"
AE_WEIGHTS = "ae.safetensors"


@dataclass(frozen=True)
class LLMConfig:
    """The Qwen2 MoT language model (both experts have these shapes)."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ViTConfig:
    """The SigLIP vision tower as BAGEL runs it (``num_hidden_layers`` already one less than the file's)."""

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 26
    num_attention_heads: int = 16
    patch_size: int = 14
    image_size: int = 980
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class VAEConfig:
    """The FLUX autoencoder (the reference's ``load_ae`` parameters)."""

    in_channels: int = 3
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    scale_factor: float = 0.3611
    shift_factor: float = 0.1159
    norm_groups: int = 32

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True)
class BagelConfig:
    """The whole model: the three parts plus the generation / understanding glue."""

    llm: LLMConfig = field(default_factory=LLMConfig)
    vit: ViTConfig = field(default_factory=ViTConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    latent_patch_size: int = 2
    max_latent_size: int = 64
    """Latent patches per side of the 2-D sin-cos table (64: 1024 px images)."""
    vit_max_num_patch_per_side: int = 70
    connector_act: str = "gelu_pytorch_tanh"
    timestep_frequency_dim: int = 256

    @property
    def patch_latent_dim(self) -> int:
        return self.latent_patch_size**2 * self.vae.z_channels

    @property
    def latent_downsample(self) -> int:
        return self.vae.downsample * self.latent_patch_size


BAGEL_7B_MOT = BagelConfig()
"""BAGEL-7B-MoT: Qwen2.5-7B shapes per expert, SigLIP-so400m/14 at 980 px, FLUX VAE; 1024 px max."""


@dataclass(frozen=True)
class GenerationDefaults:
    """The reference inferencer's text-to-image settings that rlgen keeps fixed (model.guidance_scale,
    model.shift and model.num_steps are the configurable ones: 4.0, 3.0, 50 there)."""

    cfg_interval: tuple[float, float] = (0.4, 1.0)
    """Guidance acts only for t ∈ (0.4, 1.0]; below, the conditional velocity alone."""
    cfg_renorm_min: float = 0.0
    """The guided velocity is rescaled to at most the conditional velocity's norm (global, per sample)."""


GENERATION = GenerationDefaults()


@dataclass(frozen=True)
class EditingDefaults:
    """The reference's image-editing settings that rlgen keeps fixed (model.guidance_scale = its
    cfg_text_scale and model.image_guidance_scale = its cfg_img_scale are the configurable ones: 4.0 and
    2.0 there), and the rule that sizes the source image for the ViT."""

    cfg_interval: tuple[float, float] = (0.0, 1.0)
    """Guidance acts for t ∈ (0, 1]: every step but the last point of the grid."""
    cfg_renorm_min: float = 0.0
    """``text_channel`` renorm: the text-guided velocity is rescaled per latent token to at most the
    conditional one's norm, before the image guidance (which is not renormed)."""
    vit_min_patches_per_side: int = 16
    """The ViT input's short side is brought up to this many patches (224 px for SigLIP/14) …"""
    vit_max_patches: int = 9 * 1024
    """… and its area down to this many patches, its long side to ``ViTConfig.image_size`` (980 px)."""


EDITING = EditingDefaults()


TINY_BAGEL = BagelConfig(
    llm=LLMConfig(
        vocab_size=263,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10_000.0,
    ),
    vit=ViTConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=4,
        image_size=32,
    ),
    vae=VAEConfig(ch=4, ch_mult=(1, 2, 2), num_res_blocks=1, z_channels=4, norm_groups=1),
    max_latent_size=16,
    vit_max_num_patch_per_side=8,
)
"""rlgen's tiny BAGEL: 2 MoT layers of width 32, a 1-layer ViT on 4-px patches, a 3-level VAE (4× down,
4 channels), so a 32 px image is 16 latent tokens of 2×2 patches; vocabulary of the offline tokenizer."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise UserError(
            f"{path} is missing: model.path must be a BAGEL checkpoint directory (llm_config.json, "
            "vit_config.json, ae.safetensors, ema.safetensors and the tokenizer files)"
        )
    return json.loads(path.read_text())


def from_directory(directory: Path, base: BagelConfig = BAGEL_7B_MOT) -> BagelConfig:
    """The config of the checkpoint in ``directory``: its two JSON files over ``base``'s glue values."""
    llm = _read_json(directory / LLM_CONFIG)
    vit = _read_json(directory / VIT_CONFIG)
    if llm.get("rope_scaling"):
        raise UserError(
            f"{directory / LLM_CONFIG} sets rope_scaling={llm['rope_scaling']}: BAGEL's language model uses "
            "plain rotary positions and rlgen implements only those"
        )
    llm_fields = {k: llm[k] for k in LLMConfig.__dataclass_fields__ if k in llm}
    vit_fields = {k: vit[k] for k in ViTConfig.__dataclass_fields__ if k in vit}
    if "num_hidden_layers" in vit_fields:
        vit_fields["num_hidden_layers"] -= 1  # BAGEL feeds the penultimate SigLIP layer (+ post norm)
    return replace(base, llm=LLMConfig(**llm_fields), vit=ViTConfig(**vit_fields))


def to_json_files(config: BagelConfig, directory: Path) -> None:
    """Write ``llm_config.json`` / ``vit_config.json`` as the release lays them out (the inverse of
    :func:`from_directory`: the ViT file counts the dropped layer)."""
    llm = {k: getattr(config.llm, k) for k in LLMConfig.__dataclass_fields__}
    llm |= {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False}
    vit = {k: getattr(config.vit, k) for k in ViTConfig.__dataclass_fields__}
    vit |= {"model_type": "siglip_vision_model", "num_hidden_layers": config.vit.num_hidden_layers + 1}
    (directory / LLM_CONFIG).write_text(json.dumps(llm, indent=2))
    (directory / VIT_CONFIG).write_text(json.dumps(vit, indent=2))
