"""BAGEL's autoencoder: the FLUX.1 VAE, run as diffusers' ``AutoencoderKL``.

The release ships the autoencoder as ``ae.safetensors`` in the original FLUX layout (``encoder.down.0.
block.0.norm1``, 1×1-convolution attention, no quant convs). diffusers' ``AutoencoderKL`` with FLUX's
config is the same network — same blocks, GroupNorm(32, ε 1e-6), asymmetric (0, 1, 0, 1) padding before
each stride-2 convolution, nearest-neighbour upsampling, one mid attention, three resnets per decoder
level — and diffusers' own single-file converter maps the file onto it; :func:`flux_layout_state_dict`
is the inverse (used to write the tiny model in the release layout, and checked by a round trip).

Latent convention (the reference's ``AutoEncoder``): ``z = scale · (μ − shift)``, decoding
``x = D(z / scale + shift)`` in [−1, 1]. rlgen encodes with the posterior mean μ; the reference's
``encode`` draws from the posterior (its editing and understanding inputs are sampled latents).
"""

from __future__ import annotations

import re
from typing import Any

from torch import Tensor

from rlgen_cli.models.bagel.config import VAEConfig


def diffusers_vae_config(config: VAEConfig) -> dict[str, Any]:
    """The ``AutoencoderKL`` config of ``config`` (FLUX's for the released one)."""
    levels = len(config.ch_mult)
    return dict(
        in_channels=config.in_channels,
        out_channels=config.in_channels,
        down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels,
        block_out_channels=[config.ch * m for m in config.ch_mult],
        layers_per_block=config.num_res_blocks,
        act_fn="silu",
        latent_channels=config.z_channels,
        norm_num_groups=config.norm_groups,
        sample_size=256,
        scaling_factor=config.scale_factor,
        shift_factor=config.shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
        force_upcast=True,
    )


def build_vae(config: VAEConfig) -> Any:
    """A randomly initialised ``AutoencoderKL`` of ``config``."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(**diffusers_vae_config(config))


def load_flux_layout(vae: Any, state: dict[str, Tensor]) -> None:
    """Load a state dict in the release's FLUX layout into ``vae`` (strict: every weight, nothing else)."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    converted = convert_ldm_vae_checkpoint(state, dict(vae.config))
    missing, unexpected = vae.load_state_dict(converted, strict=False)
    if missing or unexpected or len(converted) != len(state):
        raise ValueError(
            f"ae.safetensors does not fit the FLUX autoencoder (missing {sorted(missing)[:4]}, unexpected "
            f"{sorted(unexpected)[:4]}, {len(state) - len(converted)} keys not converted)"
        )


_RENAMES = [
    (r"down_blocks\.(\d+)\.resnets\.(\d+)\.", r"down.\1.block.\2."),
    (r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample."),
    (r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m.group(1)) + 1}."),
    (r"mid_block\.attentions\.0\.group_norm\.", "mid.attn_1.norm."),
    (r"mid_block\.attentions\.0\.to_(q|k|v)\.", r"mid.attn_1.\1."),
    (r"mid_block\.attentions\.0\.to_out\.0\.", "mid.attn_1.proj_out."),
    (r"conv_shortcut\.", "nin_shortcut."),
    (r"conv_norm_out\.", "norm_out."),
]


def flux_layout_state_dict(vae: Any) -> dict[str, Tensor]:
    """``vae``'s weights under the release's FLUX names (attention projections as 1×1 convolutions)."""
    levels = len(vae.config.up_block_types)
    out = {}
    for name, tensor in vae.state_dict().items():
        new = re.sub(
            r"up_blocks\.(\d+)\.(resnets|upsamplers)\.(\d+)\.",
            lambda m: (
                f"up.{levels - 1 - int(m.group(1))}."
                + (f"block.{m.group(3)}." if m.group(2) == "resnets" else "upsample.")
            ),
            name,
        )
        for pattern, repl in _RENAMES:
            new = re.sub(pattern, repl, new)
        if re.search(r"mid\.attn_1\.(q|k|v|proj_out)\.weight$", new):
            tensor = tensor[:, :, None, None]
        out[new] = tensor.detach().clone().contiguous()
    return out


def encode(vae: Any, images: Tensor) -> Tensor:
    """Images (B, 3, H, W) in [0, 1] → scaled latents (B, C, H/8, W/8) from the posterior mean, fp32."""
    mean = vae.encode((images * 2 - 1).to(vae.dtype)).latent_dist.mean.float()
    return vae.config.scaling_factor * (mean - vae.config.shift_factor)


def decode(vae: Any, latents: Tensor) -> Tensor:
    """Scaled latents (B, C, h, w) → images (B, 3, 8h, 8w) in [0, 1], fp32."""
    z = latents.float() / vae.config.scaling_factor + vae.config.shift_factor
    images = vae.decode(z.to(vae.dtype), return_dict=False)[0]
    return (images.float() * 0.5 + 0.5).clamp(0, 1)
