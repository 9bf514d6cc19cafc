"""Per-step policy-gradient objectives: how one trained SDE step of a trajectory becomes a loss, one
entry per ``algos/`` module, so the flow loop never branches on the algorithm (``algo.objective``)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from rlgen_cli.algos.grpo import GRPOLossOut, grpo_loss
from rlgen_cli.algos.guard import guard_loss
from rlgen_cli.schema.flow import AlgoConfig
from rlgen_cli.sde.rollout import Trajectory
from rlgen_cli.sde.step import StepOut

StepObjective = Callable[[StepOut, Trajectory, int, Tensor, Tensor | None, AlgoConfig], GRPOLossOut]


def _grpo_objective(out: StepOut, traj: Trajectory, j: int, adv: Tensor, kl: Tensor | None, algo: AlgoConfig):
    return grpo_loss(out.logprob, traj.logprobs[:, j], adv, clip_range=algo.clip_range, kl=kl, beta=algo.beta)


def _guard_objective(
    out: StepOut, traj: Trajectory, j: int, adv: Tensor, kl: Tensor | None, algo: AlgoConfig
):
    sqrt_neg_dt = (traj.sigmas[j] - traj.sigmas_next[j]).sqrt().expand(adv.shape[0])  # (B,)
    sigma_t = traj.stds[:, j] / sqrt_neg_dt  # the noise scale σ_t of s = σ_t·sqrt(−dt)
    return guard_loss(
        out.logprob, traj.logprobs[:, j], out.mean, traj.means[:, j], sigma_t, sqrt_neg_dt, adv,
        clip_range=algo.clip_range, kl=kl, beta=algo.beta,
    )  # fmt: skip


STEP_OBJECTIVES: dict[str, StepObjective] = {"grpo": _grpo_objective, "grpo_guard": _guard_objective}
