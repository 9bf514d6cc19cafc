"""BAGEL's Mixture-of-Transformers language model and the generation / understanding glue around it.

Every decoder layer holds two experts of the same shape: the *understanding* expert (``q_proj``, …,
``mlp``, ``input_layernorm``, …) for text and ViT tokens and the *generation* expert (the same names with
``_moe_gen``) for VAE latent tokens. Each token goes through its own expert's norms and projections; the
attention is one softmax over the whole sequence, so text and image tokens see each other. Module and
parameter names follow the released checkpoint (``language_model.model.layers.N.self_attn.q_proj_moe_gen``,
``time_embedder.mlp.0``, ``vae2llm``, ``llm2vae``, ``latent_pos_embed.pos_embed``, ``vit_model.…``,
``connector.fc1``, ``vit_pos_embed.pos_embed``) so its state dict loads as is.

Text-to-image velocity (:meth:`Bagel.generation_velocity`). The reference prefills the prompt into a KV
cache (understanding expert, causal), then at each step runs the image block — ``<|vision_start|>``, the
h·w latent tokens, ``<|vision_end|>``, all at the one rope position after the prompt — with full attention
over itself and the cached prompt; the two markers take the understanding expert, the latents the
generation one. rlgen runs prompt and image block as one padded sequence with the equivalent mask (a
prompt token sees the prompt tokens up to itself, an image-block token sees the whole prompt and the whole
block): the same attention, recomputed per step instead of cached, and batched with padding where the
reference packs variable-length samples into one row (per-sample results are the same). A latent token
enters as ``vae2llm(patch) + time_embedder(t) + latent_pos_embed(row·max + col)`` and leaves through
``norm_moe_gen`` and ``llm2vae``: the velocity noise − x₀ at t (t = 1 is noise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.attention import AttentionModuleMixin
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlgen_cli.models.bagel.config import BagelConfig, LLMConfig
from rlgen_cli.models.bagel.vit import ScaledDotProductAttention, SiglipVisionModel, activation


# -- building blocks ----------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Qwen2's RMS norm: normalised in fp32, scaled by the weight in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """Qwen2's SwiGLU feed-forward."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = activation(config.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def routed(x: Tensor, gen: Tensor, und_fn: nn.Module, gen_fn: nn.Module) -> Tensor:
    """``und_fn`` on the tokens where ``gen`` is False and ``gen_fn`` where it is True (x: (..., D))."""
    flat, mask = x.reshape(-1, x.shape[-1]), gen.reshape(-1)
    und_out, gen_out = und_fn(flat[~mask]), gen_fn(flat[mask])
    out = und_out.new_zeros(flat.shape[0], und_out.shape[-1])
    out = out.index_put((torch.nonzero(~mask).squeeze(1),), und_out)
    out = out.index_put((torch.nonzero(mask).squeeze(1),), gen_out.to(out.dtype))
    return out.reshape(*x.shape[:-1], -1)


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Qwen2's default rotary embedding at ``position_ids`` (B, S): cos, sin (B, S, head_dim) fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim)
    angles = position_ids.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


# -- the MoT decoder ------------------------------------------------------------------------------------
class MoTAttention(nn.Module, AttentionModuleMixin):
    """Grouped-query attention with a projection set and q/k RMS norms per expert, one softmax for all.

    The softmax itself is its ``processor`` (diffusers' attention-module convention), so
    ``model.attention=eager`` can run it on PyTorch's math kernel like every other family's attention."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.processor = ScaledDotProductAttention()
        d, h, kv, hd = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        for suffix in ("", "_moe_gen"):
            setattr(self, f"q_proj{suffix}", nn.Linear(d, h * hd, bias=True))
            setattr(self, f"k_proj{suffix}", nn.Linear(d, kv * hd, bias=True))
            setattr(self, f"v_proj{suffix}", nn.Linear(d, kv * hd, bias=True))
            setattr(self, f"o_proj{suffix}", nn.Linear(h * hd, d, bias=False))
            setattr(self, f"q_norm{suffix}", RMSNorm(hd, config.rms_norm_eps))
            setattr(self, f"k_norm{suffix}", RMSNorm(hd, config.rms_norm_eps))

    def _heads(self, x: Tensor, gen: Tensor, name: str, heads: int, norm: bool) -> Tensor:
        und_fn, gen_fn = getattr(self, f"{name}_proj"), getattr(self, f"{name}_proj_moe_gen")
        out = routed(x, gen, und_fn, gen_fn).unflatten(-1, (heads, self.head_dim))  # (B, S, H, hd)
        if norm:
            out = routed(
                out,
                gen[..., None].expand(out.shape[:-1]),
                getattr(self, f"{name}_norm"),
                getattr(self, f"{name}_norm_moe_gen"),
            )
        return out

    def forward(self, x: Tensor, gen: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        q = self._heads(x, gen, "q", self.num_heads, norm=True)
        k = self._heads(x, gen, "k", self.num_kv_heads, norm=True)
        v = self._heads(x, gen, "v", self.num_kv_heads, norm=False)
        cos, sin = cos[:, :, None], sin[:, :, None]
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, hd)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = self.processor(self, q, k, v, mask[:, None]).transpose(1, 2).flatten(2)
        return routed(out, gen, self.o_proj, self.o_proj_moe_gen)


class MoTDecoderLayer(nn.Module):
    """Pre-norm residual block; norms, attention projections and MLP routed per token's expert."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = MoTAttention(config)
        self.mlp, self.mlp_moe_gen = MLP(config), MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_moe_gen = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(config.hidden_size, eps)

    def forward(self, x: Tensor, gen: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        h = routed(x, gen, self.input_layernorm, self.input_layernorm_moe_gen)
        x = x + self.self_attn(h, gen, cos, sin, mask)
        h = routed(x, gen, self.post_attention_layernorm, self.post_attention_layernorm_moe_gen)
        return x + routed(h, gen, self.mlp, self.mlp_moe_gen)


class MoTModel(nn.Module):
    """Embeddings, the MoT layers and the final norm of each expert (``language_model.model``)."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoTDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_moe_gen = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False

    def forward(self, x: Tensor, gen: Tensor, position_ids: Tensor, mask: Tensor) -> Tensor:
        """x (B, S, D) input embeddings, gen (B, S) bool, position_ids (B, S), mask (B, S, S) bool."""
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, gen, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, gen, cos, sin, mask)
        return routed(x, gen, self.norm, self.norm_moe_gen)


class MoTForCausalLM(nn.Module):
    """``language_model``: the MoT model and the (untied) LM head."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__()
        self.model = MoTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


# -- glue -----------------------------------------------------------------------------------------------
def sincos_2d(dim: int, side: int) -> Tensor:
    """The fixed 2-D sin-cos table (side², dim): first half encodes the column, second half the row."""

    def one_axis(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    rows, cols = np.meshgrid(
        np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32), indexing="ij"
    )
    table = np.concatenate([one_axis(dim // 2, cols), one_axis(dim // 2, rows)], axis=1)
    return torch.from_numpy(table).float()


class PositionEmbedding(nn.Module):
    """A fixed 2-D sin-cos table indexed by flattened ``row·side + col`` ids. The release stores it (a
    frozen parameter there); here a persistent buffer of the same name, so no optimizer can move it."""

    def __init__(self, side: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("pos_embed", sincos_2d(dim, side))

    def forward(self, position_ids: Tensor) -> Tensor:
        return self.pos_embed[position_ids]


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of t (cos first, max period 10⁴) through a SiLU MLP."""

    def __init__(self, hidden_size: int, frequency_dim: int) -> None:
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(
            nn.Linear(frequency_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: Tensor) -> Tensor:
        half = self.frequency_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class MLPConnector(nn.Module):
    """ViT features → LLM width."""

    def __init__(self, in_dim: int, out_dim: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(in_dim, out_dim), nn.Linear(out_dim, out_dim)
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Bagel(nn.Module, PeftAdapterMixin):
    """The BAGEL network (everything but the autoencoder), with diffusers' PEFT adapter methods."""

    _supports_gradient_checkpointing = True

    def __init__(self, config: BagelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.llm.hidden_size
        self.language_model = MoTForCausalLM(config.llm)
        self.time_embedder = TimestepEmbedder(d, config.timestep_frequency_dim)
        self.vae2llm = nn.Linear(config.patch_latent_dim, d)
        self.llm2vae = nn.Linear(d, config.patch_latent_dim)
        self.latent_pos_embed = PositionEmbedding(config.max_latent_size, d)
        self.vit_model = SiglipVisionModel(config.vit)
        self.connector = MLPConnector(config.vit.hidden_size, d, config.connector_act)
        self.vit_pos_embed = PositionEmbedding(config.vit_max_num_patch_per_side, d)

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether the MoT layers recompute their activations in the backward pass (diffusers' name)."""
        return self.language_model.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self.language_model.model.gradient_checkpointing = on

    def enable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = True

    def disable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = False

    # -- generation ---------------------------------------------------------------------------------
    def latent_position_ids(self, h: int, w: int, device: torch.device) -> Tensor:
        """Flattened ``row·max_latent_size + col`` ids of an h×w patch grid (the reference's extrapolate)."""
        side = self.config.max_latent_size
        rows, cols = torch.arange(h, device=device), torch.arange(w, device=device)
        return (rows[:, None] * side + cols).flatten()

    def forward(self, method: Callable[..., Tensor], *args: Any) -> Tensor:
        """``method(self, *args)``: one of the network's passes (:meth:`generation_velocity`, editing's
        ``edit_velocity``) run as the module's call, so that a distributed wrapper, which only ever calls
        ``forward``, sees every training pass and reduces its gradients."""
        return method(self, *args)

    def generation_velocity(
        self,
        text_ids: Tensor,
        text_mask: Tensor,
        markers: tuple[int, int],
        latents: Tensor,
        t: Tensor,
        grid: tuple[int, int],
    ) -> Tensor:
        """Velocity tokens (B, N, patch_dim) for latent patch tokens ``latents`` (B, N, patch_dim) at time
        ``t`` (B,), conditioned on the prompt ``text_ids`` (B, S) whose valid tokens ``text_mask`` (B, S)
        marks (right-padded; a row with none is the empty context of the text-CFG branch); ``markers``
        are the ids of ``<|vision_start|>`` / ``<|vision_end|>``, ``grid`` the patch grid (h, w)."""
        batch, s = text_ids.shape
        n = latents.shape[1]
        device = latents.device
        embed = self.language_model.model.embed_tokens
        lengths = text_mask.sum(1)
        start, end = embed(torch.tensor(markers, device=device)).unbind(0)
        image_tokens = (
            self.vae2llm(latents)
            + self.time_embedder(t)[:, None]
            + self.latent_pos_embed(self.latent_position_ids(*grid, device))
        )
        dtype = embed.weight.dtype
        block = torch.cat(
            [start.expand(batch, 1, -1), image_tokens.to(dtype), end.expand(batch, 1, -1)], dim=1
        )
        x = torch.cat([embed(text_ids), block], dim=1)  # (B, S + N + 2, D)
        gen = torch.zeros(batch, s + n + 2, dtype=torch.bool, device=device)
        gen[:, s + 1 : s + 1 + n] = True
        text_pos = torch.arange(s, device=device).expand(batch, s)
        position_ids = torch.cat([text_pos, lengths[:, None].expand(batch, n + 2)], dim=1)
        out = self.language_model.model(x, gen, position_ids, generation_mask(text_mask, n + 2))
        return self.llm2vae(out[:, s + 1 : s + 1 + n])

    # -- understanding ------------------------------------------------------------------------------
    def text_logits(self, ids: Tensor) -> Tensor:
        """Next-token logits (B, S, V) of a causal text-only pass through the understanding expert."""
        batch, s = ids.shape
        gen = torch.zeros(batch, s, dtype=torch.bool, device=ids.device)
        position_ids = torch.arange(s, device=ids.device).expand(batch, s)
        mask = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril().expand(batch, s, s)
        hidden = self.language_model.model(
            self.language_model.model.embed_tokens(ids), gen, position_ids, mask
        )
        return self.language_model.lm_head(hidden)

    def vit_tokens(self, patches: Tensor, position_ids: Tensor) -> Tensor:
        """LLM-width embeddings (N, D) of one image's flattened ViT patches (N, 3·p²) at their
        ``row·vit_max_num_patch_per_side + col`` ids: ViT, connector, then the 2-D sin-cos position."""
        features = self.vit_model(patches, position_ids)
        return self.connector(features) + self.vit_pos_embed(position_ids)


def generation_mask(text_mask: Tensor, block: int) -> Tensor:
    """(B, S + block, S + block) bool: prompt tokens causal over the valid prompt, the image block sees
    the valid prompt and all of itself; a padded prompt position sees only itself (its output is unused)."""
    batch, s = text_mask.shape
    total = s + block
    device = text_mask.device
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(batch, total, total, dtype=torch.bool, device=device)
    mask[:, :s, :s] = causal & text_mask[:, None, :] & text_mask[:, :, None]
    mask[:, s:, :s] = text_mask[:, None, :]
    mask[:, s:, s:] = True
    eye = torch.eye(s, dtype=torch.bool, device=device)
    mask[:, :s, :s] |= eye & ~text_mask[:, :, None]
    return mask
