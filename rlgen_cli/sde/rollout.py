"""Rollouts that record a typed trajectory, and the recompute of a stored step's log-probability.

Both take the model as ``velocity(x, sigma) -> v`` (the conditioning bound by the caller), so this module
stays pure tensor maths. Sampling and training call the same :func:`rlgen_cli.sde.step.step` with the
same settings (:class:`StepSpec`), which is what makes the on-policy importance ratio exactly 1.

:func:`recompute_steps` scores several stored steps with ONE velocity call: the rows of every step are
stacked on the batch dim, each with its own x_t and σ (a fold). Each row's step maths is the same as
:func:`recompute_step`'s, so the log-probs equal the per-step ones wherever the model's per-row outputs do
not depend on the batch they sit in (batch invariance; ``docs/memory_speed.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rlgen_cli.sde.noise import randn_per_sample
from rlgen_cli.sde.solvers import compressed_schedule, dpm_solver_2m
from rlgen_cli.sde.step import StepOut, step
from rlgen_cli.sde.window import WindowPlan

Generators = torch.Generator | Sequence[torch.Generator] | None
"""One generator for the batch, or one per sample (batching-independent noise, see ``sde/noise.py``)."""

__all__ = [
    "Fold",
    "StepSpec",
    "Trajectory",
    "Velocity",
    "fold_rows",
    "recompute_step",
    "recompute_steps",
    "rollout",
]

Velocity = Callable[[Tensor, Tensor], Tensor]
"""``velocity(x (B, ...), sigma 0-d or (B,)) -> v (B, ...)``."""

Fold = Sequence[tuple[int, "Tensor | slice"]]
"""Steps scored in one velocity call: (step j, the samples that train it), in row order."""


@dataclass(frozen=True)
class StepSpec:
    """The sampler settings a rollout used; training must reuse them verbatim."""

    kind: str
    noise_level: float
    reduce: str = "mean"
    logprob_form: str = "gaussian"


@dataclass
class Trajectory:
    """The trained steps of B rollouts (S = len(plan.train_steps)); everything fp32.

    Attributes:
        latents: (B, S, ...) x_t before each trained step.
        next_latents: (B, S, ...) x_{t+1} the rollout sampled.
        logprobs: (B, S) log p(x_{t+1} | x_t) at sampling time (the old policy).
        stds: (B, S) total std s of each trained transition.
        sigmas: (S,) σ of each trained step; ``sigmas_next`` (S,) the σ it stepped to.
        step_indices: (S,) index of each trained step in the schedule.
        sigma_max: the schedule's first σ below 1 (``flow_sde`` replaces σ = 1 by it).
        final: (B, ...) the denoised sample x_0.
        means: (B, S, ...) the old step means μ_old, kept only when asked (GRPO-Guard).
        train_mask: (B, S) bool, which sample trains which step (DanceGRPO); None = all.
    """

    latents: Tensor
    next_latents: Tensor
    logprobs: Tensor
    stds: Tensor
    sigmas: Tensor
    sigmas_next: Tensor
    step_indices: Tensor
    sigma_max: float
    final: Tensor
    means: Tensor | None = None
    train_mask: Tensor | None = None

    _PER_SAMPLE = ("latents", "next_latents", "logprobs", "stds", "final", "means", "train_mask")

    @property
    def num_steps(self) -> int:
        return self.logprobs.shape[1]

    def index(self, idx: Tensor | slice) -> Trajectory:
        """The sub-batch ``idx`` (steps unchanged)."""
        return replace(self, **{k: _take(getattr(self, k), idx) for k in self._PER_SAMPLE})

    @staticmethod
    def cat(parts: list[Trajectory]) -> Trajectory:
        """Join sub-batches sampled with the same schedule and plan."""
        joined = {k: _join([getattr(p, k) for p in parts]) for k in Trajectory._PER_SAMPLE}
        return replace(parts[0], **joined)


def _take(value: Tensor | None, idx: Tensor | slice) -> Tensor | None:
    return None if value is None else value[idx]


def _join(values: list[Tensor | None]) -> Tensor | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    assert len(present) == len(values), "sub-batches differ in which of their fields are None"
    return torch.cat(present)


def _sigma_max(sigmas: Tensor) -> float:
    below_one = sigmas[sigmas < 1]
    return float(below_one[0]) if below_one.numel() else 1.0


@torch.no_grad()
def rollout(
    velocity: Velocity,
    x: Tensor,
    sigmas: Tensor,
    plan: WindowPlan,
    spec: StepSpec,
    generator: Generators = None,
    *,
    start: int = 0,
    flash_ratio: float | None = None,
    store_means: bool = False,
) -> Trajectory:
    """Denoise ``x`` (B, ...) from ``sigmas[start]`` to 0, SDE on ``plan.sde_steps``, ODE elsewhere.

    Only ``plan.train_steps`` are stored. Latents stay fp32 between steps (a bf16 round trip would
    break the ratio). With one generator per sample, sample i's noise comes from generator i only.

    Args:
        start: Step to begin at (``x`` is at ``sigmas[start]``): branching from a shared ODE prefix.
        flash_ratio: MixGRPO-Flash — after the last SDE step, finish with DPM-Solver++ 2M on a
            schedule compressed to this fraction of the remaining steps.
        store_means: Keep the step means μ_old of trained steps (GRPO-Guard).
    """
    assert sigmas.numel() == plan.num_steps + 1, f"{sigmas.numel()} sigmas for a {plan.num_steps}-step plan"
    assert min(plan.train_steps, default=start) >= start, f"trained steps {plan.train_steps} before {start}"
    sigma_max = _sigma_max(sigmas)
    x = x.float()
    stored: dict[str, list[Tensor]] = {"x": [], "next": [], "logp": [], "std": [], "mean": []}
    sde, trained = set(plan.sde_steps), set(plan.train_steps)
    last_sde = max(plan.sde_steps, default=plan.num_steps - 1)
    for i in range(start, plan.num_steps):
        if flash_ratio is not None and i == last_sde + 1:
            tail = compressed_schedule(sigmas, i, flash_ratio)[i:]
            x = dpm_solver_2m(velocity, x, tail)
            break
        kind, level = (spec.kind, spec.noise_level) if i in sde else ("ode", 0.0)
        out = step(
            kind,
            x,
            velocity(x, sigmas[i]),
            sigmas[i],
            sigmas[i + 1],
            noise_level=level,
            sigma_max=sigma_max,
            reduce=spec.reduce,
            logprob_form=spec.logprob_form,
            **_noise_source(generator, x, stochastic=kind != "ode" and level > 0),
        )
        if i in trained:
            for key, value in (("x", x), ("next", out.prev), ("logp", out.logprob), ("std", out.std)):
                stored[key].append(value)
            if store_means:
                stored["mean"].append(out.mean)
        x = out.prev
    steps = torch.tensor(plan.train_steps, device=sigmas.device, dtype=torch.long)
    return Trajectory(
        latents=_stack(stored["x"], x),
        next_latents=_stack(stored["next"], x),
        logprobs=_stack(stored["logp"], x.new_zeros(x.shape[0])),
        stds=_stack(stored["std"], x.new_zeros(x.shape[0])),
        sigmas=sigmas[steps],
        sigmas_next=sigmas[steps + 1],
        step_indices=steps,
        sigma_max=sigma_max,
        final=x,
        means=_stack(stored["mean"], x) if store_means else None,
        train_mask=plan.train_mask,
    )


def _stack(values: list[Tensor], like: Tensor) -> Tensor:
    """Stack per-step values on dim 1; an empty list gives a (B, 0, ...) tensor shaped like ``like``."""
    if values:
        return torch.stack(values, dim=1)
    return like.new_zeros((like.shape[0], 0, *like.shape[1:]))


def _noise_source(generator: Generators, x: Tensor, stochastic: bool) -> dict:
    """``step`` keyword for the noise: per-sample draws, the shared generator, or nothing."""
    if generator is None or isinstance(generator, torch.Generator):
        return {"generator": generator}
    assert len(generator) == x.shape[0], f"{len(generator)} per-sample generators for a batch of {x.shape[0]}"
    return {"noise": randn_per_sample(x.shape[1:], generator, x.device)} if stochastic else {}


def recompute_step(velocity: Velocity, traj: Trajectory, j: int, spec: StepSpec) -> StepOut:
    """Score the stored transition ``j`` of ``traj`` under the current ``velocity`` (gradients flow)."""
    x = traj.latents[:, j]
    v = velocity(x, traj.sigmas[j])
    return step(
        spec.kind,
        x,
        v,
        traj.sigmas[j],
        traj.sigmas_next[j],
        noise_level=spec.noise_level,
        prev=traj.next_latents[:, j],
        sigma_max=traj.sigma_max,
        reduce=spec.reduce,
        logprob_form=spec.logprob_form,
    )


def fold_rows(batch: int, fold: Fold, device: torch.device | str = "cpu") -> Tensor:
    """(R,) the sample each row of a folded call comes from: ``fold``'s steps one after another, so the
    caller can bind the conditioning of exactly these rows (``cond.index(fold_rows(...))``)."""
    samples = torch.arange(batch, device=device)
    return torch.cat([samples[rows] for _, rows in fold])


def recompute_steps(velocity: Velocity, traj: Trajectory, fold: Fold, spec: StepSpec) -> list[StepOut]:
    """Score the stored transitions of every step in ``fold`` under ``velocity`` with ONE call on their
    rows stacked (x_t and σ per row; ``velocity`` bound to the rows of :func:`fold_rows`). Returns one
    :class:`StepOut` per step, over its samples; gradients flow."""
    xs = [traj.latents[rows, j] for j, rows in fold]
    sizes = [x.shape[0] for x in xs]
    sigma = torch.cat([traj.sigmas[j].expand(n) for (j, _), n in zip(fold, sizes)])  # (R,)
    velocities = velocity(torch.cat(xs), sigma).split(sizes)
    return [
        step(
            spec.kind,
            x,
            v,
            traj.sigmas[j],
            traj.sigmas_next[j],
            noise_level=spec.noise_level,
            prev=traj.next_latents[rows, j],
            sigma_max=traj.sigma_max,
            reduce=spec.reduce,
            logprob_form=spec.logprob_form,
        )
        for (j, rows), x, v in zip(fold, xs, velocities)
    ]
