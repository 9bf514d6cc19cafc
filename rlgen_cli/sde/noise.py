"""Per-sample random streams, so a sample's noise depends on who it is, not on how it was batched.

Each sample gets its own ``torch.Generator`` seeded from (run seed, epoch, sample key). The key is the
sample's position in the epoch's global batch — or its group id when a group shares noise (DanceGRPO's
shared initial noise, R3's policy groups). Rollouts are then identical whatever the rollout batch size
or the number of processes the epoch is split over.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum, unique

import torch
from torch import Tensor

__all__ = ["Stream", "randn_per_sample", "sample_generators", "standard_normal", "stream_seed"]


@unique
class Stream(IntEnum):
    """The salt of every independent random stream, in one place so no two uses can share one.

    A stream is (seed, epoch, key, salt); two uses with the same salt would draw the same numbers.
    ``unique`` makes a duplicated value an import error. Changing a value changes what that use draws.
    """

    INITIAL_NOISE = 0  # x_T of each sample
    STEP_NOISE = 1  # the SDE steps' noise
    WINDOW = 2  # which steps a random window / subset trains on
    VLM_ROLLOUT = 3  # token GRPO / StepGRPO: the text sampling of each rollout batch
    R3_TEXT = 4  # R3: the text sampling of the policy's stage
    PRETRAIN_BATCH = 5  # flow pretraining: rows, scenes and dropped prompts of a batch
    PRETRAIN_NOISE = 6  # flow pretraining: σ and ε
    PREF_SIGMA = 7  # Flow-DPO / SFT: the training σ and ε
    ZERO_ADVANTAGE_FILL = 8  # which zero-advantage samples fill a micro-batch
    R3_BUFFER = 9  # R3: the stage-one buffer's draws
    FORWARD_NOISE = 10  # DiffusionNFT / AWM: the trained σ of each sample and the forward noise ε
    KL_PROBE = 11  # DiffusionNFT / AWM: the noise ε of the measured distance to the reference
    ONPOLICY_PERTURB = 0x5EED  # check-onpolicy: the perturbation (added to the seed, not a stream salt)


_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads nearby integers over 64 bits
_MASK = (1 << 63) - 1


def stream_seed(seed: int, epoch: int, key: int, salt: Stream) -> int:
    """A 63-bit seed for stream (seed, epoch, key, salt); distinct inputs give unrelated seeds."""
    value = 0
    for part in (seed, epoch, key, salt):
        value = ((value ^ (part & _MASK)) * _MIX + 0x632BE59BD9B4E019) & _MASK
        value ^= value >> 29
    return value


def sample_generators(
    seed: int, epoch: int, keys: Sequence[int], device: torch.device | str = "cpu", *, salt: Stream
) -> list[torch.Generator]:
    """One generator per sample key of stream ``salt``."""
    return [torch.Generator(device=device).manual_seed(stream_seed(seed, epoch, k, salt)) for k in keys]


def randn_per_sample(
    shape: Sequence[int], generators: Sequence[torch.Generator], device: torch.device | str
) -> Tensor:
    """(len(generators), *shape) standard normals, row i drawn from generator i (fp32)."""
    rows = [torch.randn((1, *shape), generator=g, device=device, dtype=torch.float32) for g in generators]
    return torch.cat(rows)


def standard_normal(
    n: int,
    shape: Sequence[int],
    generator: torch.Generator | Sequence[torch.Generator] | None,
    device: torch.device | str,
) -> Tensor:
    """(n, *shape) fp32 standard normals: from one generator (or the global RNG) for all rows, or row i
    from ``generator[i]`` (the per-sample streams that make results independent of batching)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn((n, *shape), generator=generator, device=device, dtype=torch.float32)
    return randn_per_sample(shape, generator[:n], device)


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
