"""DGPO's update inside ``recipe=flow_forward`` (``algo=dgpo``, ``algos/dgpo.py``).

DGPO weights every sample by a function of its *whole group* at the same σ and ε: the group weight
σ((β/G)·Σ_i A_i·(e_θ,i − e_ref,i)). Each optimizer step therefore runs in two passes over the
micro-batches it covers:

1. **measure** (no gradients) — for every sample and trained σ the flow-matching errors of the policy,
   the reference and (with the clip) the old policy; the products A·Δ are gathered from every process
   and put back in global order, so each group's sum has the same terms in the same order on any process
   count;
2. **train** — per micro-batch and σ, :func:`algos.dgpo.dgpo_loss` with those group weights.

The weights are constants of the step (the policy does not change between the two passes), so this is
the gradient of DGPO's loss over whole groups. Every member of a group draws its σ and ε from one
stream, keyed by the group's first place in the epoch's global batch, as upstream shares them within a
group (``use_shared_noise``); every step must cover whole groups (checked before the run:
:func:`require_whole_groups`).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.algos.dgpo import dgpo_loss, group_weights
from rlgen_cli.algos.dpo import flow_matching_error
from rlgen_cli.errors import UserError
from rlgen_cli.models import cfg_gradient
from rlgen_cli.recipes import common, flow_run
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.recipes.forward_draws import frozen_velocity, record_loss, trained_indices
from rlgen_cli.sde.noise import Stream, randn_per_sample, sample_generators
from rlgen_cli.sde.sampling import batches, conditioned
from rlgen_cli.training.reporting.progress import Progress

__all__ = ["group_stream_keys", "require_whole_groups", "update"]


def require_whole_groups(algo: Any) -> None:
    """An optimizer step covers ``train_batch_size × gradient_accumulation_steps`` consecutive samples of
    the epoch's global batch, where each group's samples sit in a row: whole groups need that count to be
    a multiple of ``group_size``."""
    per_step = algo.train_batch_size * (algo.gradient_accumulation_steps or 1)
    if per_step % algo.group_size:
        raise UserError(
            f"algo=dgpo sums each group's samples within one optimizer step, but a step covers "
            f"algo.train_batch_size × algo.gradient_accumulation_steps = {per_step} samples, not a multiple "
            f"of algo.group_size={algo.group_size}; make it one (e.g. one step per epoch: "
            "gradient_accumulation_steps × train_batch_size = prompts_per_epoch × group_size)"
        )


def group_stream_keys(positions: Tensor, group_size: int) -> list[int]:
    """Each sample's stream key: the global place of its group's first sample (groups sit in a row)."""
    return (positions - positions % group_size).tolist()


@dataclass
class Measured:
    """One micro-batch's trained σ and ε and the errors of the measuring pass (K = σ per sample)."""

    part: slice
    sigmas: list[Tensor]  # K × (B,)
    noises: list[Tensor]  # K × (B, ...)
    deltas: Tensor  # (B, K) e_θ − e_ref
    old_errors: Tensor | None  # (B, K) e_old, with the clip only


def _x_sigma(x0: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * noise


@torch.no_grad()
def measure(run: FlowRun, old: Any, rollouts: Any, part: slice, draws: list[torch.Generator]) -> Measured:
    """Draw the micro-batch's σ and ε (each sample from its group's stream) and measure the errors."""
    forward = run.cfg.algo.forward
    x0, cond = rollouts.x0[part], rollouts.cond.index(part)
    positions = torch.stack([trained_indices(forward, run.cfg.model.num_steps, g) for g in draws])  # (B, K)
    velocity = functools.partial(conditioned, run.policy, cond)
    reference = old.swap if forward.dgpo_reference == "old" else run.policy.trainable.reference
    sigmas, noises, deltas, olds = [], [], [], []
    for j in range(positions.shape[1]):
        sigma = rollouts.sigmas[positions[:, j].to(rollouts.sigmas.device)].to(x0.dtype)  # (B,)
        noise = randn_per_sample(x0.shape[1:], draws, run.device)  # (B, ...)
        x = _x_sigma(x0, noise, sigma)
        error = flow_matching_error(velocity(x, sigma), x0, noise)
        deltas.append(
            error - flow_matching_error(frozen_velocity(velocity, x, sigma, reference()), x0, noise)
        )
        if forward.dgpo_clip_range > 0:
            olds.append(flow_matching_error(frozen_velocity(velocity, x, sigma, old.swap()), x0, noise))
        sigmas.append(sigma)
        noises.append(noise)
    old_errors = torch.stack(olds, dim=1) if olds else None
    return Measured(part, sigmas, noises, torch.stack(deltas, dim=1), old_errors)


def step_weights(
    run: FlowRun, rollouts: Any, measured: list[Measured], advantages: Tensor, group_ids: Tensor
) -> Tensor:
    """(n, K) group weights of this process's samples in ``measured`` (in its order), from every
    process's A·Δ put back in global order. ``advantages`` / ``group_ids``: the epoch's global batch."""
    cfg = run.cfg
    local = torch.cat([rollouts.positions[m.part] for m in measured])  # (n,) global places
    deltas = torch.cat([m.deltas for m in measured]).double()  # (n, K)
    places = run.dist.gather(local.to(run.device)).cpu()
    gathered = run.dist.gather(deltas.to(run.device)).cpu()[places.argsort()]
    places = places.sort().values
    try:
        weights = group_weights(
            advantages[places],
            gathered,
            group_ids[places],
            beta=cfg.algo.forward.dgpo_beta,
            group_size=cfg.algo.group_size,
        )
    except ValueError as err:
        raise UserError(f"algo=dgpo: an optimizer step must cover whole groups: {err}") from err
    return weights[torch.searchsorted(places, local)]


def train_measured(
    run: FlowRun, rollouts: Any, m: Measured, advantages: Tensor, weights: Tensor, stats: Any, sync: bool
) -> None:
    """Backward through every trained σ of one measured micro-batch (``sync``: its last one syncs)."""
    algo, forward = run.cfg.algo, run.cfg.algo.forward
    x0, cond = rollouts.x0[m.part], rollouts.cond.index(m.part)
    velocity = functools.partial(conditioned, run.policy, cond)
    num_sigmas = len(m.sigmas)
    accumulation = common.accumulation_per_process(algo, run.dist.world_size)
    for j, (sigma, noise) in enumerate(zip(m.sigmas, m.noises)):
        x = _x_sigma(x0, noise, sigma)
        with cfg_gradient(algo.cfg_grad):
            v_ref = None
            if algo.kl_weight > 0:
                with torch.no_grad(), run.policy.trainable.reference():
                    v_ref = velocity(x, sigma)
            v = velocity(x, sigma)
        out = dgpo_loss(
            v,
            x0,
            noise,
            advantages,
            weights[:, j].to(run.device),
            old_errors=None if m.old_errors is None else m.old_errors[:, j],
            clip_range=forward.dgpo_clip_range,
            v_ref=v_ref,
            kl_weight=algo.kl_weight,
        )
        run.dist.backward(out.loss / (num_sigmas * accumulation), sync=sync and j == num_sigmas - 1)
        record_loss(stats, out)


def update(
    run: FlowRun,
    old: Any,
    rollouts: Any,
    advantages: Tensor,
    group_ids: Tensor,
    epoch: int,
    progress: Progress,
) -> dict[str, list[float]]:
    """``num_inner_epochs`` passes over this process's samples, one optimizer step per
    ``gradient_accumulation_steps`` global micro-batches, each measured then trained (module docstring).
    ``advantages`` / ``group_ids``: (N_global,) the epoch's global batch in global order."""
    algo = run.cfg.algo
    keys = group_stream_keys(rollouts.positions, algo.group_size)
    draws = sample_generators(run.cfg.seed, epoch, keys, run.device, salt=Stream.FORWARD_NOISE)
    micro_batches = list(batches(len(rollouts.indices), algo.train_batch_size))
    per_step = common.accumulation_per_process(algo, run.dist.world_size)
    stats: dict[str, list[float]] = defaultdict(list)
    with common.progress_task(progress, "update", algo.num_inner_epochs * len(micro_batches)) as advance:
        for _ in range(algo.num_inner_epochs):
            for start in range(0, len(micro_batches), per_step):
                window = micro_batches[start : start + per_step]
                measured = [measure(run, old, rollouts, part, draws[part]) for part in window]
                weights = step_weights(run, rollouts, measured, advantages, group_ids)
                offset, steps_after = 0, len(window) == per_step
                for k, m in enumerate(measured):
                    n = m.part.stop - m.part.start
                    mine = advantages[rollouts.positions[m.part]].to(run.device)
                    last = steps_after and k == len(measured) - 1
                    train_measured(run, rollouts, m, mine, weights[offset : offset + n], stats, last)
                    offset += n
                    advance(1)
                if steps_after:
                    stats["grad_norm"].append(flow_run.optimizer_step(run))
    return stats
