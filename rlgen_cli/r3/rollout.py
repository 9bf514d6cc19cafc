"""Rollouts of the two R3 stages on one process: text in micro-batches, then images with one SDE step.

Random streams (``sde/noise.py``) make every draw a pure function of who draws it:

* the **SDE step** of a stage is drawn once per (seed, step, group) — every branch of a group, on every
  rank of its policy group, takes its stochastic step at the same index (any step when generating, one
  of the first ``max_sde_timestep_idx_for_edit`` when editing); with SDE off the plan has none;
* the **initial noise** is keyed by the group: shared by the whole group, on every rank;
* the **step noise** and the **text sampling** are keyed by the branch's global position, so branches
  differ and nothing depends on how rows are batched or spread over ranks.

Latents are fp32 between steps and the trained step's transition is stored, so the training path's
recompute is exactly on-policy (``rlgen check-onpolicy model=tiny_r3``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rlgen_cli.models import Cond
from rlgen_cli.r3.policy import Thoughts, UnifiedPolicy
from rlgen_cli.sde.noise import Stream, sample_generators, stream_seed
from rlgen_cli.sde.rollout import StepSpec, Trajectory, rollout
from rlgen_cli.sde.sampling import conditioned
from rlgen_cli.sde.window import WindowPlan, plan_window

__all__ = [
    "MONOTONIC_CLAMP",
    "ImageRollout",
    "image_rollout",
    "micro_batches",
    "monotonic_eta",
    "scheduled_spec",
    "shifted",
    "stage_plan",
    "text_rollout",
]

MONOTONIC_CLAMP = 0.95  # upstream caps σ in 1 − σ so that η stays finite at σ = 1


def micro_batches(n: int, size: int | None) -> Iterator[slice]:
    """Consecutive slices of ``size`` rows (all rows when ``size`` is None) covering ``range(n)``."""
    size = size or n
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def shifted(rows: slice, offset: int) -> slice:
    """``rows`` moved by ``offset``: a group's rows among all of a process's rows."""
    return slice(rows.start + offset, rows.stop + offset)


def stage_plan(
    num_steps: int, sde: bool, max_index: int | None, seed: int, step: int, group: int
) -> WindowPlan:
    """The stage's plan for ``group``: one SDE (and trained) step, or none with ``sde`` off."""
    if not sde:
        return WindowPlan(num_steps, (), ())
    generator = torch.Generator().manual_seed(stream_seed(seed, step, group, salt=Stream.WINDOW))
    return plan_window("single", num_steps, max_index=max_index, generator=generator)


def monotonic_eta(eta: float, sigma: float) -> float:
    """Upstream R3's ``monotonic`` η at σ: ``η·sqrt(σ / (1 − min(σ, 0.95)))`` (σ = ½ gives η, noisier
    steps more, cleaner ones less)."""
    assert eta >= 0 and 0 <= sigma <= 1, (eta, sigma)
    return eta * (sigma / (1 - min(sigma, MONOTONIC_CLAMP))) ** 0.5


def scheduled_spec(spec: StepSpec, eta_schedule: str, plan: WindowPlan, sigmas: Tensor) -> StepSpec:
    """The step settings of a stage whose SDE step is ``plan``'s: with ``monotonic``, the noise level
    becomes :func:`monotonic_eta` at that step's σ (one per stage and group, so training reuses it)."""
    if eta_schedule == "constant" or not plan.sde_steps:
        return spec
    assert eta_schedule == "monotonic" and spec.kind == "dance", (eta_schedule, spec.kind)
    sigma = float(sigmas[plan.sde_steps[0]])
    return replace(spec, noise_level=monotonic_eta(spec.noise_level, sigma))


def text_rollout(
    sample: Callable[[slice, int], Thoughts], n: int, micro: int | None, seed: int, step: int, first: int
) -> Thoughts:
    """Sample ``n`` rows in micro-batches; ``sample(rows, seed)`` runs one, seeded by its first row's
    global position (``first`` + row)."""
    parts = [
        sample(rows, stream_seed(seed, step, first + rows.start, salt=Stream.R3_TEXT))
        for rows in micro_batches(n, micro)
    ]
    return Thoughts.cat(parts)


@dataclass
class ImageRollout:
    """The images of one stage on this process; N rows.

    Attributes:
        cond: (N, ...) conditioning, stage in its extras.
        traj: (N, S, ...) the trained step (S = 1, or 0 with SDE off).
        images: (N, 3, H, W) decoded images in [0, 1], on the CPU.
        spec: The step settings training must reuse.
        plan: The stage's plan (its SDE step).
        noise_sum: Sum of the first row's initial noise: equal on every rank of a policy group.
    """

    cond: Cond
    traj: Trajectory
    images: Tensor
    spec: StepSpec
    plan: WindowPlan
    noise_sum: float

    @property
    def sde_step(self) -> int:
        """The stochastic step's index, −1 without one."""
        return self.plan.sde_steps[0] if self.plan.sde_steps else -1


@torch.no_grad()
def image_rollout(
    policy: UnifiedPolicy,
    encode: Callable[[slice], Cond],
    stage: str,
    plan: WindowPlan,
    spec: StepSpec,
    positions: Sequence[int],
    noise_keys: Sequence[int],
    seed: int,
    step: int,
    micro: int | None,
    eta_schedule: str = "constant",
) -> ImageRollout:
    """Denoise one image per row: ``encode(rows)`` conditions a micro-batch; row i draws its initial noise
    from stream ``noise_keys[i]`` (a group's id: shared) and its step noise from its global ``positions[i]``.
    ``eta_schedule``: see :func:`scheduled_spec` (the returned spec is the one the step used)."""
    n = len(positions)
    initial = sample_generators(seed, step, list(noise_keys), policy.device, salt=Stream.INITIAL_NOISE)
    noise = sample_generators(seed, step, list(positions), policy.device, salt=Stream.STEP_NOISE)
    conds, trajs, images = [], [], []
    noise_sum = 0.0
    for rows in micro_batches(n, micro):
        cond = encode(rows)
        x = policy.noise(rows.stop - rows.start, initial[rows], stage)
        noise_sum = noise_sum or float(x[0].double().sum())
        sigmas = policy.schedule(plan.num_steps, x, stage)
        if not trajs:  # the first micro-batch fixes the stage's η: one σ per stage and group
            spec = scheduled_spec(spec, eta_schedule, plan, sigmas)
        trajs.append(
            rollout(functools.partial(conditioned, policy, cond), x, sigmas, plan, spec, noise[rows])
        )
        conds.append(cond)
        images.append(policy.decode(trajs[-1].final, stage).cpu())
    return ImageRollout(Cond.cat(conds), Trajectory.cat(trajs), torch.cat(images), spec, plan, noise_sum)
