"""Text on BAGEL's understanding expert: interleaved contexts, KV-cache sampling and full-forward scoring.

A **context** is what the reference's ``update_context_text`` / ``update_context_image(vit=True)`` calls
build up, one piece after the other:

* a text piece is ``<|im_start|>`` + its tokens + ``<|im_end|>``, one rotary position per token, causal;
* an image piece is ``<|vision_start|>``, the image's ViT tokens (:meth:`Bagel.vit_tokens`),
  ``<|vision_end|>``, all at ONE rotary position (the next one after it follows), with full attention
  inside the block and causal attention to everything before it;
* a completion starts after the start token ``<|im_start|>`` (the reference's ``prepare_start_tokens``)
  and stops at ``<|im_end|>``.

Every token of a context and of a completion takes the understanding expert. Two paths read a context:

* :func:`sample` — autoregressive decoding with a KV cache (prefill of the left-padded contexts, then one
  token per step; per-row ``torch.Generator`` streams, so a row's tokens depend on its own stream only);
  it records each sampled token's log-prob under the raw logits at temperature 1 (before temperature and
  top-p / top-k filtering), the quantity training computes;
* :func:`completion_logprobs` — one full forward of context + completion (right-padded, the equivalent
  mask) through ``MoTModel.forward``, the training path (gradient checkpointing, DDP wrapper), at
  temperature 1.

Both run the same modules in the same order. The full forward equals one pass of the decoding code over
the whole row bit for bit; incremental decoding (one query per step against cached keys, matrix products
of other shapes) rounds differently, so in fp32 the two agree to ~1e-6 in log-prob, not exactly
(``rlgen check-onpolicy``; ``tests/r3/test_r3_bagel.py`` bounds it by 1e-5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlgen_cli.models.bagel.modeling import Bagel, rope_cos_sin, rotate_half
from rlgen_cli.models.bagel.vit import patchify

__all__ = [
    "Context",
    "Sampled",
    "build_context",
    "completion_logprobs",
    "sample",
    "text_piece",
    "vit_input",
]

Piece = str | Tensor | list[int]
"""A context piece: a text (wrapped in the prompt markers), an image (3, H, W) in [0, 1] (the ViT block),
or raw token ids appended as they are (the completion's start token)."""


@dataclass
class Context:
    """One row's context, embedded.

    Attributes:
        embeds: (S, D) input embeddings (text token embeddings and ViT tokens).
        positions: (S,) rotary positions.
        blocks: (S,) −1 for causal tokens, k ≥ 0 for the tokens of the k-th image block (full attention
            inside the block).
        next_position: The rotary position of the first completion token.
    """

    embeds: Tensor
    positions: Tensor
    blocks: Tensor
    next_position: int

    def __len__(self) -> int:
        return int(self.embeds.shape[0])


@dataclass
class Sampled:
    """Sampled completions, one per row: ids (L_i,) with the stop token when sampled, whether the budget
    ran out first, and the raw-logit log-probs (L_i,) at temperature 1."""

    ids: list[Tensor]
    truncated: list[bool]
    logprobs: list[Tensor]


def text_piece(tokenizer, markers: dict[str, int], text: str) -> list[int]:
    """``<|im_start|>`` + the text's tokens + ``<|im_end|>`` (the reference's text context)."""
    return [markers["<|im_start|>"], *tokenizer.encode(text, add_special_tokens=False), markers["<|im_end|>"]]


def vit_input(network: Bagel, image: Tensor) -> tuple[Tensor, Tensor]:
    """Flattened ViT patches (N, 3·p²) and their position ids of one image (3, H, W) in [0, 1].

    The image is resized so its longer side fits ``vit_max_num_patch_per_side`` patches, each side a
    multiple of the patch size (the reference's ViT transform for a square image), and normalised to
    [−1, 1] (mean 0.5, std 0.5)."""
    config = network.config
    patch, limit = config.vit.patch_size, config.vit_max_num_patch_per_side
    h, w = image.shape[-2:]
    scale = min(1.0, limit * patch / max(h, w))
    size = [max(patch, int(round(side * scale / patch)) * patch) for side in (h, w)]
    if list(image.shape[-2:]) != size:
        image = F.interpolate(image[None].float(), size=size, mode="bilinear", antialias=True)[0]
    image = (image.float().clamp(0, 1) - 0.5) / 0.5
    rows, cols = size[0] // patch, size[1] // patch
    ids = (torch.arange(rows)[:, None] * limit + torch.arange(cols)).flatten()
    return patchify(image, patch), ids.to(image.device)


@torch.no_grad()
def _image_block(network: Bagel, image: Tensor, markers: dict[str, int]) -> Tensor:
    """(N + 2, D): ``<|vision_start|>``, ViT tokens, ``<|vision_end|>`` (the ViT is never trained)."""
    embed = network.language_model.model.embed_tokens
    device = embed.weight.device
    patches, ids = vit_input(network, image.to(device))
    tokens = network.vit_tokens(patches.to(embed.weight.dtype), ids)
    start, end = embed(torch.tensor([markers["<|vision_start|>"], markers["<|vision_end|>"]], device=device))
    return torch.cat([start[None], tokens.to(start.dtype), end[None]])


def build_context(network: Bagel, pieces: Sequence[Piece], tokenizer, markers: dict[str, int]) -> Context:
    """Embed ``pieces`` in order (see the module docstring for their layout)."""
    embed = network.language_model.model.embed_tokens
    device = embed.weight.device
    parts, positions, blocks = [], [], []
    position, block = 0, 0
    for piece in pieces:
        if isinstance(piece, Tensor):
            tokens = _image_block(network, piece, markers)
            positions.append(torch.full((len(tokens),), position))
            blocks.append(torch.full((len(tokens),), block))
            position, block = position + 1, block + 1
        else:
            ids = text_piece(tokenizer, markers, piece) if isinstance(piece, str) else list(piece)
            with torch.no_grad():
                tokens = embed(torch.tensor(ids, device=device, dtype=torch.long))
            positions.append(torch.arange(position, position + len(ids)))
            blocks.append(torch.full((len(ids),), -1))
            position += len(ids)
        parts.append(tokens)
    return Context(torch.cat(parts), torch.cat(positions).to(device), torch.cat(blocks).to(device), position)


def context_mask(blocks: Tensor, valid: Tensor) -> Tensor:
    """(B, S, S) bool: causal over valid tokens, full inside each image block; an invalid (padding) query
    sees only itself, so its (unused) output stays finite."""
    s = blocks.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=blocks.device).tril()
    same_block = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    mask = (causal | same_block) & valid[:, None, :] & valid[:, :, None]
    eye = torch.eye(s, dtype=torch.bool, device=blocks.device)
    return mask | (eye & ~valid[:, :, None])


# -- the training path: one full forward --------------------------------------------------------------
def _full_layout(
    network: Bagel, contexts: Sequence[Context], completions: Sequence[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-padded context + completion rows: embeddings (B, T, D), positions, mask (B, T, T) and the
    index (B, L) of the position whose logits predict each completion token."""
    embed = network.language_model.model.embed_tokens
    device = embed.weight.device
    lengths = [len(c) + int(ids.numel()) for c, ids in zip(contexts, completions, strict=True)]
    total, longest = max(lengths), max(int(ids.numel()) for ids in completions)
    batch = len(contexts)
    x = torch.zeros(batch, total, embed.weight.shape[1], dtype=embed.weight.dtype, device=device)
    positions = torch.zeros(batch, total, dtype=torch.long, device=device)
    blocks = torch.full((batch, total), -1, dtype=torch.long, device=device)
    valid = torch.zeros(batch, total, dtype=torch.bool, device=device)
    index = torch.zeros(batch, longest, dtype=torch.long, device=device)
    for i, (context, ids) in enumerate(zip(contexts, completions, strict=True)):
        n, s = int(ids.numel()), len(context)
        ids = ids.to(device).long()
        x[i, :s] = context.embeds
        x[i, s : s + n] = embed(ids)
        positions[i, :s] = context.positions
        positions[i, s : s + n] = torch.arange(
            context.next_position, context.next_position + n, device=device
        )
        blocks[i, :s] = context.blocks
        valid[i, : s + n] = True
        index[i, :n] = torch.arange(s - 1, s - 1 + n, device=device)  # logits at j predict token j + 1
    return x, positions, context_mask(blocks, valid), index


def understanding_logits(network: Bagel, x: Tensor, positions: Tensor, mask: Tensor, index: Tensor) -> Tensor:
    """LM-head logits (B, L, V) at the positions ``index`` (B, L) of a causal pass over embeddings ``x``
    through the understanding expert (only the scored positions reach the LM head)."""
    gen = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
    hidden = network.language_model.model(x, gen, positions, mask)
    picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    return network.language_model.lm_head(picked)


def completion_logprobs(network: Bagel, contexts: Sequence[Context], completions: Sequence[Tensor]) -> Tensor:
    """(B, L) log-probs at temperature 1 of each completion token after its context (0 on padding).
    ``network`` may be a stand-in that routes ``language_model.model`` through a DDP wrapper."""
    x, positions, mask, index = _full_layout(network, contexts, completions)
    logits = understanding_logits(network, x, positions, mask, index).float()
    longest = index.shape[1]
    ids = torch.zeros(len(completions), longest, dtype=torch.long, device=logits.device)
    for i, row in enumerate(completions):
        ids[i, : row.numel()] = row.to(logits.device).long()
    return logits.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# -- the rollout path: KV-cache decoding -----------------------------------------------------------------
def _cached_layer(
    layer, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past: tuple[Tensor, Tensor] | None
):
    """One MoT layer on understanding tokens x (B, s, D) with cached keys / values (B, H_kv, P, hd)."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    q = attn.q_norm(attn.q_proj(h).unflatten(-1, (attn.num_heads, attn.head_dim)))
    k = attn.k_norm(attn.k_proj(h).unflatten(-1, (attn.num_kv_heads, attn.head_dim)))
    v = attn.v_proj(h).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
    cos, sin = cos[:, :, None], sin[:, :, None]
    q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
    k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    groups = attn.num_heads // attn.num_kv_heads
    out = attn.processor(
        attn, q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), mask[:, None]
    )
    x = x + attn.o_proj(out.transpose(1, 2).flatten(2))
    return x + layer.mlp(layer.post_attention_layernorm(x)), (k, v)


class _Cache:
    """Keys and values of every layer for a left-padded batch, and which key slots are real tokens."""

    def __init__(self, network: Bagel) -> None:
        self.network = network
        self.model = network.language_model.model
        self.layers: list[tuple[Tensor, Tensor] | None] = [None] * len(self.model.layers)
        self.valid: Tensor | None = None

    def step(self, x: Tensor, positions: Tensor, mask: Tensor, valid: Tensor) -> Tensor:
        """Run x (B, s, D) at ``positions`` (B, s) over the cache + itself (``mask`` (B, s, P + s)), append
        its keys / values (``valid`` (B, s) marks real tokens), return the last position's logits (B, V)."""
        config = self.model.config
        cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
        for i, layer in enumerate(self.model.layers):
            x, self.layers[i] = _cached_layer(layer, x, cos, sin, mask, self.layers[i])
        self.valid = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)
        return self.network.language_model.lm_head(self.model.norm(x[:, -1]))


def _prefill(network: Bagel, contexts: Sequence[Context], cache: _Cache) -> Tensor:
    """Left-padded contexts into the cache; the logits (B, V) after each context's last token."""
    total = max(len(c) for c in contexts)
    embed = network.language_model.model.embed_tokens
    device = embed.weight.device
    batch = len(contexts)
    x = torch.zeros(batch, total, embed.weight.shape[1], dtype=embed.weight.dtype, device=device)
    positions = torch.zeros(batch, total, dtype=torch.long, device=device)
    blocks = torch.full((batch, total), -1, dtype=torch.long, device=device)
    valid = torch.zeros(batch, total, dtype=torch.bool, device=device)
    for i, context in enumerate(contexts):
        s = len(context)
        x[i, total - s :] = context.embeds
        positions[i, total - s :] = context.positions
        blocks[i, total - s :] = context.blocks
        valid[i, total - s :] = True
    return cache.step(x, positions, context_mask(blocks, valid), valid)


def _draw(logits: Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """One token from one row's raw logits (V,): greedy at temperature 0, else temperature, top-k, top-p."""
    if temperature <= 0:
        return int(logits.argmax())
    scaled = logits.float() / temperature
    if top_k > 0:
        kth = scaled.topk(min(top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = scaled.sort(descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = scaled.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def sample(
    network: Bagel,
    contexts: Sequence[Context],
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    stop_id: int,
    generators: Sequence[torch.Generator],
) -> Sampled:
    """Sample one completion per context with the KV cache (module docstring); row i draws from
    ``generators[i]`` (CPU generators: the draws do not depend on the device)."""
    cache = _Cache(network)
    logits = _prefill(network, contexts, cache)
    batch = len(contexts)
    device = logits.device
    embed = network.language_model.model.embed_tokens
    next_positions = torch.tensor([c.next_position for c in contexts], device=device)
    ids: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[Tensor]] = [[] for _ in range(batch)]
    done = [False] * batch
    for t in range(max_new_tokens):
        raw = logits.float().log_softmax(-1)
        tokens = []
        for i in range(batch):
            token = stop_id if done[i] else _draw(logits[i], temperature, top_p, top_k, generators[i])
            if not done[i]:
                ids[i].append(token)
                logprobs[i].append(raw[i, token].cpu())
                done[i] = token == stop_id
            tokens.append(token)
        if all(done) or t == max_new_tokens - 1:
            break
        x = embed(torch.tensor(tokens, device=device)[:, None])
        valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
        mask = torch.cat([cache.valid, valid], dim=1)[:, None, :]  # (B, 1, P + 1)
        logits = cache.step(x, (next_positions + t)[:, None], mask, valid)
    return Sampled(
        [torch.tensor(row, dtype=torch.long) for row in ids],
        [not (row and row[-1] == stop_id) for row in ids],
        [torch.stack(row) if row else torch.zeros(0) for row in logprobs],
    )
