"""Rollouts that record a typed trajectory, and the recompute of a stored step's log-probability.

Both take the model as ``velocity(x, sigma) -> v`` (the conditioning bound by the caller), so this module
stays pure tensor maths. Sampling and training call the same :func:`rlgen_cli.sde.step.step` with the
same settings (:class:`StepSpec`), which is what makes the on-policy importance ratio exactly 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlgen_cli.sde.step import StepOut, step
from rlgen_cli.sde.window import WindowPlan

__all__ = ["StepSpec", "Trajectory", "Velocity", "recompute_step", "rollout"]

Velocity = Callable[[Tensor, Tensor], Tensor]
"""``velocity(x (B, ...), sigma 0-d) -> v (B, ...)``."""


@dataclass(frozen=True)
class StepSpec:
    """The sampler settings a rollout used; training must reuse them verbatim."""

    kind: str
    eta: float
    reduce: str = "mean"
    logprob_form: str = "gaussian"


@dataclass
class Trajectory:
    """The trained steps of B rollouts (S = len(plan.train_steps)); everything fp32.

    Attributes:
        latents: (B, S, ...) x_t before each trained step.
        next_latents: (B, S, ...) x_{t+1} the rollout sampled.
        logprobs: (B, S) log p(x_{t+1} | x_t) at sampling time (the old policy).
        sigmas: (S,) σ of each trained step; ``sigmas_next`` (S,) the σ it stepped to.
        step_indices: (S,) index of each trained step in the schedule.
        sigma_max: the schedule's first σ below 1 (``flow_sde`` replaces σ = 1 by it).
        final: (B, ...) the denoised sample x_0.
    """

    latents: Tensor
    next_latents: Tensor
    logprobs: Tensor
    sigmas: Tensor
    sigmas_next: Tensor
    step_indices: Tensor
    sigma_max: float
    final: Tensor

    @property
    def num_steps(self) -> int:
        return self.logprobs.shape[1]

    def index(self, idx: Tensor | slice) -> Trajectory:
        """The sub-batch ``idx`` (steps unchanged)."""
        return Trajectory(
            self.latents[idx], self.next_latents[idx], self.logprobs[idx], self.sigmas, self.sigmas_next,
            self.step_indices, self.sigma_max, self.final[idx],
        )  # fmt: skip

    @staticmethod
    def cat(parts: list[Trajectory]) -> Trajectory:
        """Join sub-batches sampled with the same schedule and plan."""
        first = parts[0]
        return Trajectory(
            torch.cat([p.latents for p in parts]), torch.cat([p.next_latents for p in parts]),
            torch.cat([p.logprobs for p in parts]), first.sigmas, first.sigmas_next, first.step_indices,
            first.sigma_max, torch.cat([p.final for p in parts]),
        )  # fmt: skip


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
    generator: torch.Generator | None = None,
) -> Trajectory:
    """Denoise ``x`` (B, ...) along ``sigmas`` (T+1,), SDE on ``plan.sde_steps``, ODE elsewhere.

    Only ``plan.train_steps`` are stored. Latents stay fp32 between steps (a bf16 round trip would
    break the ratio).
    """
    if sigmas.numel() != plan.num_steps + 1:
        raise ValueError(f"{sigmas.numel()} sigmas do not fit a {plan.num_steps}-step plan (need T+1)")
    sigma_max = _sigma_max(sigmas)
    x = x.float()
    stored: dict[str, list[Tensor]] = {"x": [], "next": [], "logp": []}
    sde, trained = set(plan.sde_steps), set(plan.train_steps)
    for i in range(plan.num_steps):
        v = velocity(x, sigmas[i])
        kind, eta = (spec.kind, spec.eta) if i in sde else ("ode", 0.0)
        out = step(
            kind, x, v, sigmas[i], sigmas[i + 1], eta=eta, generator=generator, sigma_max=sigma_max,
            reduce=spec.reduce, logprob_form=spec.logprob_form,
        )  # fmt: skip
        if i in trained:
            stored["x"].append(x)
            stored["next"].append(out.prev)
            stored["logp"].append(out.logprob)
        x = out.prev
    steps = torch.tensor(plan.train_steps, device=sigmas.device)
    return Trajectory(
        latents=torch.stack(stored["x"], dim=1),
        next_latents=torch.stack(stored["next"], dim=1),
        logprobs=torch.stack(stored["logp"], dim=1),
        sigmas=sigmas[steps],
        sigmas_next=sigmas[steps + 1],
        step_indices=steps,
        sigma_max=sigma_max,
        final=x,
    )


def recompute_step(velocity: Velocity, traj: Trajectory, j: int, spec: StepSpec) -> StepOut:
    """Score the stored transition ``j`` of ``traj`` under the current ``velocity`` (gradients flow)."""
    x = traj.latents[:, j]
    v = velocity(x, traj.sigmas[j])
    return step(
        spec.kind, x, v, traj.sigmas[j], traj.sigmas_next[j], eta=spec.eta, prev=traj.next_latents[:, j],
        sigma_max=traj.sigma_max, reduce=spec.reduce, logprob_form=spec.logprob_form,
    )  # fmt: skip
