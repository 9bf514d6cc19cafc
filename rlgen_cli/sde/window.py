"""Window policies: which denoising steps of a rollout are stochastic, and which of those are trained.

* ``all`` (Flow-GRPO, Liu et al. 2025): every step is an SDE step; the first ``int(T·fraction)`` steps are
  stored and trained (0.99 leaves out the last, near-zero-σ step whose likelihood overflows).

Later policies (Fast's random window, MixGRPO's sliding window, DanceGRPO's random subset, R3's single
step) plug in here as further entries of :data:`WINDOWS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WINDOWS", "WindowPlan", "plan_window"]


@dataclass(frozen=True)
class WindowPlan:
    """The plan of one rollout: step indices in ``range(num_steps)``; ``train_steps ⊆ sde_steps``."""

    num_steps: int
    sde_steps: tuple[int, ...]
    train_steps: tuple[int, ...]

    def __post_init__(self) -> None:
        if not set(self.train_steps) <= set(self.sde_steps):
            raise ValueError(f"trained steps {self.train_steps} must be stochastic (sde steps {self.sde_steps})")
        if any(not 0 <= i < self.num_steps for i in self.sde_steps):
            raise ValueError(f"sde steps {self.sde_steps} fall outside range({self.num_steps})")


def _all_steps(num_steps: int, *, timestep_fraction: float) -> WindowPlan:
    trained = int(num_steps * timestep_fraction)
    if trained < 1:
        raise ValueError(
            f"int({num_steps} steps × timestep_fraction {timestep_fraction}) = 0 trained steps; raise either"
        )
    return WindowPlan(num_steps, tuple(range(num_steps)), tuple(range(trained)))


WINDOWS: dict[str, Callable[..., WindowPlan]] = {"all": _all_steps}


def plan_window(kind: str, num_steps: int, **options: float) -> WindowPlan:
    """The plan of window policy ``kind`` for a rollout of ``num_steps`` steps."""
    if kind not in WINDOWS:
        raise ValueError(f"unknown window {kind!r}; choose one of {', '.join(WINDOWS)}")
    return WINDOWS[kind](num_steps, **options)
