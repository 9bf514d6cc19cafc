"""Small pieces every training loop shares: when periodic work is due, timing, and how per-micro-batch
and per-rank statistics become one number per epoch."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rlgen_cli.training.checkpoint import Checkpoint, resolve_resume

log = logging.getLogger(__name__)

# statistics whose extremes matter (the rest are averaged), and counts (summed over ranks)
EXTREMES: dict[str, Callable[[Sequence[float]], float]] = {
    "ratio_min": min, "ratio_max": max, "logp_gap_max": max,
}  # fmt: skip
COUNTS = ("trained_samples", "tokens")


def due(epoch: int, every: int, total: int) -> bool:
    """Periodic work after ``epoch`` (0-based): every ``every`` epochs and always after the last."""
    return epoch + 1 == total or (every > 0 and (epoch + 1) % every == 0)


@contextmanager
def timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds the block takes under ``timings[key]``."""
    start = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - start


def _base(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def summarise(stats: dict[str, list[float]]) -> dict[str, float]:
    """Micro-batch statistics → one value each: the extremes of :data:`EXTREMES`, else the mean."""
    return {
        key: EXTREMES[_base(key)](values) if _base(key) in EXTREMES else sum(values) / len(values)
        for key, values in stats.items()
    }


def reduce_over_ranks(dist: Any, stats: dict[str, float]) -> dict[str, float]:
    """Per-rank scalars → run-wide ones: extremes for :data:`EXTREMES`, sums for :data:`COUNTS`, else the
    mean (ranks hold equal numbers of samples)."""
    if dist.world_size == 1 or not stats:
        return stats
    keys = sorted(stats)
    table = dist.gather(torch.tensor([[float(stats[k]) for k in keys]], dtype=torch.float64)).cpu()  # (W, K)
    reducers = {"ratio_min": torch.min, "ratio_max": torch.max, "logp_gap_max": torch.max}
    reducers |= dict.fromkeys(COUNTS, torch.sum)
    return {k: float(reducers.get(_base(k), torch.mean)(table[:, i])) for i, k in enumerate(keys)}


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: allocated CUDA memory, or this process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def load_resume(resume: str | None, run_dir: Path, policy: Any) -> tuple[Checkpoint, dict[str, Any]] | None:
    """The checkpoint ``resume`` names (``auto``: the run's latest intact one) with its trained weights
    loaded into ``policy``, and its trainer state; ``None`` for a fresh run. Each recipe restores the
    rest of the state (optimizer, sampler, counters, …) itself."""
    ckpt = resolve_resume(resume, run_dir)
    if ckpt is None:
        return None
    state = ckpt.state()
    policy.load_trainable(ckpt.weights)
    log.info("resuming from %s", ckpt.path)
    return ckpt, state


def headline(metrics: dict[str, float]) -> str:
    """The epoch's one-number summary: the reward, or the loss of an epoch without rollouts."""
    if "reward/mean" in metrics:
        return f"reward {metrics['reward/mean']:+.4g}"
    return f"loss {metrics.get('loss', float('nan')):.4g}"
