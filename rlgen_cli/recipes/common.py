"""What every training recipe shares, as plain functions: when periodic work is due (:func:`due`),
timing (:func:`timed`), how per-micro-batch and per-rank statistics become one number per epoch
(:func:`summarise`, :func:`reduce_over_ranks`), the gradient accumulation a process runs, peak memory,
the KL probe's rows, a progress bar for a block, resume / full-state checkpoints of a recipe that holds
its own optimizer (:func:`load_resume`, :func:`save_trainer_checkpoint`), and what the epoch session asks
of a run (:class:`Run`, :class:`TimeLimit`).

What a flow run holds and does (policy, reward, prompts, evaluation, checkpoints) is ``recipes/flow_run.py``;
the epoch session every recipe runs in is ``recipes/session.py``.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig

from rlgen_cli.training.checkpoints.checkpoint import (
    COUNTERS_KEY,
    OPTIMIZER_KEY,
    Checkpoint,
    engine_staging,
    resolve_resume,
    save_checkpoint,
)
from rlgen_cli.training.checkpoints.resume_config import check_resume_config
from rlgen_cli.training.distributed.dist import Dist
from rlgen_cli.training.reporting.progress import Progress

log = logging.getLogger(__name__)

# statistics whose extremes matter (the rest are averaged), and counts (summed over ranks)
EXTREMES: dict[str, Callable[[Sequence[float]], float]] = {
    "ratio_min": min, "ratio_max": max, "logp_gap_max": max,
}  # fmt: skip
COUNTS = ("trained_samples", "tokens")
REPLICATED = ("grad_norm",)
"""Statistics every rank computes alike (the norm of the reduced gradient): rank 0's are the run's."""
REWARD_CURVE = "reward_curve.png"


@dataclass(frozen=True)
class TimeLimit:
    """A run's time limit: ``minutes`` (0: none), what they count (``time_limit_counts``) and whether the lr
    schedule follows the time used (``lr_schedule_clock``)."""

    minutes: float = 0.0
    counts: str = "wall"
    schedule_clock: str = "epochs"


class Run(Protocol):
    """What the epoch session (``recipes/session.py``) asks of a run: its processes, epochs and counters, and the work around an epoch."""

    cfg: Any  # reads ``epochs`` and ``progress``
    dist: Dist
    run_dir: Path
    start_epoch: int
    train_seconds: float
    clock_seconds: float
    last_epoch_seconds: float
    time_progress: float
    unit: str
    """What one pass of the loop is called in bars and lines: ``epoch`` (R3: ``step``)."""

    def time_limit(self) -> TimeLimit:
        """The run's time limit (none for a recipe without one)."""

    def evaluate_before(self, progress: Progress) -> dict[str, float] | None:
        """The evaluation of the starting weights (logged at step 0), or None."""

    def evaluate_if_due(
        self, epoch: int, last: bool, progress: Progress, extra_state: dict[str, Any] | None
    ) -> dict[str, float]:
        """The evaluation after ``epoch`` when one is due (its metrics), else {}; ``extra_state`` goes into
        a checkpoint the evaluation saves (the guard's best one), as into :meth:`save_if_due`'s."""

    def stop_requested(self) -> bool:
        """Whether a guard asked the run to stop after this epoch."""

    def log_epoch(self, epoch: int, metrics: dict[str, float], console: str) -> None:
        """``metrics`` to the loggers and ``epoch N  <console>`` to the console, at the epoch's step."""

    def save_if_due(self, epoch: int, last: bool, extra_state: dict[str, Any] | None) -> None:
        """A checkpoint after ``epoch`` when one is due (always after the last)."""

    def draw_curves(self) -> None:
        """The run's curves from what ``metrics.jsonl`` holds (rank 0; a Ctrl-C draws them too)."""

    def finish(self, before: dict[str, float] | None, after: dict[str, float]) -> None:
        """What the run writes at its normal end (rank 0: curves, report)."""

    def close(self) -> None:
        """Close the loggers (every rank, normal end or not)."""


KL_TO_REFERENCE = "kl_to_ref"
"""The measured distance to the reference, logged whatever ``algo.kl_weight`` (``kl_loss`` is 0 without it)."""

KL_PROBE_SAMPLES = 4
"""How many samples measure ``kl_to_ref``: the epoch's first by global position, each in a forward of its
own, so the same samples in the same forwards give the logged number on any process count."""


def kl_probe_rows(positions: Sequence[int]) -> list[tuple[int, bool]]:
    """:data:`KL_PROBE_SAMPLES` (row, measured) pairs on every process (positions: each row's place in the
    global batch): its rows holding one of the epoch's first samples, then its first row again, unmeasured,
    until there are KL_PROBE_SAMPLES. Every process runs as many probe forwards, which FSDP and ZeRO-3 need:
    each forward gathers the weights from all processes. Empty on a process without samples."""
    if not positions:
        return []
    probes = [(i, True) for i, p in enumerate(positions) if p < KL_PROBE_SAMPLES]
    return probes + [(0, False)] * (KL_PROBE_SAMPLES - len(probes))


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
        key: EXTREMES[_base(key)](values) if _base(key) in EXTREMES else _mean(values)
        for key, values in stats.items()
    }


@dataclass(frozen=True)
class Weighted:
    """Values that stand for different numbers of samples (a rollout batch's mean and its size): their
    run-wide mean is Σ weight·value / Σ weight."""

    values: list[float]
    weights: list[float]


Pooled = float | Sequence[float] | Weighted
"""One rank's share of a statistic: a list of per-micro-batch (or per-sample) values, a :class:`Weighted`
list, or one number (a count, an extreme, a value every rank holds)."""


def reduce_over_ranks(dist: Any, stats: dict[str, Pooled]) -> dict[str, float]:
    """Every rank's values → run-wide numbers, the same on any process count: the ranks' values are pooled
    (one gather) and reduced once — extremes for :data:`EXTREMES`, sums for :data:`COUNTS`, rank 0's
    value for :data:`REPLICATED`, else the mean over ALL values (``math.fsum`` / their count or weight:
    the exactly rounded sum, so the order the ranks' values meet in changes no bit). A rank's mean of
    its own values would make the logged number depend on how the values were split over ranks."""
    keys = sorted(stats)
    local = [_as_weighted(stats[k]) for k in keys]
    shares = dist.gather_object(local) if dist.world_size > 1 else [local]
    out = {}
    for i, key in enumerate(keys):
        if _base(key) in REPLICATED:
            out[key] = _weighted_mean(shares[0][i])
            continue
        values = [v for share in shares for v in share[i].values]
        weights = [w for share in shares for w in share[i].weights]
        if _base(key) in EXTREMES:
            out[key] = float(EXTREMES[_base(key)](values))
        elif _base(key) in COUNTS:
            out[key] = math.fsum(values)
        else:
            out[key] = _weighted_mean(Weighted(values, weights))
    return out


def _as_weighted(value: Pooled) -> Weighted:
    if isinstance(value, Weighted):
        return Weighted([float(v) for v in value.values], [float(w) for w in value.weights])
    values = [float(value)] if isinstance(value, int | float) else [float(v) for v in value]
    return Weighted(values, [1.0] * len(values))


def _weighted_mean(pooled: Weighted) -> float:
    total = math.fsum(pooled.weights)
    return math.fsum(w * v for v, w in zip(pooled.values, pooled.weights, strict=True)) / total


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def accumulation_per_process(algo: Any, world_size: int) -> int:
    """Micro-batches one of ``world_size`` processes accumulates per optimizer step:
    ``algo.gradient_accumulation_steps`` counts them over all processes (null: one per process); the
    schema has checked that it splits (``AlgoConfig.require_process_split``)."""
    steps = algo.gradient_accumulation_steps or world_size
    assert steps % world_size == 0, (steps, world_size)
    return steps // world_size


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: allocated CUDA memory, or this process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def load_resume(
    resume: str | None,
    run_dir: Path,
    load_weights: Callable[[Path], None],
    config: DictConfig,
    unverified: bool = False,
) -> tuple[Checkpoint, dict[str, Any]] | None:
    """The checkpoint ``resume`` names (``auto``: the run's latest intact one), its trained weights
    loaded by ``load_weights`` (what wrote them, read back: e.g. a VLM policy's ``load_trainable``), and
    its trainer state; ``None`` for a fresh run. Each recipe restores the rest of the state (optimizer,
    sampler, counters, …) itself. ``config``: this run's, which must not differ from the checkpoint's in
    what training computes (``check_resume_config``; these recipes' schedules span ``epochs``).
    ``unverified``: ``resume_unverified`` (a checkpoint without a manifest)."""
    ckpt = resolve_resume(resume, run_dir, unverified)
    if ckpt is None:
        return None
    check_resume_config(ckpt.path, ckpt.config(), config, schedule_uses_length=True)
    state = ckpt.state()
    load_weights(ckpt.weights)
    log.info("resuming from %s", ckpt.path)
    return ckpt, state


def save_trainer_checkpoint(
    dist: Dist,
    run_dir: Path,
    epochs_done: int,
    global_step: int,
    optimizer: torch.optim.Optimizer,
    save_weights: Callable[[Path], None],
    entries: dict[str, Any],
    raw_cfg: DictConfig,
    keep_last: int,
) -> None:
    """A full-state checkpoint of a recipe that holds its own optimizer (VLM, R3): the optimizer state,
    the counters, the recipe's ``entries`` and the weights ``save_weights`` writes. Every rank calls (the
    optimizer state may be a collective); rank 0 writes."""
    staging = engine_staging(run_dir, epochs_done)  # DeepSpeed's per-rank optimizer shards
    state = {
        OPTIMIZER_KEY: dist.optimizer_state(optimizer, staging),
        COUNTERS_KEY: {"epoch": epochs_done, "global_step": global_step}, **entries,
    }  # fmt: skip
    if not dist.is_main:
        return
    ckpt = save_checkpoint(
        run_dir,
        epochs_done,
        save_weights,
        state,
        raw_cfg,
        keep_last,
        engine_state=staging if dist.shards_optimizer else None,
    )
    log.info("saved %s", ckpt.path)


@contextmanager
def progress_task(progress: Progress, name: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar for the block; yields ``advance(n)`` (what ``sde.sampling``'s ``on_batch`` takes)."""
    task = progress.task(name, total=total)
    try:
        yield lambda n: progress.advance(task, n)
    finally:
        progress.remove(task)
