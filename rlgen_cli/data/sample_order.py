"""The order in which a process trains its samples (``algo.shuffle_samples``).

``none`` keeps rollout order. ``per_process`` is Flow-Factory's: before each pass over the epoch's samples
(an inner epoch) every process permutes its own samples with ``torch.randperm``, the generator seeded by
``hash((seed, epoch, inner_epoch)) % 2**32``, then cuts micro-batches in that order. The seed does not
depend on the rank, so every process applies the same permutation to its own samples: which samples share
a micro-batch and an optimizer step then depends on the process count (docs/maths.md §4.5).
"""

from __future__ import annotations

import torch
from torch import Tensor


def flow_factory_seed(seed: int, epoch: int, inner_epoch: int) -> int:
    """Flow-Factory's generator seed for an inner epoch. CPython hashes a tuple of ints the same way in
    every run and on every machine (unlike strings, no PYTHONHASHSEED salt), so this is reproducible."""
    return hash((seed, epoch, inner_epoch)) % 2**32


def shuffled_order(seed: int, epoch: int, inner_epoch: int, num_samples: int) -> Tensor:
    """(num_samples,) the permutation of a process's samples for one inner epoch."""
    generator = torch.Generator().manual_seed(flow_factory_seed(seed, epoch, inner_epoch))
    return torch.randperm(num_samples, generator=generator)


def training_orders(
    mode: str, seed: int, epoch: int, num_inner_epochs: int, num_samples: int
) -> list[Tensor] | None:
    """One permutation per inner epoch under ``per_process``; None under ``none`` (rollout order)."""
    if mode == "none":
        return None
    if mode != "per_process":
        raise ValueError(f"shuffle mode {mode!r}: expected 'none' or 'per_process'")
    return [shuffled_order(seed, epoch, inner, num_samples) for inner in range(num_inner_epochs)]
