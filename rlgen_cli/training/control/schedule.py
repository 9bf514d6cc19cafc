"""Learning-rate schedules: the decay shapes every recipe uses, and the flow RL loop's per-epoch one
(``algo.lr_schedule``).

``constant`` leaves the optimizer alone. ``cosine`` and ``linear`` hold ``algo.lr`` for the first
``algo.lr_decay_start`` share of the run (a warm-up-free "stable, then decay" schedule), then decay to
``algo.lr_min_ratio``·``algo.lr`` at its end, so the weights settle instead of drifting when a run ends.

Where the run is (``lr_schedule_clock``): ``epochs`` counts epochs alone, so the decay ends at the last
configured epoch and a ``time_limit_minutes`` that stops the run first cuts it short. ``time_or_epochs``
takes the further along of the epoch count and the time budget: the position is
``max(epoch, time_share · (epochs − 1))``, where ``time_share`` is the share of the time budget the epoch
about to run will have used when it ends (:func:`time_share`), so a slow machine still reaches the end of
the decay at the epoch the limit stops. The time share depends on the machine, so a run whose clock
takes over is not bit-reproducible across machines; one that finishes its epochs within the limit never
lets it take over and matches the ``epochs`` clock exactly.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["apply_lr_schedule", "decay_factor", "epoch_lr", "time_share"]


def decay_factor(progress: float, schedule: str, min_ratio: float = 0.0) -> float:
    """The share of the base learning rate at ``progress`` ∈ [0, 1] through a decay.

    ``cosine`` and ``linear`` go from 1 at progress 0 to ``min_ratio`` at 1; ``constant`` stays at 1.
    """
    if schedule == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress if schedule == "linear" else 1.0
    return min_ratio + (1 - min_ratio) * shape


def time_share(
    train_seconds: float, other_seconds: float, next_epoch_seconds: float, budget_seconds: float
) -> float:
    """The share of a time budget the next epoch will have used when it ends, counting training alone
    against the budget net of the time spent elsewhere (evaluations, checkpoints): ``(train_seconds +
    next_epoch_seconds) / (budget_seconds − other_seconds)``, capped at 1; 0 without a budget.

    Args:
        train_seconds: Seconds spent in epochs so far.
        other_seconds: Seconds of the run's clock spent outside epochs so far.
        next_epoch_seconds: The expected length of the next epoch (the last one's).
        budget_seconds: ``60 · time_limit_minutes``; 0 = no limit.
    """
    if budget_seconds <= 0:
        return 0.0
    left_for_training = budget_seconds - other_seconds
    if left_for_training <= 0:
        return 1.0
    return min(1.0, (train_seconds + next_epoch_seconds) / left_for_training)


def epoch_lr(
    base_lr: float,
    schedule: str,
    epoch: int,
    epochs: int,
    decay_start: float,
    min_ratio: float,
    time_progress: float = 0.0,
    warmup_epochs: int = 0,
) -> float:
    """The learning rate of ``epoch`` (0-based) of ``epochs``.

    Args:
        base_lr: ``algo.lr``.
        schedule: ``constant``, ``cosine`` or ``linear``.
        epoch: The epoch about to run.
        epochs: The run's configured number of epochs.
        decay_start: Share of the run at ``base_lr`` before the decay starts, in [0, 1).
        min_ratio: The last epoch's learning rate as a share of ``base_lr``.
        time_progress: Share of the time budget (:func:`time_share`); the schedule stands at
            ``max(epoch, time_progress · (epochs − 1))``. 0 = epochs alone.
        warmup_epochs: Epochs of linear warm-up (epoch e < W runs at (e + 1)/W of the rate); 0 = none.

    Returns:
        The learning rate.
    """
    warmup = min(1.0, (epoch + 1) / warmup_epochs) if warmup_epochs > 0 else 1.0
    if schedule == "constant":
        return base_lr * warmup
    position = max(float(epoch), time_progress * (epochs - 1))
    first = math.floor(decay_start * epochs)  # the last epoch at base_lr; the decay ends at epochs - 1
    progress = min(1.0, max(0.0, (position - first) / max(1, epochs - 1 - first)))
    return base_lr * warmup * decay_factor(progress, schedule, min_ratio)


def apply_lr_schedule(
    optimizer: Any, algo: Any, epoch: int, epochs: int, time_progress: float = 0.0
) -> float:
    """Set every param group of ``optimizer`` to the learning rate of ``epoch``; returns it.

    ``time_progress``: the run's share of its time budget under ``lr_schedule_clock=time_or_epochs``
    (``FlowRun.time_progress``), 0 under the ``epochs`` clock. A ``constant`` schedule does not touch
    the optimizer unless it warms up (recipes with their own per-step schedule, such as ``flow_pretrain``,
    keep it).
    """
    lr = epoch_lr(
        algo.lr,
        algo.lr_schedule,
        epoch,
        epochs,
        algo.lr_decay_start,
        algo.lr_min_ratio,
        time_progress,
        algo.lr_warmup_epochs,
    )
    if algo.lr_schedule != "constant" or algo.lr_warmup_epochs > 0:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return lr
