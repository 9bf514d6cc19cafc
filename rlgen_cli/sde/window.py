"""Window policies: which denoising steps of a rollout are stochastic, and which of those are trained.

A policy turns ``num_steps`` (T) and a few options into a :class:`WindowPlan`. Steps outside
``sde_steps`` are deterministic ODE steps; only ``train_steps`` are stored and scored by the objective.

* ``all`` (Flow-GRPO, Liu et al. 2025): every step is an SDE step; the first ``int(T·fraction)`` steps are
  stored and trained (0.99 leaves out the last, near-zero-σ step whose likelihood overflows).
* ``random_window`` (Flow-GRPO-Fast): ``size`` consecutive SDE steps whose start is drawn uniformly in
  ``range``; ODE before and after; only the window is trained. ``size=0`` is plain Flow-GRPO.
* ``sliding`` (MixGRPO: Li et al. 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed
  ODE-SDE"): ``size`` consecutive SDE steps that start at the noisiest step and move by ``stride`` every
  ``shift_every`` training iterations (strategies ``progressive``, ``random``, ``decay``, ``exp_decay``).
* ``random_subset`` (DanceGRPO: Xue et al. 2025, "DanceGRPO: Unleashing GRPO on Visual Generation"):
  every step SDE; each sample trains its own random ``timestep_fraction`` of the steps
  (:attr:`WindowPlan.train_mask`).
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


def _sliding_positions(max_start: int, stride: int) -> list[int]:
    """Window starts in visiting order: 0, stride, 2·stride, … and finally ``max_start`` itself."""
    positions = list(range(0, max_start + 1, stride))
    if positions[-1] != max_start:
        positions.append(max_start)  # the last, clipped move: every eligible step gets its turn
    return positions


def _sliding_start(epoch: int, positions: list[int], intervals: list[int], roll_back: bool) -> int:
    """Where the window stands at iteration ``epoch`` when it stays ``intervals[k]`` at ``positions[k]``."""
    if roll_back:
        epoch %= sum(intervals)
    for position, interval in zip(positions, intervals):
        if epoch < interval:
            return position
        epoch -= interval
    return positions[-1]  # no roll-back: the window stays at the end


def _shift_intervals(
    strategy: str,
    positions: list[int],
    end: int,
    shift_every: int,
    min_shift_every: int,
    k: float,
    start: int,
) -> list[int]:
    """Iterations spent at each position (MixGRPO ``GRPOTrainingStates`` semantics).

    ``progressive``: ``shift_every``. ``decay``: linear from ``shift_every`` at start 0 down to
    ``min_shift_every`` at start ``end``: ``max(min, int(max·(1 − p/end) + min·p/end))``.
    ``exp_decay``: ``ceil(shift_every·exp(−k·max(0, p − start)))``.
    """
    if strategy == "decay":
        return [
            max(min_shift_every, int(shift_every * (1 - p / end) + min_shift_every * p / end))
            for p in positions
        ]
    if strategy == "exp_decay":
        return [math.ceil(shift_every * math.exp(-k * max(0, p - start))) for p in positions]
    return [shift_every] * len(positions)


def _sliding(
    num_steps: int,
    *,
    size: int,
    stride: int = 1,
    shift_every: int = 25,
    strategy: str = "progressive",
    roll_back: bool = False,
    end: int | None = None,
    min_shift_every: int | None = None,
    exp_decay_k: float = 0.1,
    exp_decay_start: int = 13,
    epoch: int = 0,
    generator: torch.Generator | None = None,
) -> WindowPlan:
    """MixGRPO: ``size`` SDE (and trained) steps starting where the schedule of ``strategy`` puts them.

    The window starts at step 0 and, every ``shift_every`` iterations (``epoch`` = τ, the training
    iteration), moves ``stride`` steps towards σ = 0 until it ends at ``end`` (default T; upstream uses
    T − 2); there it stays, or restarts at 0 with ``roll_back``. A last move shorter than ``stride``
    lands exactly on ``end − size`` (upstream instead lets the window shrink past the end). ``random``
    draws the start uniformly in ``[0, end − size]`` each call (needs ``generator``; ignores ``epoch``).
    ``decay`` / ``exp_decay`` shorten the stay as the window moves towards σ = 0, following MixGRPO's
    code (its ``max_iters_per_group`` = ``shift_every``, ``min_iters_per_group`` = ``min_shift_every``,
    default ``max(1, shift_every // 4)``; ``exp_decay_thre_timestep`` = ``exp_decay_start``), see
    :func:`_shift_intervals`.
    """
    end = _check_int("sliding", "end", num_steps if end is None else end, 1, num_steps, "window end bound")
    size = _check_int("sliding", "size", size, 1, end, "window length, at most end (default T)")
    stride = _check_int("sliding", "stride", stride, 1, None, "steps moved per shift")
    shift_every = _check_int("sliding", "shift_every", shift_every, 1, None, "iterations per position")
    min_every = max(1, shift_every // 4) if min_shift_every is None else min_shift_every
    min_every = _check_int("sliding", "min_shift_every", min_every, 1, shift_every, "decay floor")
    epoch = _check_int("sliding", "epoch", epoch, 0, None, "training iteration τ")
    exp_decay_start = _check_int("sliding", "exp_decay_start", exp_decay_start, 0, None, "decay onset")
    if strategy not in SLIDING_STRATEGIES:
        raise ValueError(
            f"window 'sliding': strategy={strategy!r}; choose one of {', '.join(SLIDING_STRATEGIES)}"
        )
    if not isinstance(roll_back, bool):
        raise ValueError(f"window 'sliding': roll_back={roll_back!r} must be true or false")
    if not (isinstance(exp_decay_k, (int, float)) and math.isfinite(exp_decay_k) and exp_decay_k >= 0):
        raise ValueError(f"window 'sliding': exp_decay_k={exp_decay_k!r} must be a finite number >= 0")
    max_start = end - size
    if strategy == "random":
        return _consecutive(
            num_steps, _uniform_int(0, max_start, _need_generator("sliding", generator)), size
        )
    positions = _sliding_positions(max_start, stride)
    intervals = _shift_intervals(
        strategy, positions, end, shift_every, min_every, exp_decay_k, exp_decay_start
    )
    return _consecutive(num_steps, _sliding_start(epoch, positions, intervals, roll_back), size)


def _random_subset(
    num_steps: int,
    *,
    timestep_fraction: float = 0.6,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> WindowPlan:
    """DanceGRPO: every step SDE and stored; each sample trains ``int(T·fraction)`` steps of its own.

    ``train_mask`` (B, T) has exactly ``int(T·fraction)`` True entries per row, a uniformly random subset
    (the first entries of a random permutation, as DanceGRPO draws them). Draws B·T floats from
    ``generator``.
    """
    fraction = _check_fraction("random_subset", timestep_fraction)
    batch_size = _check_int("random_subset", "batch_size", batch_size, 1, None, "samples in the rollout")
    trained = int(num_steps * fraction)
    if trained < 1:
        raise ValueError(
            f"window 'random_subset': int({num_steps} steps × timestep_fraction {fraction}) = 0 trained "
            "steps; raise timestep_fraction or num_steps"
        )
    gen = _need_generator("random_subset", generator)
    keys = torch.rand(batch_size, num_steps, generator=gen, device=gen.device)  # (B, T)
    chosen = keys.argsort(dim=1)[:, :trained]  # (B, k): a random permutation's head per sample
    mask = torch.zeros(batch_size, num_steps, dtype=torch.bool, device=gen.device)
    mask.scatter_(1, chosen, True)  # (B, T)
    steps = tuple(range(num_steps))
    return WindowPlan(num_steps, steps, steps, train_mask=mask)


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
            ``size`` and ``range`` (``random_window``), ``size``, ``stride``, ``shift_every``,
            ``strategy``, ``roll_back``, ``end`` (``sliding``), ``max_index`` (``single``).

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
