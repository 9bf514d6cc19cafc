"""Text conditioning cached across epochs: a batch of prompts seen before is not encoded again.

Prompts repeat — every evaluation encodes the same test prompts, and a training batch that holds one
prompt's group comes back whenever the sampler picks that prompt again — but the text encoders are
frozen, so re-encoding them is wasted work. :func:`cache_prompt_embeddings` routes a policy's
``encode`` through a :class:`PromptCache`, a least-recently-used map bounded in bytes
(``model.prompt_cache_mb``; 0 leaves ``encode`` as it is).

An entry is keyed by the whole batch of prompts, in order, with every setting the encoders read
(:func:`encoder_settings`), not by single prompts: a text encoder's output for one prompt can change in
its last bits with the other prompts of its batch (batched matrix products pick kernels by shape), so
only the same batch guarantees embeddings bit-identical to a fresh encode — and a training run with the
cache bit-identical to one without. Encodes with source images (editing families) and encoders with
trainable weights (R3 trains a LoRA on Qwen-Image's shared encoder) bypass the cache. Each family's
``build`` installs the cache with the encoder modules its ``encode`` runs.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from torch import Tensor, nn

from rlgen_cli.models.base import Cond, FlowPolicy


class PromptCache:
    """A least-recently-used map from keys to :class:`Cond`, holding at most ``max_bytes`` of tensors.

    A conditioning larger than the whole budget is returned but not kept. Hits return a new ``Cond``
    sharing the cached tensors (nothing in rlgen writes into conditioning tensors).
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a prompt cache needs a positive size, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, tuple[Cond, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, encode: Callable[[], Cond]) -> Cond:
        """The conditioning cached under ``key``, or ``encode()``'s (kept if it fits the budget)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            self.hits += 1
            return _shared(self._entries[key][0])
        self.misses += 1
        cond = encode()
        size = cond_bytes(cond)
        if size <= self.max_bytes:
            self._entries[key] = (_shared(cond), size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted
        return cond

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0


def _shared(cond: Cond) -> Cond:
    """A new ``Cond`` over the same tensors (callers may add keys without touching the cache)."""
    return Cond(dict(cond.tensors), dict(cond.extras))


def cond_bytes(cond: Cond) -> int:
    """Bytes held by the tensors of ``cond``."""
    return sum(t.numel() * t.element_size() for t in cond.tensors.values())


def encoder_settings(policy: FlowPolicy) -> tuple[Any, ...]:
    """Everything besides the prompts that decides what ``policy.encode`` returns, read at call time:
    the weights (family, path, tiny seed), dtype, sequence length, device, the negative prompt and the
    guidance scale (whether — and for embedded guidance, how — a negative branch is encoded)."""
    cfg = policy.cfg
    return (
        cfg.family,
        cfg.path,
        cfg.tiny,
        cfg.tiny_seed,
        cfg.revision,
        cfg.dtype,
        cfg.max_sequence_length,
        cfg.negative_prompt,
        float(policy.guidance_scale),
        str(policy.device),
    )


def trainable(encoders: Sequence[nn.Module]) -> bool:
    """Whether any weight of ``encoders`` is trainable (their output would go stale)."""
    return any(p.requires_grad for encoder in encoders for p in encoder.parameters())


def cache_prompt_embeddings(
    policy: FlowPolicy, max_mb: float, encoders: Sequence[nn.Module]
) -> PromptCache | None:
    """Route ``policy.encode`` through a new :class:`PromptCache` of ``max_mb`` MiB and return the cache,
    also reachable as ``policy.encode.cache`` (``max_mb`` ≤ 0: ``encode`` is left as it is, None).

    ``encoders``: the modules ``encode`` runs (none for a tokenizer-only encode); while any of their
    weights is trainable the cache is bypassed."""
    if max_mb <= 0:
        return None
    cache = PromptCache(int(max_mb * 2**20))
    encode = policy.encode

    @functools.wraps(encode)
    def cached_encode(prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        if images is not None or trainable(encoders):
            return encode(prompts, images)
        key = (tuple(prompts), encoder_settings(policy))
        return cache.get(key, lambda: encode(prompts))

    cached_encode.cache = cache  # type: ignore[attr-defined]
    policy.encode = cached_encode  # type: ignore[method-assign]
    return cache
