"""Forward-process online RL of a flow model: DiffusionNFT, Advantage Weighted Matching and DGPO.

Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process"; Xue et al. 2025,
"Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models". Neither needs the
likelihood of a denoising step: rollouts run any solver, and training noises the *clean* samples forward
and regresses the flow-matching target, weighted by how good each sample was. Each epoch:

1. **rollout** — K samples per prompt with ``algo.forward.solver`` (deterministic DPM-Solver++ 2M by
   default), from the old policy (DiffusionNFT) or the trained one (AWM); only x₀ is kept;
2. **score** — the reward mix scores the decoded images (every component logged);
3. **advantages** — rewards normalised within each prompt's group, groups keyed by dataset index, then
   mapped to DiffusionNFT's optimality probability r or AWM's rescaled advantage;
4. **update** — for every sample a few σ of the rollout schedule (``algo.forward.timestep_sampling``),
   a fresh ε each, ``x_σ = (1 − σ)·x₀ + σ·ε``; the loss ``algo.forward.loss`` (``algos/nft.py`` or
   ``algos/awm.py``) with an optional pull towards the reference (``algo.kl_weight``, LoRA disabled);
   DGPO (``algo.forward.loss=dgpo``) measures whole groups before each step (``recipes/flow_dgpo.py``);
5. **old policy** — θ_old ← d·θ_old + (1 − d)·θ with d from ``algo.forward.old`` (it grows with the
   optimizer steps);
6. **log / eval / checkpoint** — ``recipes/flow_run.py``'s: metrics.jsonl, the ODE evaluation (EMA weights if
   kept), full-state checkpoints (the old policy included) that resume exactly.

Deliberate choices: each sample's trained σ and ε come from its own stream keyed by (seed, epoch,
position), so neither the micro-batch size nor the number of processes changes them (upstream AWM draws
one stratified set per micro-batch; here every sample draws its own from the same distribution).
Upstream AWM rolls out with SA-Solver, which rlgen does not ship: ``solver=sde`` gives stochastic rollouts
with the configured sampler step, ``dpm2`` deterministic ones.

    rlgen train model=tiny_sd3 algo=nft
    rlgen train model=tiny_sd3 algo=awm
    rlgen train model=tiny_sd3 algo=dgpo
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from rlgen_cli.algos import combine_rewards
from rlgen_cli.algos.awm import (
    AWMLossOut,
    awm_loss,
    micro_batch_timestep_indices,
)
from rlgen_cli.algos.gardo import gated_velocity_kl
from rlgen_cli.algos.nft import (
    NFTLossOut,
    nft_loss,
    old_policy_decay,
    optimality_probability,
)
from rlgen_cli.errors import UserError
from rlgen_cli.models import Cond, cfg_gradient
from rlgen_cli.recipes import common, flow_dgpo, flow_run
from rlgen_cli.recipes.common import reduce_over_ranks, timed
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.recipes.flow_run import splits_read as splits_read
from rlgen_cli.recipes.forward_draws import frozen_velocity, record_loss, trained_indices
from rlgen_cli.recipes.gardo import GardoHooks
from rlgen_cli.recipes.plan_shape import PlanShape
from rlgen_cli.recipes.plan_trace import META, Encode, EpochTracer, replaced, rows_of
from rlgen_cli.recipes.session import session
from rlgen_cli.schema.forward import check_forward_steps
from rlgen_cli.schema.recipes import FlowForwardTrainConfig
from rlgen_cli.sde import dpm_solver_2m, euler, plan_window
from rlgen_cli.sde.noise import Stream, randn_per_sample, sample_generators
from rlgen_cli.sde.rollout import StepSpec, rollout
from rlgen_cli.sde.sampling import batches, conditioned
from rlgen_cli.training.control.ema import EMA
from rlgen_cli.training.control.schedule import apply_lr_schedule
from rlgen_cli.training.reporting.progress import Progress

OLD_KEY = "old_policy"  # trainer-state entry of the old policy's weights


@dataclass
class Rollouts:
    """This rank's samples of one epoch, in rollout order (N = its prompts × group_size)."""

    indices: Tensor  # (N,) dataset indices: the group keys
    positions: Tensor  # (N,) places in the epoch's global batch (the noise streams' keys)
    cond: Cond  # (N, ...)
    x0: Tensor  # (N, ...) clean latents
    sigmas: Tensor  # (T + 1,) the rollout schedule (one for the whole epoch)
    images: Tensor  # (N, 3, H, W) in [0, 1]
    components: dict[str, Tensor]  # reward name → (N,)
    details: dict[str, common.Weighted]  # each rollout batch's detail summaries, weighted by its size


@dataclass
class OldPolicy:
    """The frozen old policy: an average of the trained weights, refreshed after every epoch."""

    weights: EMA

    @classmethod
    def build(cls, run: FlowRun) -> OldPolicy:
        """A copy of the current weights, or the resumed run's old policy.

        Raises:
            UserError: A resumed checkpoint without the old policy (saved by an older rlgen) whose last
                refresh kept part of the earlier old weights (decay > 0), which the checkpoint does not hold.
        """
        params = run.policy.trainable.parameters()
        old = cls(EMA(params, decay=0.0, update_every=1, gather=run.dist.gathered))
        if OLD_KEY in run.resumed_extra:
            old.weights.load_state_dict(run.resumed_extra[OLD_KEY])
        elif run.global_step > 0:
            require_rebuildable_old_policy(run)
        return old

    def swap(self) -> AbstractContextManager[Any]:
        """Context in which the policy holds the old weights."""
        return self.weights.swap()

    def refresh(self, run: FlowRun) -> float:
        """θ_old ← d·θ_old + (1 − d)·θ with d from ``algo.forward.old`` at this step; returns d."""
        old = run.cfg.algo.forward.old
        decay = old_policy_decay(
            run.global_step, flat_steps=old.flat_steps, rate=old.rate, max_decay=old.max_decay
        )
        self.weights.decay = decay  # the schedule changes the decay between refreshes
        self.weights.step(run.global_step)
        return decay


def require_rebuildable_old_policy(run: FlowRun) -> None:
    """A resumed checkpoint without the old policy rebuilds it as a copy of its weights, which is the old
    policy only when the last refresh (at the checkpoint's ``global_step``) had decay 0.

    Raises:
        UserError: Otherwise, naming the decay and what to do.
    """
    old, step = run.cfg.algo.forward.old, run.global_step
    decay = old_policy_decay(step, flat_steps=old.flat_steps, rate=old.rate, max_decay=old.max_decay)
    if decay > 0:
        raise UserError(
            f"the resumed checkpoint (epoch {run.start_epoch}, global_step {step}) does not hold the old "
            f"policy (a checkpoint saved by an older rlgen lacks it), and its last refresh had decay {decay:.4g} "
            "(algo.forward.old), so the old policy was not the checkpoint's weights: resume a checkpoint saved "
            "while the decay was 0 (within algo.forward.old.flat_steps), or start the run afresh"
        )


def require_valid(cfg: FlowForwardTrainConfig) -> None:
    """What this recipe needs beyond the schema's checks (exit code 2 through the CLI)."""
    check_forward_steps(cfg.algo.forward, cfg.model.num_steps)
    if cfg.algo.adv_clip_max <= 0:
        raise UserError(
            f"algo.adv_clip_max={cfg.algo.adv_clip_max}: recipe=flow_forward maps advantages through "
            "their bound (DiffusionNFT's r = A/(2·A_max) + ½, AWM's A·advantage_max/A_max); set it > 0 (5)"
        )
    if cfg.algo.forward.loss == "dgpo":
        flow_dgpo.require_whole_groups(cfg.algo)


@torch.no_grad()
def solve(
    policy: Any,
    cond: Cond,
    x: Tensor,
    num_steps: int,
    solver: str,
    spec: StepSpec,
    steps: list[torch.Generator],
) -> Tensor:
    """x₀ (B, ...) from the noise ``x`` (B, ...) over the policy's ``num_steps`` schedule: the ODE with
    ``dpm2`` (DPM-Solver++ 2M) or ``euler``, or every step the SDE step ``spec`` (noise from ``steps``)."""
    sigmas = policy.schedule(num_steps, x)  # (T + 1,)
    velocity = functools.partial(conditioned, policy, cond)
    if solver == "dpm2":
        return dpm_solver_2m(velocity, x, sigmas)
    if solver == "euler":
        return euler(velocity, x, sigmas)
    return rollout(
        velocity, x, sigmas, plan_window("all", num_steps, timestep_fraction=1.0), spec, steps
    ).final


def sample_epoch(run: FlowRun, old: OldPolicy, epoch: int, progress: Progress) -> Rollouts:
    """This process's share of the epoch's samples in batches of ``sample_batch_size``, each scored as it
    is decoded. The share: whole pieces of ``algo.assignment_unit`` samples dealt round-robin over
    processes (``data/sampler.py``), as flow GRPO deals them, so every sample is rolled out and trained in
    the same batch, and optimizer step s covers the same global micro-batches, on any process count."""
    cfg, algo = run.cfg, run.cfg.algo
    indices = run.sampler.indices_for_epoch(epoch, algo.assignment_unit)
    examples, prompts, metadata = flow_run.examples_of(run.train_set, indices)
    positions = run.sampler.positions(algo.assignment_unit)  # places in the epoch's global batch
    initial = sample_generators(cfg.seed, epoch, positions, run.device, salt=Stream.INITIAL_NOISE)
    steps = sample_generators(cfg.seed, epoch, positions, run.device, salt=Stream.STEP_NOISE)
    sources = flow_run.sources_of(run, examples, run.train_set)
    spec = flow_run.step_spec(cfg)
    conds, x0s, images, scores = [], [], [], []
    weights = old.swap() if algo.forward.sample_with_old else nullcontext()
    with weights, common.progress_task(progress, "rollout", len(indices)) as advance:
        for part in batches(len(indices), algo.sample_batch_size):
            src = None if sources is None else sources[part]
            cond = run.policy.encode(prompts[part], None if src is None else src.to(run.device))
            x = run.policy.noise(part.stop - part.start, initial[part])
            x0s.append(
                solve(run.policy, cond, x, cfg.model.num_steps, algo.forward.solver, spec, steps[part])
            )
            conds.append(cond)
            images.append(run.policy.decode(x0s[-1]).cpu())
            scores.append(flow_run.score(run, images[-1], prompts[part], metadata[part], src))
            advance(part.stop - part.start)
    sizes = [float(len(img)) for img in images]
    details = {k: common.Weighted([s[1][k] for s in scores], sizes) for k in scores[0][1]}
    x0 = torch.cat(x0s)
    return Rollouts(
        indices=torch.tensor(indices),
        positions=torch.tensor(positions),
        cond=Cond.cat(conds),
        x0=x0,
        sigmas=run.policy.schedule(cfg.model.num_steps, x0[:1]),
        images=torch.cat(images),
        components={k: torch.cat([s[0][k] for s in scores]) for k in scores[0][0]},
        details=details,
    )


def loss_weights(
    run: FlowRun,
    components: dict[str, Tensor],
    group_ids: Tensor,
    shape: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Any]:
    """(N,) per-sample weights of the gathered batch from its group advantages A (clipped to ±A_max):
    DiffusionNFT's optimality probability r, AWM's ``A·advantage_max/A_max`` or DGPO's A; and the stats.
    ``shape`` (GARDO's diversity shaping) maps A first."""
    algo = run.cfg.algo
    advantages, stats = combine_rewards(
        components,
        dict(run.cfg.reward.weights),
        group_ids,
        mode=run.cfg.reward.aggregation,
        global_std=algo.global_std,
        clip_max=algo.adv_clip_max,
        std_estimator=algo.std_estimator,
        eps=algo.adv_eps,
    )
    if shape is not None:
        advantages = shape(advantages)
    if algo.forward.loss == "nft":
        return optimality_probability(advantages, algo.adv_clip_max), stats
    if algo.forward.loss == "dgpo":
        return advantages, stats
    return advantages * (algo.forward.advantage_max / algo.adv_clip_max), stats


def forward_loss(
    run: FlowRun,
    old: OldPolicy,
    x0: Tensor,
    noise: Tensor,
    sigma: Tensor,
    cond: Cond,
    weights: Tensor,
    kl_gate: Tensor | None = None,
) -> NFTLossOut | AWMLossOut:
    """The configured loss at ``x_σ = (1 − σ)·x₀ + σ·ε`` for x0, noise (B, ...), sigma and weights (B,).
    The old and reference velocities come first: the old policy swaps weights in place, which must not
    happen between the trained forward and its backward."""
    algo, forward = run.cfg.algo, run.cfg.algo.forward
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    x_sigma = (1 - s) * x0 + s * noise  # (B, ...)
    velocity = functools.partial(conditioned, run.policy, cond)
    v_old = v_ref = None
    with cfg_gradient(algo.cfg_grad):
        if forward.loss == "nft" or forward.old_weight > 0:
            v_old = frozen_velocity(velocity, x_sigma, sigma, old.swap())
        if algo.kl_weight > 0:
            v_ref = frozen_velocity(velocity, x_sigma, sigma, run.policy.trainable.reference())
        v = velocity(x_sigma, sigma)
    gated = kl_gate is not None and v_ref is not None  # GARDO: the KL below, on the gated samples only
    kl_weight = 0.0 if gated else algo.kl_weight
    if forward.loss == "nft":
        out = nft_loss(
            v,
            v_old,
            x0,
            noise,
            sigma,
            weights,
            beta=forward.nft_beta,
            adaptive=forward.adaptive_weight,
            scale=algo.adv_clip_max,
            v_ref=v_ref,
            kl_weight=kl_weight,
        )
    else:
        out = awm_loss(
            v,
            x0,
            noise,
            sigma,
            weights,
            weighting=forward.weighting,
            power=forward.ghuber_power,
            v_ref=v_ref,
            kl_weight=kl_weight,
            v_old=v_old,
            old_weight=forward.old_weight,
        )
    if not gated:
        return out
    kl = gated_velocity_kl(v.to(out.loss.dtype), v_ref.to(out.loss.dtype), kl_gate)
    return replace(out, loss=out.loss + algo.kl_weight * kl, kl_loss=kl.detach())


def train_micro_batch(
    run: FlowRun,
    old: OldPolicy,
    rollouts: Rollouts,
    part: slice,
    weights: Tensor,
    draws: list[torch.Generator],
    stats: dict[str, list[float]],
    steps_after: bool,
    kl_gate: Tensor | None = None,
) -> None:
    """Backward through every trained σ of one micro-batch; sample i draws its σ positions and ε from
    ``draws[i]``. ``steps_after``: the optimizer steps after it (its last backward syncs gradients)."""
    algo = run.cfg.algo
    x0, cond = rollouts.x0[part], rollouts.cond.index(part)
    per_sample = torch.stack([trained_indices(algo.forward, run.cfg.model.num_steps, g) for g in draws])
    positions = micro_batch_timestep_indices(per_sample, algo.forward.timestep_draw)  # (B, K)
    num_sigmas = positions.shape[1]
    for j in range(num_sigmas):
        sigma = rollouts.sigmas[positions[:, j].to(rollouts.sigmas.device)].to(x0.dtype)  # (B,)
        noise = randn_per_sample(x0.shape[1:], draws, run.device)  # (B, ...)
        out = forward_loss(run, old, x0, noise, sigma, cond, weights, kl_gate)
        last = steps_after and j == num_sigmas - 1
        # gradient_accumulation_steps counts micro-batches over all processes
        accumulation = common.accumulation_per_process(algo, run.dist.world_size)
        run.dist.backward(out.loss / (num_sigmas * accumulation), sync=last)
        record_loss(stats, out)


def update(
    run: FlowRun,
    old: OldPolicy,
    rollouts: Rollouts,
    weights: Tensor,
    epoch: int,
    progress: Progress,
    kl_gate: Tensor | None = None,
) -> dict[str, list[float]]:
    """``num_inner_epochs`` passes over this rank's samples in micro-batches of ``train_batch_size``; each
    sample's σ draws and ε come from its own stream (seed, epoch, global position), fresh for every pass.
    Returns the statistics per micro-batch (``common.reduce_over_ranks`` pools them over processes)."""
    algo = run.cfg.algo
    n = len(rollouts.indices)
    positions = rollouts.positions.tolist()
    draws = sample_generators(run.cfg.seed, epoch, positions, run.device, salt=Stream.FORWARD_NOISE)
    micro_batches = list(batches(n, algo.train_batch_size))
    stats: dict[str, list[float]] = defaultdict(list)
    with common.progress_task(progress, "update", algo.num_inner_epochs * len(micro_batches)) as advance:
        for _ in range(algo.num_inner_epochs):
            for k, part in enumerate(micro_batches):
                steps_after = (k + 1) % common.accumulation_per_process(algo, run.dist.world_size) == 0
                part_weights = weights[part].to(run.device)
                part_gate = None if kl_gate is None else kl_gate[part].to(run.device)  # GARDO's KL gate
                train_micro_batch(
                    run, old, rollouts, part, part_weights, draws[part], stats, steps_after, part_gate
                )
                if steps_after:
                    stats["grad_norm"].append(flow_run.optimizer_step(run))
                advance(1)
    return stats


def reference_distance(run: FlowRun, rollouts: Rollouts, epoch: int) -> list[float]:
    """``mean((v_θ − v_ref)²)``, the term ``kl_loss`` weights, of the updated policy against the reference
    (LoRA disabled): after the update, on each probe sample (``common.kl_probe_rows``) alone at the rollout
    schedule's middle σ, its ε from a stream of its own (no training draw moves). One no-grad forward of
    each, so runs with ``algo.kl_weight`` 0 show how far they moved too."""
    values = []
    for i, measured in common.kl_probe_rows(rollouts.positions.tolist()):
        one = torch.tensor([i])
        x0, cond = rollouts.x0[one], rollouts.cond.index(one)
        draws = sample_generators(
            run.cfg.seed, epoch, [int(rollouts.positions[i])], run.device, salt=Stream.KL_PROBE
        )
        noise = randn_per_sample(x0.shape[1:], draws, run.device).to(x0.dtype)  # (1, ...)
        sigma = rollouts.sigmas[len(rollouts.sigmas) // 2].to(x0.dtype).expand(1)  # (1,)
        s = sigma.view(-1, *([1] * (x0.dim() - 1)))
        x_sigma = (1 - s) * x0 + s * noise
        velocity = functools.partial(conditioned, run.policy, cond)
        with torch.no_grad():
            v = velocity(x_sigma, sigma)
        v_ref = frozen_velocity(velocity, x_sigma, sigma, run.policy.trainable.reference())
        if measured:
            values.append((v.float() - v_ref.float()).pow(2).mean().item())
    return values


def forward_epoch(
    run: FlowRun, old: OldPolicy, epoch: int, progress: Progress, gardo: GardoHooks | None = None
) -> dict[str, float]:
    """rollout → reward → advantages → update → old-policy refresh; the epoch's metrics."""
    cfg = run.cfg
    lr = apply_lr_schedule(run.optimizer, cfg.algo, epoch, cfg.epochs, run.time_progress)
    timings: dict[str, float] = {}
    with timed(timings, "time/rollout"):  # scoring runs batch by batch inside it
        rollouts = sample_epoch(run, old, epoch, progress)
    # every rank sees the whole batch's rewards with their dataset indices, put back in global order (so
    # group statistics sum in the same order on any process count), and a group that spans ranks is
    # normalised as one; each rank then keeps the weights of its own samples
    places = run.dist.gather(rollouts.positions.to(run.device)).cpu()
    order = places.argsort()  # rank by rank → global
    components = {k: run.dist.gather(v.to(run.device)).cpu()[order] for k, v in rollouts.components.items()}
    group_ids = run.sampler.group_keys(
        places[order],
        run.dist.gather(rollouts.indices.to(run.device)).cpu()[order],
    )
    shape, kl_gate, gardo_stats = None, None, {}
    if gardo is not None:  # GARDO: diversity-shaped advantages, the KL gate, the reference refresh
        total = flow_run.weighted_total(run, components)
        shape, kl_gate, gardo_stats = gardo.for_forward(
            run, epoch, rollouts, order, components, group_ids, total
        )
    weights, adv_stats = loss_weights(run, components, group_ids, shape)
    n = len(rollouts.indices)
    mine = weights[rollouts.positions]
    with timed(timings, "time/update"):
        if cfg.algo.forward.loss == "dgpo":  # group weights from whole groups: global advantages
            stats = flow_dgpo.update(run, old, rollouts, weights, group_ids, epoch, progress)
        else:
            stats = update(run, old, rollouts, mine, epoch, progress, kl_gate)
        stats[common.KL_TO_REFERENCE] = reference_distance(run, rollouts, epoch)
    decay = old.refresh(run)
    flow_run.save_rollout_images(run, rollouts.images, epoch)
    local = reduce_over_ranks(run.dist, {**rollouts.details, **stats, "trained_samples": n})
    return {
        "lr": lr,
        **flow_run.reward_metrics(run, components),
        **local,
        "zero_std_ratio": adv_stats.zero_std_ratio,
        "num_groups": adv_stats.num_groups,
        "old_decay": decay,
        **timings,
        "global_step": run.global_step,
        "peak_memory_mb": common.peak_memory_mb(run.device),
        **gardo_stats,
    }


def console_line(m: dict[str, float]) -> str:
    """reward ± std, eval, the policy loss, how far the policy is from the old one, and the time."""
    seconds = m["time/rollout"] + m["time/update"]
    return (
        f"reward {m['reward/mean']:+.4g}±{m['reward/std']:.3g}{flow_run.eval_suffix(m)}  "
        f"loss {m['policy_loss']:.4g}  old decay {m['old_decay']:.3g}  {seconds:.1f}s"
    )


class ForwardTracer(EpochTracer):
    """DiffusionNFT and AWM (``recipe=flow_forward``): ``solve`` and the decode for one
    rollout batch (under the old policy's weights when it samples), its x₀ and conditioning kept;
    ``update`` for one optimizer step — per trained σ the old policy's and the reference's
    velocities without gradients (the old policy swapped in: a backup of the trained weights), the
    trained forward, the loss and its backward, then the clip, the AdamW step and the EMA. The update
    trains on slices of the rollout's samples (no copy). It traces two trained σ of a micro-batch, or two
    micro-batches when a sample trains one σ and gradients accumulate over micro-batches."""

    update_copies = 1

    def __init__(self, cfg: Any, policy: Any, trained: list[nn.Module], encode: Encode) -> None:
        super().__init__(cfg, policy, trained, encode)
        self.old = OldPolicy.build(self.run)
        self._sigmas: Tensor | None = None

    def _rollout(self, batch: int) -> None:
        cfg, run, forward = self.cfg, self.run, self.cfg.algo.forward
        weights = self.old.swap() if forward.sample_with_old else contextlib.nullcontext()
        with weights:
            cond = self.encode(batch)
            x = run.policy.noise(batch)
            steps = sample_generators(cfg.seed, 0, range(batch), META, salt=Stream.STEP_NOISE)
            x0 = solve(
                run.policy, cond, x, cfg.model.num_steps, forward.solver, flow_run.step_spec(cfg), steps
            )
            run.policy.decode(x0)  # the images go to host memory
        self._sigmas = run.policy.schedule(cfg.model.num_steps, x0[:1])
        self._keep(batch, (x0, *cond.tensors.values()), cond)

    def _update_of(self, micro_batch: int) -> Callable[[], Any]:
        algo, num_steps = self.cfg.algo, self.cfg.model.num_steps
        per_sample = len(trained_indices(algo.forward, num_steps, torch.Generator().manual_seed(0)))
        sigmas = min(per_sample, 2)
        micro_batches = 2 if sigmas < 2 and self._accumulates() else 1
        rows = micro_batch * micro_batches
        x0 = self._kept[0]
        rollouts = types.SimpleNamespace(
            indices=torch.arange(rows),
            positions=torch.arange(rows),
            x0=rows_of(x0, rows),
            cond=self.encode(rows),
            sigmas=self._sigmas,
        )
        # ``sigmas`` σ a sample: drawn from the rollout's schedule as the run draws them (which ones does
        # not change the memory)
        forward = replaced(
            algo.forward, timestep_sampling="subset", timestep_fraction=(sigmas + 0.5) / num_steps
        )
        algo = replaced(
            algo,
            train_batch_size=micro_batch,
            gradient_accumulation_steps=micro_batches,
            num_inner_epochs=1,
            forward=forward,
        )
        run = replaced(self.run, cfg=replaced(self.cfg, algo=algo))
        weights = torch.zeros(rows, device=META)
        return lambda: update(run, self.old, rollouts, weights, 0, Progress(False))


class ForwardShape(PlanShape):
    """Per-sample training beside an old copy of the policy (the sampling policy of DiffusionNFT / AWM)."""

    tracer = ForwardTracer

    def weight_copies(self, cfg: Any) -> tuple[str, ...]:
        return ("old policy",)


PLAN = ForwardShape()
"""What ``rlgen plan`` reads of this recipe."""


def run(cfg: FlowForwardTrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the shared session (``recipes/flow_run.py``) around :func:`forward_epoch`; the last epoch's metrics."""
    require_valid(cfg)
    with session(cfg, raw_cfg) as s:
        old = OldPolicy.build(s.run)
        gardo = GardoHooks.for_run(s.run)
        for epoch in s.epochs():
            metrics = forward_epoch(s.run, old, epoch, s.progress, gardo)
            headline = f"reward {metrics['reward/mean']:+.4g}"
            if s.end_epoch(
                epoch, metrics, console_line, headline, extra_state={OLD_KEY: old.weights.state_dict()}
            ):
                break
    return s.metrics
