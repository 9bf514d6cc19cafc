"""Window policies: which denoising steps of a rollout are stochastic, and which of those are trained.

A policy turns ``num_steps`` (T) and a few options into a :class:`WindowPlan`. Steps outside
``sde_steps`` are deterministic ODE steps; only ``train_steps`` are stored and scored by the objective.

* ``all`` (Flow-GRPO, Liu et al. 2025): every step is an SDE step; the first ``int(T·fraction)`` steps are
  stored and trained (0.99 leaves out the last, near-zero-σ step whose likelihood overflows).
* ``random_window`` (Flow-GRPO-Fast): ``size`` consecutive SDE steps whose start is drawn uniformly in
  ``range``; ODE before and after; only the window is trained. ``size=0`` is plain Flow-GRPO.
* ``sliding`` (MixGRPO: Li et al. 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed
  ODE-SDE"): ``size`` consecutive SDE steps before ``T − end_offset`` that start at the noisiest step and
  move by ``stride`` after a number of training iterations set by the strategy (``progressive``,
  ``random``, ``decay``, ``exp_decay``); see docs/maths.md §5.4.
* ``random_subset`` (DanceGRPO: Xue et al. 2025, "DanceGRPO: Unleashing GRPO on Visual Generation"):
  every step SDE; each sample trains its own random ``timestep_fraction`` of the steps, never the last
  one with ``skip_last_step`` (:attr:`WindowPlan.train_mask`).
* ``single`` (R3 Mix-GRPO loss): exactly one SDE step, drawn once for the whole batch / group.

The options arrive checked from the config (``schema/algo.py`` validates them against ``model.num_steps``
and lists which kind reads which option); here a bad one is a programming error and fails an assert.
Every random choice is drawn from an explicit ``torch.Generator``; the same generator state gives the
same plan, so ranks that must agree (a group spread over several ranks) pass generators seeded alike.
Steps after :func:`last_sde_step` are pure ODE and may use a faster solver
(:func:`rlgen_cli.sde.solvers.dpm_solver_2m` on :func:`rlgen_cli.sde.solvers.compressed_schedule`, as
MixGRPO-Flash does); that choice belongs to the caller, not to the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["WINDOWS", "WindowPlan", "last_sde_step", "plan_window"]


@dataclass(frozen=True)
class Draw:
    """Per-call inputs of a policy: training iteration τ, the source of random choices, rollout size B."""

    epoch: int = 0
    generator: torch.Generator | None = None
    batch_size: int | None = None

    def rng(self, kind: str) -> torch.Generator:
        assert self.generator is not None, f"window {kind!r} draws its steps at random: pass a generator"
        return self.generator


@dataclass(frozen=True, eq=False)
class WindowPlan:
    """The plan of one rollout: step indices in ``range(num_steps)``; ``train_steps ⊆ sde_steps``.

    Attributes:
        num_steps: T, the number of denoising steps of the schedule.
        sde_steps: Steps sampled with the stochastic kernel (all others are ODE steps).
        train_steps: Steps the rollout stores, S = ``len(train_steps)``.
        train_mask: ``None`` (every stored step is trained for every sample) or a ``(B, S)`` bool tensor:
            ``train_mask[b, j]`` says whether sample ``b`` trains on step ``train_steps[j]``
            (DanceGRPO's per-sample subset). The rollout still stores all S steps for every sample; the
            recipe multiplies the per-sample, per-step loss ``(B, S)`` by the mask and averages over the
            True entries, so masked-out steps contribute neither loss nor gradient.
    """

    num_steps: int
    sde_steps: tuple[int, ...]
    train_steps: tuple[int, ...]
    train_mask: Tensor | None = None

    def __post_init__(self) -> None:
        if not set(self.train_steps) <= set(self.sde_steps):
            raise ValueError(
                f"trained steps {self.train_steps} must be stochastic (sde steps {self.sde_steps})"
            )
        if any(not 0 <= i < self.num_steps for i in self.sde_steps):
            raise ValueError(f"sde steps {self.sde_steps} fall outside range({self.num_steps})")
        mask = self.train_mask
        if mask is not None and (
            mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[1] != len(self.train_steps)
        ):
            raise ValueError(
                f"train_mask must be a (B, S={len(self.train_steps)}) bool tensor, one column per train "
                f"step; got dtype {mask.dtype} and shape {tuple(mask.shape)}"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WindowPlan):
            return NotImplemented
        same_mask = (self.train_mask is None and other.train_mask is None) or (
            self.train_mask is not None
            and other.train_mask is not None
            and torch.equal(self.train_mask.cpu(), other.train_mask.cpu())
        )
        return (self.num_steps, self.sde_steps, self.train_steps) == (
            other.num_steps,
            other.sde_steps,
            other.train_steps,
        ) and same_mask

    def __hash__(self) -> int:
        return hash((self.num_steps, self.sde_steps, self.train_steps))


def last_sde_step(plan: WindowPlan) -> int | None:
    """The index of the last stochastic step of ``plan``, or ``None`` when it has none.

    Steps ``last_sde_step(plan) + 1 …`` are pure ODE: the caller may integrate them with a faster solver
    from ``sigmas[last_sde_step(plan) + 1]`` on (MixGRPO-Flash).
    """
    return max(plan.sde_steps) if plan.sde_steps else None


# ---------------------------------------------------------------------------------------------- helpers


def _uniform_int(lo: int, hi: int, generator: torch.Generator) -> int:
    """One integer drawn uniformly from ``[lo, hi]`` (inclusive)."""
    return int(torch.randint(lo, hi + 1, (1,), generator=generator, device=generator.device))


def _consecutive(num_steps: int, start: int, size: int) -> WindowPlan:
    """SDE on, and training of, the ``size`` steps from ``start``; ODE elsewhere."""
    steps = tuple(range(start, start + size))
    return WindowPlan(num_steps, steps, steps)


# --------------------------------------------------------------------------------------------- policies


def _all_steps(num_steps: int, draw: Draw, *, timestep_fraction: float) -> WindowPlan:
    trained = int(num_steps * timestep_fraction)
    assert trained >= 1, (num_steps, timestep_fraction)
    return WindowPlan(num_steps, tuple(range(num_steps)), tuple(range(trained)))


def _random_window(
    num_steps: int,
    draw: Draw,
    *,
    size: int,
    range: tuple[int, int] | None = None,  # upstream's ``sde_window_range``
) -> WindowPlan:
    """Flow-GRPO-Fast: ``size`` SDE steps from a start uniform in ``[lo, hi − size]``.

    ``range`` = (lo, hi) is clipped to ``[0, T]``; ``None`` means (0, T − 1), which keeps the near-zero-σ
    last step out of the window (upstream recommends (0, T // 2)). ``size=0`` is plain Flow-GRPO: every
    step SDE, all but the last trained (equal to ``all`` with fraction (T − 1)/T; upstream Fast turns the
    untrained last step into an ODE step instead). Draws one integer from the generator.
    """
    if size == 0:
        return _all_steps(num_steps, draw, timestep_fraction=(num_steps - 1) / num_steps)
    lo, hi = (0, num_steps - 1) if range is None else range
    lo, hi = max(0, int(lo)), min(num_steps, int(hi))
    assert 0 < size <= hi - lo, (size, range, num_steps)
    start = _uniform_int(lo, hi - size, draw.rng("random_window"))
    return _consecutive(num_steps, start, size)


def _sliding_positions(end: int, size: int, stride: int, shrink_at_end: bool) -> list[int]:
    """Window starts in visiting order.

    ``stride`` 0: the window never moves. ``shrink_at_end`` (MixGRPO): 0, stride, 2·stride, … while the
    window keeps at least one step before ``end``; the last windows lose their steps past ``end``.
    Otherwise 0, stride, … up to ``end − size`` and then ``end − size`` itself (a shorter last move), so
    every window has ``size`` steps and every step before ``end`` gets its turn.
    """
    if stride == 0:
        return [0]
    if shrink_at_end:
        return list(range(0, end, stride))
    max_start = end - size
    positions = list(range(0, max_start + 1, stride))
    if positions[-1] != max_start:
        positions.append(max_start)
    return positions


def _sliding_start(epoch: int, positions: list[int], intervals: list[int], roll_back: bool) -> int:
    """Where the window stands at iteration ``epoch`` when it stays ``intervals[k]`` at ``positions[k]``."""
    if roll_back:
        epoch %= sum(intervals)
    for position, interval in zip(positions, intervals):
        if epoch < interval:
            return position
        epoch -= interval
    return positions[-1]  # no roll-back: the window stays at its last position


def _shift_intervals(
    strategy: str,
    positions: list[int],
    end: int,
    shift_every: int,
    max_every: int,
    min_every: int,
    rate: float,
    onset: int,
) -> list[int]:
    """Iterations the window stays at each of ``positions`` (MixGRPO's shift-interval rules).

    ``progressive``: ``shift_every``. ``decay``: linear in the start p, from ``max_every`` at p = 0
    towards ``min_every`` at p = ``end``, truncated: ``max(min, int(max·(1 − p/end) + min·p/end))``.
    ``exp_decay``: ``ceil(shift_every·exp(−rate·max(0, p − onset)))``. An interval is never below one
    iteration (MixGRPO moves at the earliest after the iteration that used the window).
    """
    if strategy == "decay":
        return [max(min_every, int(max_every * (1 - p / end) + min_every * p / end)) for p in positions]
    if strategy == "exp_decay":
        return [max(1, math.ceil(shift_every * math.exp(-rate * max(0, p - onset)))) for p in positions]
    return [shift_every] * len(positions)


def _sliding_window(num_steps: int, start: int, size: int, end: int) -> WindowPlan:
    """SDE on, and training of, steps ``start … min(start + size, end) − 1``; ODE elsewhere."""
    return _consecutive(num_steps, start, min(size, end - start))


def _sliding(
    num_steps: int,
    draw: Draw,
    *,
    size: int,
    stride: int = 1,
    shift_every: int = 25,
    strategy: str = "progressive",
    roll_back: bool = False,
    end_offset: int = 0,
    shrink_at_end: bool = False,
    min_shift_every: int | None = None,
    max_shift_every: int | None = None,
    exp_decay_rate: float = 0.1,
    exp_decay_start: int = 13,
) -> WindowPlan:
    """MixGRPO: ``size`` SDE (and trained) steps starting where the schedule of ``strategy`` puts them.

    The window lies before ``end = T − end_offset`` (MixGRPO: T − 2; docs/maths.md §5.4). It starts at
    step 0 and moves ``stride`` steps towards σ = 0 (0: never) each time it has stayed its interval of
    training iterations (``draw.epoch`` = τ), see :func:`_shift_intervals`; after its last position it stays,
    or restarts at 0 with ``roll_back``. ``random`` uses the window at 0 in iteration 0 and then draws
    the start uniformly in ``[0, end − size]`` (MixGRPO draws after each iteration; needs a generator).

    ``shrink_at_end`` (MixGRPO): the window keeps moving past ``end − size`` and loses its steps at and
    after ``end``, down to one step (a window longer than ``end`` is cut from the start). MixGRPO would
    then visit an empty window at start ``end``, which its trainer cannot run; that position is left
    out. Without it the last move lands exactly on ``end − size`` and every window is full.

    MixGRPO's names: ``iters_per_group`` = ``shift_every``, ``group_size`` = ``size``,
    ``prog_overlap_step`` = ``stride`` (``size`` without ``prog_overlap``), ``max_iters_per_group`` /
    ``min_iters_per_group`` = ``max_shift_every`` / ``min_shift_every``, ``exp_decay_k`` =
    ``exp_decay_rate``, ``exp_decay_thre_timestep`` = ``exp_decay_start``.
    """
    end = num_steps - end_offset
    longest = num_steps if shrink_at_end and strategy != "random" else end  # a longer window is cut
    assert 0 <= end_offset < num_steps and 1 <= size <= longest, (num_steps, end_offset, size)
    max_every = shift_every if max_shift_every is None else max_shift_every
    min_every = max(1, shift_every // 4) if min_shift_every is None else min_shift_every
    if strategy == "random":
        start = 0 if draw.epoch == 0 else _uniform_int(0, end - size, draw.rng("sliding"))
        return _sliding_window(num_steps, start, size, end)
    positions = _sliding_positions(end, size, stride, shrink_at_end)
    intervals = _shift_intervals(
        strategy, positions, end, shift_every, max_every, min_every, exp_decay_rate, exp_decay_start
    )
    start = _sliding_start(draw.epoch, positions, intervals, roll_back)
    return _sliding_window(num_steps, start, size, end)


def _random_subset(
    num_steps: int, draw: Draw, *, timestep_fraction: float = 0.6, skip_last_step: bool = True
) -> WindowPlan:
    """DanceGRPO: every step SDE; each sample trains a random share of the candidate steps.

    The candidates are the first T − 1 steps with ``skip_last_step`` (DanceGRPO: the step onto σ′ = 0 is
    neither stored nor trained) or all T steps. Each sample trains the first ``int(n·fraction)`` entries
    of its own random permutation of the n candidates, drawn as DanceGRPO does: one
    ``torch.randperm(n)`` per sample, in sample order, from the generator. ``train_mask`` is (B, n).
    """
    candidates = num_steps - 1 if skip_last_step else num_steps
    trained = int(candidates * timestep_fraction)
    batch_size = draw.batch_size
    assert trained >= 1 and batch_size is not None and batch_size >= 1, (candidates, trained, batch_size)
    gen = draw.rng("random_subset")
    perms = [torch.randperm(candidates, generator=gen, device=gen.device) for _ in range(batch_size)]
    chosen = torch.stack(perms)[:, :trained]  # (B, k): the head of each sample's permutation
    mask = torch.zeros(batch_size, candidates, dtype=torch.bool, device=gen.device)
    mask.scatter_(1, chosen, True)  # (B, n)
    return WindowPlan(num_steps, tuple(range(num_steps)), tuple(range(candidates)), train_mask=mask)


def _single(num_steps: int, draw: Draw, *, max_index: int | None = None) -> WindowPlan:
    """R3: one SDE (and trained) step, uniform among the first ``max_index`` steps (all when ``None``).

    One draw serves the whole batch: seed the generator alike across a policy group (R3 uses 2 for
    editing, ``None`` for generation).
    """
    limit = num_steps if max_index is None else max_index
    assert 1 <= limit <= num_steps, (max_index, num_steps)
    return _consecutive(num_steps, _uniform_int(0, limit - 1, draw.rng("single")), 1)


WINDOWS: dict[str, Callable[..., WindowPlan]] = {
    "all": _all_steps,
    "random_window": _random_window,
    "sliding": _sliding,
    "random_subset": _random_subset,
    "single": _single,
}


def plan_window(
    kind: str,
    num_steps: int,
    *,
    epoch: int = 0,
    generator: torch.Generator | None = None,
    batch_size: int | None = None,
    **options: Any,
) -> WindowPlan:
    """The plan of window policy ``kind`` for a rollout of ``num_steps`` steps.

    Args:
        kind: A key of :data:`WINDOWS`.
        num_steps: T, the number of denoising steps.
        epoch: Training iteration τ (``sliding`` moves its window with it); ignored by other policies.
        generator: Source of every random choice (``random_window``, ``sliding`` with
            ``strategy="random"``, ``random_subset``, ``single``); ignored by deterministic policies.
        batch_size: B, the number of samples in the rollout (``random_subset``'s mask); ignored otherwise.
        **options: The policy's own keyword options (its signature above; which kind reads which
            ``algo.window`` key is ``schema.algo.WINDOW_OPTIONS``).

    Returns:
        The :class:`WindowPlan`.

    An unknown ``kind`` or option is a programming error (the config boundary checks them): it raises
    ``KeyError`` / ``TypeError``.
    """
    assert num_steps >= 1, num_steps
    return WINDOWS[kind](num_steps, Draw(epoch, generator, batch_size), **options)
