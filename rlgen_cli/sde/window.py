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

Every random choice is drawn from an explicit ``torch.Generator``; the same generator state gives the
same plan, so ranks that must agree (a group spread over several ranks) pass generators seeded alike.
Steps after :func:`last_sde_step` are pure ODE and may use a faster solver
(:func:`rlgen_cli.sde.solvers.dpm_solver_2m` on :func:`rlgen_cli.sde.solvers.compressed_schedule`, as
MixGRPO-Flash does); that choice belongs to the caller, not to the plan.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["SLIDING_STRATEGIES", "WINDOWS", "WindowPlan", "last_sde_step", "plan_window"]

SLIDING_STRATEGIES = ("progressive", "random", "decay", "exp_decay")

_CONTEXT = ("epoch", "generator", "batch_size")
"""Per-call inputs that :func:`plan_window` hands to the policies that declare them."""


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


def _check_int(kind: str, name: str, value: object, lo: int, hi: int | None, why: str) -> int:
    """``value`` as an int in ``[lo, hi]`` (``hi=None``: no upper bound), else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"window {kind!r}: {name}={value!r} must be an integer {bound} ({why})")
    return value


def _check_fraction(kind: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(
            f"window {kind!r}: timestep_fraction={value!r} must be a number in (0, 1] "
            "(the share of steps that are trained)"
        )
    return float(value)


def _need_generator(kind: str, generator: torch.Generator | None) -> torch.Generator:
    if generator is None:
        raise ValueError(
            f"window {kind!r} draws its steps at random: pass generator=torch.Generator().manual_seed(seed) "
            "(seed it alike on ranks that must agree on the plan)"
        )
    return generator


def _uniform_int(lo: int, hi: int, generator: torch.Generator) -> int:
    """One integer drawn uniformly from ``[lo, hi]`` (inclusive)."""
    return int(torch.randint(lo, hi + 1, (1,), generator=generator, device=generator.device))


def _consecutive(num_steps: int, start: int, size: int) -> WindowPlan:
    """SDE on, and training of, the ``size`` steps from ``start``; ODE elsewhere."""
    steps = tuple(range(start, start + size))
    return WindowPlan(num_steps, steps, steps)


# --------------------------------------------------------------------------------------------- policies


def _all_steps(num_steps: int, *, timestep_fraction: float) -> WindowPlan:
    trained = int(num_steps * timestep_fraction)
    if trained < 1:
        raise ValueError(
            f"int({num_steps} steps × timestep_fraction {timestep_fraction}) = 0 trained steps; raise either"
        )
    return WindowPlan(num_steps, tuple(range(num_steps)), tuple(range(trained)))


def _random_window(
    num_steps: int,
    *,
    size: int,
    range: tuple[int, int] | None = None,  # upstream's ``sde_window_range``
    generator: torch.Generator | None = None,
) -> WindowPlan:
    """Flow-GRPO-Fast: ``size`` SDE steps from a start uniform in ``[lo, hi − size]``.

    ``range`` = (lo, hi) is clipped to ``[0, T]``; ``None`` means (0, T − 1), which keeps the near-zero-σ
    last step out of the window (upstream recommends (0, T // 2)). ``size=0`` is plain Flow-GRPO: every
    step SDE, all but the last trained (equal to ``all`` with fraction (T − 1)/T; upstream Fast turns the
    untrained last step into an ODE step instead). Draws one integer from ``generator``.
    """
    size = _check_int("random_window", "size", size, 0, num_steps, "window length; 0 = all but the last")
    if size == 0:
        return _all_steps(num_steps, timestep_fraction=(num_steps - 1) / num_steps)
    lo, hi = (0, num_steps - 1) if range is None else range
    lo, hi = max(0, int(lo)), min(num_steps, int(hi))
    if hi - lo < size:
        raise ValueError(
            f"window 'random_window': range={range!r} clipped to the {num_steps}-step schedule is "
            f"[{lo}, {hi}), too short for size={size}; need hi − lo >= size: widen range or shrink size"
        )
    start = _uniform_int(lo, hi - size, _need_generator("random_window", generator))
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


def _check_rate(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"window 'sliding': exp_decay_rate={value!r} must be a finite number >= 0")
    return float(value)


def _check_flag(kind: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"window {kind!r}: {name}={value!r} must be true or false")
    return value


def _sliding(
    num_steps: int,
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
    epoch: int = 0,
    generator: torch.Generator | None = None,
) -> WindowPlan:
    """MixGRPO: ``size`` SDE (and trained) steps starting where the schedule of ``strategy`` puts them.

    The window lies before ``end = T − end_offset`` (MixGRPO: T − 2; docs/maths.md §5.4). It starts at
    step 0 and moves ``stride`` steps towards σ = 0 (0: never) each time it has stayed its interval of
    training iterations (``epoch`` = τ), see :func:`_shift_intervals`; after its last position it stays,
    or restarts at 0 with ``roll_back``. ``random`` uses the window at 0 in iteration 0 and then draws
    the start uniformly in ``[0, end − size]`` (MixGRPO draws after each iteration; needs ``generator``).

    ``shrink_at_end`` (MixGRPO): the window keeps moving past ``end − size`` and loses its steps at and
    after ``end``, down to one step (a window longer than ``end`` is cut from the start). MixGRPO would
    then visit an empty window at start ``end``, which its trainer cannot run; that position is left
    out. Without it the last move lands exactly on ``end − size`` and every window is full.

    MixGRPO's names: ``iters_per_group`` = ``shift_every``, ``group_size`` = ``size``,
    ``prog_overlap_step`` = ``stride`` (``size`` without ``prog_overlap``), ``max_iters_per_group`` /
    ``min_iters_per_group`` = ``max_shift_every`` / ``min_shift_every``, ``exp_decay_k`` =
    ``exp_decay_rate``, ``exp_decay_thre_timestep`` = ``exp_decay_start``.
    """
    end_offset = _check_int(
        "sliding", "end_offset", end_offset, 0, num_steps - 1, "steps kept out at the end"
    )
    end = num_steps - end_offset
    if strategy not in SLIDING_STRATEGIES:
        raise ValueError(
            f"window 'sliding': strategy={strategy!r}; choose one of {', '.join(SLIDING_STRATEGIES)}"
        )
    roll_back = _check_flag("sliding", "roll_back", roll_back)
    shrink_at_end = _check_flag("sliding", "shrink_at_end", shrink_at_end)
    if shrink_at_end and strategy != "random":  # a longer window is cut at the end from the start on
        size = _check_int("sliding", "size", size, 1, num_steps, "window length")
    else:
        size = _check_int("sliding", "size", size, 1, end, "window length, at most T − end_offset")
    stride = _check_int("sliding", "stride", stride, 0, None, "steps moved per shift; 0 = never moves")
    shift_every = _check_int("sliding", "shift_every", shift_every, 1, None, "iterations per position")
    max_every = shift_every if max_shift_every is None else max_shift_every
    max_every = _check_int("sliding", "max_shift_every", max_every, 1, None, "decay ceiling")
    min_every = max(1, shift_every // 4) if min_shift_every is None else min_shift_every
    min_every = _check_int("sliding", "min_shift_every", min_every, 1, max_every, "decay floor")
    epoch = _check_int("sliding", "epoch", epoch, 0, None, "training iteration τ")
    onset = _check_int("sliding", "exp_decay_start", exp_decay_start, 0, None, "decay onset")
    rate = _check_rate(exp_decay_rate)
    if strategy == "random":
        gen = _need_generator("sliding", generator)
        start = 0 if epoch == 0 else _uniform_int(0, end - size, gen)
        return _sliding_window(num_steps, start, size, end)
    positions = _sliding_positions(end, size, stride, shrink_at_end)
    intervals = _shift_intervals(strategy, positions, end, shift_every, max_every, min_every, rate, onset)
    return _sliding_window(num_steps, _sliding_start(epoch, positions, intervals, roll_back), size, end)


def _random_subset(
    num_steps: int,
    *,
    timestep_fraction: float = 0.6,
    skip_last_step: bool = True,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> WindowPlan:
    """DanceGRPO: every step SDE; each sample trains a random share of the candidate steps.

    The candidates are the first T − 1 steps with ``skip_last_step`` (DanceGRPO: the step onto σ′ = 0 is
    neither stored nor trained) or all T steps. Each sample trains the first ``int(n·fraction)`` entries
    of its own random permutation of the n candidates, drawn as DanceGRPO does: one
    ``torch.randperm(n)`` per sample, in sample order, from ``generator``. ``train_mask`` is (B, n).
    """
    fraction = _check_fraction("random_subset", timestep_fraction)
    skip_last_step = _check_flag("random_subset", "skip_last_step", skip_last_step)
    batch_size = _check_int("random_subset", "batch_size", batch_size, 1, None, "samples in the rollout")
    candidates = num_steps - 1 if skip_last_step else num_steps
    trained = int(candidates * fraction)
    if trained < 1:
        raise ValueError(
            f"window 'random_subset': int({candidates} candidate steps × timestep_fraction {fraction}) = 0 "
            "trained steps; raise timestep_fraction or num_steps"
            + (" (skip_last_step leaves the last step out)" if skip_last_step else "")
        )
    gen = _need_generator("random_subset", generator)
    perms = [torch.randperm(candidates, generator=gen, device=gen.device) for _ in range(batch_size)]
    chosen = torch.stack(perms)[:, :trained]  # (B, k): the head of each sample's permutation
    mask = torch.zeros(batch_size, candidates, dtype=torch.bool, device=gen.device)
    mask.scatter_(1, chosen, True)  # (B, n)
    return WindowPlan(num_steps, tuple(range(num_steps)), tuple(range(candidates)), train_mask=mask)


def _single(
    num_steps: int, *, max_index: int | None = None, generator: torch.Generator | None = None
) -> WindowPlan:
    """R3: one SDE (and trained) step, uniform among the first ``max_index`` steps (all when ``None``).

    One draw serves the whole batch: seed ``generator`` alike across a policy group (R3 uses 2 for
    editing, ``None`` for generation).
    """
    limit = num_steps if max_index is None else max_index
    limit = _check_int("single", "max_index", limit, 1, num_steps, "candidate steps counted from the start")
    return _consecutive(num_steps, _uniform_int(0, limit - 1, _need_generator("single", generator)), 1)


WINDOWS: dict[str, Callable[..., WindowPlan]] = {
    "all": _all_steps,
    "random_window": _random_window,
    "sliding": _sliding,
    "random_subset": _random_subset,
    "single": _single,
}


def _check_options(kind: str, policy: Callable[..., WindowPlan], options: dict[str, Any]) -> None:
    """Unknown or missing options of ``policy`` raise a ValueError that lists the valid ones."""
    params = inspect.signature(policy).parameters
    valid = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in _CONTEXT]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"window {kind!r} takes no option {', '.join(map(repr, unknown))}; its options are "
            f"{', '.join(valid) or 'none'}"
        )
    missing = [n for n in valid if params[n].default is inspect.Parameter.empty and n not in options]
    if missing:
        raise ValueError(
            f"window {kind!r} needs option {', '.join(map(repr, missing))}; pass it to plan_window"
        )


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
        **options: The policy's own options, e.g. ``timestep_fraction`` (``all``, ``random_subset``),
            ``skip_last_step`` (``random_subset``), ``size`` and ``range`` (``random_window``), ``size``,
            ``stride``, ``shift_every``, ``strategy``, ``roll_back``, ``end_offset``, ``shrink_at_end``,
            ``min_shift_every``, ``max_shift_every``, ``exp_decay_rate``, ``exp_decay_start``
            (``sliding``), ``max_index`` (``single``).

    Returns:
        The :class:`WindowPlan`.

    Raises:
        ValueError: On an unknown ``kind``, an option the policy does not take or needs, or an option
            out of its valid range (the message names it and the range).
    """
    if kind not in WINDOWS:
        raise ValueError(f"unknown window {kind!r}; choose one of {', '.join(WINDOWS)}")
    _check_int(kind, "num_steps", num_steps, 1, None, "denoising steps of the schedule")
    policy = WINDOWS[kind]
    _check_options(kind, policy, options)
    context = {"epoch": epoch, "generator": generator, "batch_size": batch_size}
    params = inspect.signature(policy).parameters
    return policy(num_steps, **{n: v for n, v in context.items() if n in params}, **options)
