"""A small pixel-space conv UNet with text cross-attention: the ShapesEval text-to-image model.

Sized for CPUs (≈ 1 M parameters, 32×32 RGB): three resolution levels of residual conv blocks
modulated by the timestep, cross-attention to the prompt tokens at 16×16 and 8×8, and self-attention
at 8×8 so the model can coordinate objects across the whole image (counts, relations). The text
encoder (word embeddings + a small transformer) is part of the model and trained with it.

It is a diffusers ``ModelMixin`` so ``save_pretrained`` / ``from_pretrained`` and peft LoRA
(``add_adapter`` / ``disable_adapters``) work as for the diffusers families. Dropout is absent by
design: training and rollouts must compute identical velocities (importance ratio exactly 1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of ``t`` (B,) on a 0–1000 scale → (B, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class ResBlock(nn.Module):
    """Two 3×3 convs with a scale/shift from the conditioning vector between them (FiLM)."""

    def __init__(self, c_in: int, c_out: int, emb_dim: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(emb_dim, 2 * c_out)
        self.norm2, self.conv2 = _norm(c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb(F.silu(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        return self.skip(x) + self.conv2(F.silu(h))


class Attention(nn.Module):
    """Multi-head attention of image positions to a context (itself for self-attention)."""

    def __init__(self, channels: int, context_dim: int | None, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = _norm(channels)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(context_dim or channels, channels)
        self.to_v = nn.Linear(context_dim or channels, channels)
        self.to_out = nn.Linear(channels, channels)

    def forward(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        b, c, h, w = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # (B, HW, C)
        ctx = tokens if context is None else context
        q, k, v = (
            proj(src).unflatten(-1, (self.heads, -1)).transpose(1, 2)
            for proj, src in ((self.to_q, tokens), (self.to_k, ctx), (self.to_v, ctx))
        )
        attn_mask = None if mask is None else mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = self.to_out(out.transpose(1, 2).flatten(2))
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class TextEncoder(nn.Module):
    """Word embeddings + learned positions + a small pre-norm transformer encoder."""

    def __init__(self, vocab_size: int, max_tokens: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Parameter(torch.zeros(1, max_tokens, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.embed(ids) + self.position[:, : ids.shape[1]]
        return self.norm(self.encoder(h, src_key_padding_mask=~mask))


class Level(nn.Module):
    """One resolution level: a residual block, then optional cross- and self-attention."""

    def __init__(
        self, c_in: int, c_out: int, emb_dim: int, ctx_dim: int, cross: bool, self_attn: bool
    ) -> None:
        super().__init__()
        heads = max(1, c_out // 32)
        self.res = ResBlock(c_in, c_out, emb_dim)
        self.cross = Attention(c_out, ctx_dim, heads) if cross else None
        self.self_attn = Attention(c_out, None, heads) if self_attn else None

    def forward(self, x: Tensor, emb: Tensor, ctx: Tensor, mask: Tensor) -> Tensor:
        x = self.res(x, emb)
        if self.cross is not None:
            x = self.cross(x, ctx, mask)
        if self.self_attn is not None:
            x = self.self_attn(x)
        return x


class ShapesUNet(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Velocity model v(x, t, text) for 32×32 (or any multiple of 4) RGB images in [-1, 1].

    ``channels`` gives the width of each level (full, 1/2, 1/4 resolution); ``cross_attention`` /
    ``self_attention`` say which levels attend (index 0 = full resolution).
    """

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 48,
        max_tokens: int = 16,
        text_dim: int = 64,
        text_layers: int = 2,
        channels: tuple[int, ...] = (32, 64, 128),
        cross_attention: tuple[bool, ...] = (False, True, True),
        self_attention: tuple[bool, ...] = (False, False, True),
        emb_dim: int = 128,
    ) -> None:
        super().__init__()
        self.text = TextEncoder(vocab_size, max_tokens, text_dim, text_layers, heads=4)
        self.time_mlp = nn.Sequential(nn.Linear(emb_dim, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        self.pooled = nn.Linear(text_dim, emb_dim)
        self.conv_in = nn.Conv2d(3, channels[0], 3, padding=1)
        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        c_prev = channels[0]
        for i, c in enumerate(channels):
            self.down.append(Level(c_prev, c, emb_dim, text_dim, cross_attention[i], self_attention[i]))
            if i < len(channels) - 1:
                self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
            c_prev = c
        self.mid = Level(c_prev, c_prev, emb_dim, text_dim, True, True)
        self.up = nn.ModuleList()
        for i in reversed(range(len(channels))):
            c_out = channels[max(i - 1, 0)]
            self.up.append(
                Level(c_prev + channels[i], c_out, emb_dim, text_dim, cross_attention[i], self_attention[i])
            )
            c_prev = c_out
        self.norm_out = _norm(c_prev)
        self.conv_out = nn.Conv2d(c_prev, 3, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    def forward(self, x: Tensor, timestep: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``x`` (B, 3, H, W); ``timestep`` (B,) in [0, 1000]; ``input_ids`` / ``attention_mask`` (B, L)."""
        mask = attention_mask.bool()
        ctx = self.text(input_ids, mask)
        pooled = (ctx * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        emb = self.time_mlp(timestep_embedding(timestep, self.config.emb_dim)) + self.pooled(pooled)
        h = self.conv_in(x)
        skips = []
        for i, level in enumerate(self.down):
            h = level(h, emb, ctx, mask)
            skips.append(h)
            if i < len(self.downsample):
                h = self.downsample[i](h)
        h = self.mid(h, emb, ctx, mask)
        for j, level in enumerate(self.up):
            if j > 0:
                h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = level(torch.cat([h, skips.pop()], dim=1), emb, ctx, mask)
        return self.conv_out(F.silu(self.norm_out(h)))
