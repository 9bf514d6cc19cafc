"""Per-sample random streams, so a sample's noise depends on who it is, not on how it was batched.

Each sample gets its own ``torch.Generator`` seeded from (run seed, epoch, sample key). The key is the
sample's position in the epoch's global batch — or its group id when a group shares noise (DanceGRPO's
shared initial noise, R3's policy groups). Rollouts are then identical whatever the rollout batch size
or the number of processes the epoch is split over.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["randn_per_sample", "sample_generators", "stream_seed"]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads nearby integers over 64 bits
_MASK = (1 << 63) - 1


def stream_seed(seed: int, epoch: int, key: int, salt: int = 0) -> int:
    """A 63-bit seed for stream (seed, epoch, key, salt); distinct inputs give unrelated seeds."""
    value = 0
    for part in (seed, epoch, key, salt):
        value = ((value ^ (part & _MASK)) * _MIX + 0x632BE59BD9B4E019) & _MASK
        value ^= value >> 29
    return value


def sample_generators(
    seed: int, epoch: int, keys: Sequence[int], device: torch.device | str = "cpu", salt: int = 0
) -> list[torch.Generator]:
    """One generator per sample key (``salt`` separates independent uses, e.g. initial vs step noise)."""
    return [torch.Generator(device=device).manual_seed(stream_seed(seed, epoch, k, salt)) for k in keys]


def randn_per_sample(
    shape: Sequence[int], generators: Sequence[torch.Generator], device: torch.device | str
) -> Tensor:
    """(len(generators), *shape) standard normals, row i drawn from generator i (fp32)."""
    rows = [torch.randn((1, *shape), generator=g, device=device, dtype=torch.float32) for g in generators]
    return torch.cat(rows)


def first_of_runs(generators: list[torch.Generator]) -> Tensor:
    """Positions where a new noise stream starts (consecutive samples sharing a generator seed)."""
    seeds = [g.initial_seed() for g in generators]
    return torch.tensor([i for i, s in enumerate(seeds) if i == 0 or s != seeds[i - 1]])


def run_ids(generators: list[torch.Generator]) -> Tensor:
    """For each sample, the ordinal of its run of equal noise streams."""
    seeds = [g.initial_seed() for g in generators]
    return torch.tensor(
        [sum(1 for j in range(1, i + 1) if seeds[j] != seeds[j - 1]) for i in range(len(seeds))]
    )
