"""Learning-rate schedules: the decay shapes every recipe uses, and the flow RL loop's per-epoch one
(``algo.lr_schedule``).

``constant`` leaves the optimizer alone. ``cosine`` and ``linear`` hold ``algo.lr`` for the first
``algo.lr_decay_start`` share of the epochs (a warm-up-free "stable, then decay" schedule), then decay
to ``algo.lr_min_ratio``·``algo.lr`` at the last epoch, so the weights settle instead of drifting when
a run ends.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["apply_lr_schedule", "decay_factor", "epoch_lr"]


def decay_factor(progress: float, schedule: str, min_ratio: float = 0.0) -> float:
    """The share of the base learning rate at ``progress`` ∈ [0, 1] through a decay.

    ``cosine`` and ``linear`` go from 1 at progress 0 to ``min_ratio`` at 1; ``constant`` stays at 1.
    """
    if schedule == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress if schedule == "linear" else 1.0
    return min_ratio + (1 - min_ratio) * shape


def epoch_lr(
    base_lr: float, schedule: str, epoch: int, epochs: int, decay_start: float, min_ratio: float
) -> float:
    """The learning rate of ``epoch`` (0-based) of ``epochs``.

    Args:
        base_lr: ``algo.lr``.
        schedule: ``constant``, ``cosine`` or ``linear``.
        epoch: The epoch about to run.
        epochs: The run's configured number of epochs.
        decay_start: Share of the epochs at ``base_lr`` before the decay starts, in [0, 1).
        min_ratio: The last epoch's learning rate as a share of ``base_lr``.

    Returns:
        The learning rate.
    """
    if schedule == "constant":
        return base_lr
    first = math.floor(decay_start * epochs)  # the last epoch at base_lr; the decay ends at epochs - 1
    progress = min(1.0, max(0.0, (epoch - first) / max(1, epochs - 1 - first)))
    return base_lr * decay_factor(progress, schedule, min_ratio)


def apply_lr_schedule(optimizer: Any, algo: Any, epoch: int, epochs: int) -> float:
    """Set every param group of ``optimizer`` to the learning rate of ``epoch``; returns it.

    A ``constant`` schedule does not touch the optimizer (recipes with their own per-step schedule,
    such as ``flow_pretrain``, keep it).
    """
    lr = epoch_lr(algo.lr, algo.lr_schedule, epoch, epochs, algo.lr_decay_start, algo.lr_min_ratio)
    if algo.lr_schedule != "constant":
        for group in optimizer.param_groups:
            group["lr"] = lr
    return lr
