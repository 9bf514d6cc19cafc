"""BAGEL image editing: the source image in the context of the generated one, and three CFG branches.

The reference's editing inference prefills, in this order, the source image as VAE latent tokens, the same
image as ViT tokens, then the instruction, and generates the image block after them:

====================  =================================================  ===========  ==============
block                 tokens                                             expert       rotary position
====================  =================================================  ===========  ==============
source, VAE           ``<|vision_start|>``, n clean latent tokens, end   generation   0 (all)
source, ViT           ``<|vision_start|>``, m ViT tokens, end            understand.  1 (all)
instruction           ``<|im_start|>`` … ``<|im_end|>``                  understand.  2, 3, …
generated image       ``<|vision_start|>``, n noisy latent tokens, end   generation   2 + length
====================  =================================================  ===========  ==============

(the markers always through the understanding expert). Each image block attends to everything before it
and to all of itself, the instruction causally. A source latent token enters like a generated one at t = 0
— ``vae2llm(patch) + time_embedder(0) + latent_pos_embed`` — from the VAE posterior mean (the reference
draws from the posterior). The ViT sees the source resized by the reference's rule (:func:`vit_input_size`)
and normalised to [−1, 1]. As for text-to-image, rlgen recomputes the whole context at every step, so an
adapted generation expert also shapes the source tokens' keys and values, as the gradient needs.

CFG (the reference's ``parallel`` form with its editing renorm ``text_channel``): with c the full context,
u_t the context without the instruction (the source image alone, or followed by ``model.negative_prompt``)
and u_i the context without the image (the instruction alone: the text-to-image context),

    v_t = (u_t + g_t·(c − u_t)) · clamp(‖c‖ / ‖u_t + g_t·(c − u_t)‖, min, 1)   (norms per latent token)
    v   = u_i + g_i·(v_t − u_i)                                                 (when g_i > 1, else v_t)

with g_t = ``model.guidance_scale`` (cfg_text_scale) and g_i = ``model.image_guidance_scale``
(cfg_img_scale), active for t in ``EDITING.cfg_interval``. As in the reference nothing is guided when
g_t ≤ 1 (the schema refuses an image scale without a text scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlgen_cli.models.bagel.config import EDITING, ViTConfig
from rlgen_cli.models.bagel.modeling import Bagel, generation_mask
from rlgen_cli.models.bagel.vit import patchify
from rlgen_cli.models.base import cfg_combine

SOURCE_TOKENS_KEY = "source_latents"
VIT_PATCHES_KEY = "vit_patches"
VIT_GRID_KEY = "vit_grid"


# -- the source image's two views ----------------------------------------------------------------------
def _divisible(value: float, stride: int) -> int:
    return max(stride, int(round(value / stride) * stride))


def _scaled(width: int, height: int, scale: float, stride: int) -> tuple[int, int]:
    return _divisible(round(width * scale), stride), _divisible(round(height * scale), stride)


def vit_input_size(height: int, width: int, vit: ViTConfig) -> tuple[int, int]:
    """(height, width) the ViT sees a height×width source at: the reference's resize rule (long side at
    most ``vit.image_size``, short side at least ``EDITING.vit_min_patches_per_side`` patches, at most
    ``EDITING.vit_max_patches`` patches, both sides multiples of the patch), the long-side cap last."""
    stride = vit.patch_size
    longest, min_side = vit.image_size, EDITING.vit_min_patches_per_side * stride
    scale = max(min(longest / max(width, height), 1.0), min_side / min(width, height))
    w, h = _scaled(width, height, scale, stride)
    max_pixels = EDITING.vit_max_patches * stride * stride
    if w * h > max_pixels:
        w, h = _scaled(w, h, max_pixels / (w * h), stride)
    if max(w, h) > longest:
        w, h = _scaled(w, h, longest / max(w, h), stride)
    return h, w


def vit_patches(images: Tensor, vit: ViTConfig) -> tuple[Tensor, tuple[int, int]]:
    """Images (B, 3, H, W) in [0, 1] → flattened ViT patches (B, m, 3·p²) in [−1, 1] and their grid."""
    height, width = vit_input_size(images.shape[-2], images.shape[-1], vit)
    if (height, width) != tuple(images.shape[-2:]):
        images = F.interpolate(images, size=(height, width), mode="bicubic", antialias=True).clamp(0, 1)
    normalised = images * 2 - 1
    patches = torch.stack([patchify(image, vit.patch_size) for image in normalised])
    return patches, (height // vit.patch_size, width // vit.patch_size)


def vit_position_ids(grid: tuple[int, int], side: int, device: torch.device) -> Tensor:
    """Flattened ``row·side + col`` ids of a ViT patch grid (the reference's extrapolating ids)."""
    rows, cols = torch.arange(grid[0], device=device), torch.arange(grid[1], device=device)
    return (rows[:, None] * side + cols).flatten()


# -- the editing sequence ------------------------------------------------------------------------------
def _framed(network: Bagel, markers: tuple[int, int], tokens: Tensor) -> Tensor:
    """``<|vision_start|>``, ``tokens`` (B, n, D), ``<|vision_end|>`` in the embedding dtype."""
    embed = network.language_model.model.embed_tokens
    start, end = embed(torch.tensor(markers, device=tokens.device)).unbind(0)
    batch = tokens.shape[0]
    return torch.cat([start.expand(batch, 1, -1), tokens.to(embed.weight.dtype), end.expand(batch, 1, -1)], 1)


def _latent_tokens(network: Bagel, latents: Tensor, t: Tensor, grid: tuple[int, int]) -> Tensor:
    """``vae2llm(patch) + time_embedder(t) + latent_pos_embed`` of patch tokens (B, n, patch_dim)."""
    positions = network.latent_pos_embed(network.latent_position_ids(*grid, latents.device))
    return network.vae2llm(latents) + network.time_embedder(t)[:, None] + positions


def source_blocks(
    network: Bagel,
    markers: tuple[int, int],
    source: Tensor,
    source_grid: tuple[int, int],
    patches: Tensor,
    vit_grid: tuple[int, int],
) -> tuple[Tensor, int]:
    """The two source blocks' embeddings (B, n + 2 + m + 2, D) and the length n + 2 of the VAE block:
    clean latent tokens ``source`` (B, n, patch_dim) at t = 0, then ViT tokens of ``patches`` (B, m, 3·p²)."""
    batch = source.shape[0]
    zero = torch.zeros(batch, device=source.device)
    vae_block = _framed(network, markers, _latent_tokens(network, source, zero, source_grid))
    ids = vit_position_ids(vit_grid, network.config.vit_max_num_patch_per_side, source.device)
    dtype = network.vit_model.vision_model.embeddings.patch_embedding.weight.dtype
    vit = torch.stack([network.vit_tokens(image.to(dtype), ids) for image in patches])
    return torch.cat([vae_block, _framed(network, markers, vit)], dim=1), vae_block.shape[1]


def edit_mask(vae_block: int, vit_block: int, text_mask: Tensor, block: int) -> Tensor:
    """(B, T, T) bool over [VAE block, ViT block, instruction (padded), generated block]: each image block
    sees what precedes it and all of itself, the instruction is causal over its valid tokens (see
    :func:`~rlgen_cli.models.bagel.modeling.generation_mask`, which this extends by the source blocks)."""
    batch = text_mask.shape[0]
    prefix = vae_block + vit_block
    total = prefix + text_mask.shape[1] + block
    mask = torch.zeros(batch, total, total, dtype=torch.bool, device=text_mask.device)
    mask[:, :vae_block, :vae_block] = True
    mask[:, vae_block:prefix, :prefix] = True
    later = torch.cat([text_mask, text_mask.new_ones(batch, block)], dim=1)  # valid rows see the prefix
    mask[:, prefix:, :prefix] = later[:, :, None]
    mask[:, prefix:, prefix:] = generation_mask(text_mask, block)
    return mask


def edit_velocity(
    network: Bagel,
    markers: tuple[int, int],
    source: Tensor,
    source_grid: tuple[int, int],
    patches: Tensor,
    vit_grid: tuple[int, int],
    text_ids: Tensor,
    text_mask: Tensor,
    latents: Tensor,
    t: Tensor,
    grid: tuple[int, int],
) -> Tensor:
    """Velocity tokens (B, n, patch_dim) of the generated latent tokens ``latents`` at ``t`` (B,), with the
    source image (its clean latent tokens and ViT patches) and then the instruction (``text_ids`` /
    ``text_mask``, right-padded; an all-False row is the text-CFG branch's empty instruction) as context."""
    batch, s = text_ids.shape
    n = latents.shape[1]
    device = latents.device
    prefix, vae_block = source_blocks(network, markers, source, source_grid, patches, vit_grid)
    p = prefix.shape[1]
    embed = network.language_model.model.embed_tokens
    generated = _framed(network, markers, _latent_tokens(network, latents, t, grid))
    x = torch.cat([prefix, embed(text_ids), generated], dim=1)
    gen = torch.zeros(batch, x.shape[1], dtype=torch.bool, device=device)
    gen[:, 1 : vae_block - 1] = True
    gen[:, p + s + 1 : p + s + 1 + n] = True
    position_ids = torch.cat(
        [
            torch.zeros(batch, vae_block, dtype=torch.long, device=device),
            torch.ones(batch, p - vae_block, dtype=torch.long, device=device),
            2 + torch.arange(s, device=device).expand(batch, s),
            (2 + text_mask.sum(1))[:, None].expand(batch, n + 2),
        ],
        dim=1,
    )
    mask = edit_mask(vae_block, p - vae_block, text_mask, n + 2)
    out = network.language_model.model(x, gen, position_ids, mask)
    return network.llm2vae(out[:, p + s + 1 : p + s + 1 + n])


# -- guidance ------------------------------------------------------------------------------------------
def edit_guidance(
    cond: Tensor, text_uncond: Tensor, image_uncond: Tensor | None, text_scale: float, image_scale: float
) -> Tensor:
    """The reference's editing CFG on velocity tokens (B, n, patch_dim), fp32: text guidance renormed per
    token (``text_channel``), then image guidance against ``image_uncond`` when ``image_scale`` > 1."""
    guided = cfg_combine(text_uncond, cond, text_scale)
    norm = torch.linalg.vector_norm
    ratio = norm(cond, dim=-1, keepdim=True) / (norm(guided, dim=-1, keepdim=True) + 1e-8)
    guided = guided * ratio.clamp(min=EDITING.cfg_renorm_min, max=1.0)
    if image_scale <= 1.0:
        return guided
    assert image_uncond is not None, "image guidance needs the branch without the image"
    return cfg_combine(image_uncond, guided, image_scale)
