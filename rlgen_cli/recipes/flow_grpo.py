"""Flow-GRPO and its family: online reinforcement learning of a flow-matching image model.

Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL". :func:`grpo_epoch` is one
epoch, top to bottom:

1. **rollout** — K samples per prompt; the window (``sde/window.py``) decides which steps are
   stochastic and trained; their transitions and log-probabilities are kept (fp32);
2. **reward** — the reward mix scores the decoded images (every component logged). Scoring is
   overlapped with the rollout: each batch is handed to :class:`RewardScoring` as soon as it is decoded
   and scored on a worker thread while the next batch samples, so a reward model or reward server costs
   little extra wall-clock time; the epoch then waits for the scores that are not done yet (a CPU run
   whose rewards all compute locally scores each batch in line instead: there is nothing to hide behind);
3. **advantages** — rewards normalised within each prompt's group (groups keyed by dataset index, over
   every process), optionally best-of-N and without zero-advantage samples;
4. **update** — :func:`update`: ``num_inner_epochs`` passes of the per-step objective over the trained
   steps — ``grpo_loss`` (clipped ratio), or ``guard_loss`` for GRPO-Guard — with an optional KL to the
   reference (LoRA disabled), gradient accumulation and grad-norm clipping.

:func:`run` wraps the epochs in the shared loop (``recipes/flow_run.py``): evaluation, logs, checkpoints,
resume, time limit.

The variants are configuration: Flow-GRPO-Fast = ``window.kind=random_window`` (+ ``branch=shared_prefix``),
MixGRPO = ``sliding`` (+ ``flash``), DanceGRPO = ``random_subset`` + ``sampler=dance`` +
``shared_initial_noise`` (+ ``best_of_n``), CPS = ``sampler=cps``, GRPO-Guard = ``objective=grpo_guard``.

Deliberate choices: samples keep their rollout batches in training (no shuffle), so with
``train_batch_size == sample_batch_size`` the first update is exactly on-policy (ratio == 1, checked by
``rlgen check-onpolicy``); every sample draws its noise from its own stream keyed by (seed, epoch,
position), so a resumed run draws the same noise as an uninterrupted one and the rollout batch size
does not change the samples.

    rlgen train experiment=shapes_grpo_fast         # ShapesEval: Flow-GRPO-Fast on two CPU cores
    rlgen train model=sd3 algo=grpo_fast reward=jpeg_compressibility
"""

from __future__ import annotations

import functools
import logging
import math
import types
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.algos import (
    GRPOLossOut,
    best_and_worst,
    combine_rewards,
    grpo_loss,
    guard_loss,
    nonzero_advantage_rows,
)
from rlgen_cli.algos.gardo import gated_kl_weights
from rlgen_cli.data.sample_order import training_orders
from rlgen_cli.models import Cond, cfg_gradient
from rlgen_cli.recipes import common, flow_run
from rlgen_cli.recipes.common import summarise, timed
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.recipes.flow_run import splits_read as splits_read
from rlgen_cli.recipes.gardo import GardoHooks
from rlgen_cli.recipes.plan_shape import PlanShape
from rlgen_cli.recipes.plan_trace import META, EpochTracer, distinct_bytes, replaced, resized
from rlgen_cli.recipes.registry import Perturb
from rlgen_cli.recipes.reward_scoring import RewardScoring
from rlgen_cli.recipes.session import session
from rlgen_cli.schema.algo import FlowGrpoAlgoConfig
from rlgen_cli.schema.recipes import FlowGrpoTrainConfig
from rlgen_cli.sde import euler, step_kl
from rlgen_cli.sde.noise import Stream, first_of_runs, run_ids, sample_generators, stream_seed
from rlgen_cli.sde.rollout import (
    Fold,
    StepSpec,
    Trajectory,
    fold_rows,
    recompute_step,
    recompute_steps,
    rollout,
)
from rlgen_cli.sde.sampling import batches, conditioned
from rlgen_cli.sde.step import StepOut
from rlgen_cli.sde.window import WindowPlan, plan_window
from rlgen_cli.training.control.schedule import apply_lr_schedule
from rlgen_cli.training.reporting.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class Rollouts:
    """One epoch's samples on this process, in rollout order. N = its share of prompts × group size."""

    indices: Tensor  # (N,) dataset indices: the group keys
    prompts: list[str]
    metadata: list[dict]
    cond: Cond  # (N, ...)
    traj: Trajectory  # (N, S, ...)
    images: Tensor  # (N, 3, H, W) in [0, 1]
    sources: Tensor | None = None  # (N, 3, H, W), or (N, S, 3, H, W) with S sources per example: editing sets

    def select(self, keep: Tensor) -> Rollouts:
        """The samples at positions ``keep`` (N',)."""
        picked = keep.tolist()
        return Rollouts(
            self.indices[keep],
            [self.prompts[i] for i in picked],
            [self.metadata[i] for i in picked],
            self.cond.index(keep),
            self.traj.index(keep),
            self.images[keep],
            None if self.sources is None else self.sources[keep],
        )


RolloutBatch = Callable[[Tensor, list[str], list[dict], "Tensor | None"], None]
"""Called with each decoded rollout batch: images, prompts, metadata, source images."""


# -- one epoch -----------------------------------------------------------------------------------------
def grpo_epoch(
    run: FlowRun, epoch: int, progress: Progress, gardo: GardoHooks | None = None
) -> dict[str, float]:
    """rollout → reward → advantages → update for ``epoch``; returns the epoch's metrics."""
    cfg, algo, dist = run.cfg, run.cfg.algo, run.dist
    lr = apply_lr_schedule(run.optimizer, algo, epoch, cfg.epochs, run.time_progress)
    timings: dict[str, float] = {}

    # 1 + 2. rollout, each batch scored as soon as it is decoded; then wait for the rest of the scores
    with RewardScoring(run) as scoring:
        with timed(timings, "time/rollout"):
            rollouts = sample_rollouts(run, epoch, progress, on_batch=scoring.submit)
        with timed(timings, "time/reward"):  # only the part of scoring that sampling did not hide
            local, reward_details = scoring.results()
    timings["time/rollout"] -= scoring.inline_s  # scored in line: reward time, not rollout time
    timings["time/reward"] += scoring.inline_s

    # 3. advantages: every process sees the whole epoch's rewards with their dataset indices, put back in
    # global order (so group statistics sum in the same order on any process count) and a group that
    # spans processes is normalised as one; each then keeps the advantages of its own samples
    mine = torch.tensor(run.sampler.positions(algo.assignment_unit))  # (N,) places in the global batch
    everyone = dist.gather(mine).cpu()  # every process's places, rank by rank
    order = everyone.argsort()  # gathered rank by rank → global order
    components = {k: dist.gather(v).cpu()[order] for k, v in local.items()}
    group_ids = run.sampler.group_keys(everyone[order], dist.gather(rollouts.indices).cpu()[order])
    advantages, adv_stats = combine_rewards(
        components,
        dict(cfg.reward.weights),
        group_ids,
        mode=cfg.reward.aggregation,
        global_std=algo.global_std,
        clip_max=algo.adv_clip_max,
        std_estimator=algo.std_estimator,
        eps=algo.adv_eps,
    )
    total = flow_run.weighted_total(run, components)
    kl_gate, gardo_stats = None, {}
    if gardo is not None:  # GARDO: diversity-shaped advantages, the KL gate, the reference refresh
        advantages, kl_gate, gardo_stats = gardo.on_batch(
            run, epoch, rollouts, order, mine, advantages, components, total, group_ids
        )
    advantages = advantages[mine]
    keep = best_and_worst(total[mine], run.sampler.group_keys(mine, rollouts.indices), algo.best_of_n)
    num_batches = None  # micro-batches of algo.train_batch_size
    if algo.drop_zero_advantage:  # as many micro-batches, each smaller (docs/maths.md §4.5)
        num_batches = math.ceil(len(keep) / algo.train_batch_size)
        fill = torch.Generator().manual_seed(  # keyed by the process's first sample, not its rank
            stream_seed(cfg.seed, epoch, int(mine[0]), salt=Stream.ZERO_ADVANTAGE_FILL)
        )
        keep = keep[nonzero_advantage_rows(advantages[keep], num_batches, fill)]

    # 4. update
    with timed(timings, "time/update"):
        orders = training_orders(algo.shuffle_samples, cfg.seed, epoch, algo.num_inner_epochs, len(keep))
        update_stats = update_values(
            run,
            rollouts.select(keep),
            advantages[keep],
            progress,
            num_batches,
            None if kl_gate is None else kl_gate[keep],
            orders,
        )
        update_stats[common.KL_TO_REFERENCE] = reference_kl(run, rollouts, mine.tolist())

    flow_run.save_rollout_images(run, rollouts.images, epoch)
    stats = common.reduce_over_ranks(dist, {**reward_details, **update_stats, "trained_samples": len(keep)})
    return {
        "lr": lr,
        **flow_run.reward_metrics(run, components),
        **{f"reward/{k}/std": v.std().item() for k, v in components.items()},
        **stats,
        "zero_std_ratio": adv_stats.zero_std_ratio,
        "num_groups": adv_stats.num_groups,
        **timings,
        "peak_memory_mb": common.peak_memory_mb(run.device),
        "global_step": run.global_step,
        **dist.loss_scale_metrics(),
        **gardo_stats,
    }


# -- rollout -------------------------------------------------------------------------------------------
def plan_for(run: FlowRun, epoch: int, batch_size: int) -> WindowPlan:
    """This epoch's window (shared by every rollout batch of the epoch)."""
    window = run.cfg.algo.window
    generator = torch.Generator().manual_seed(stream_seed(run.cfg.seed, epoch, 0, salt=Stream.WINDOW))
    return plan_window(
        window.kind,
        run.cfg.model.num_steps,
        epoch=epoch,
        generator=generator,
        batch_size=batch_size,
        **window.options(),
    )


def sample_rollouts(
    run: FlowRun, epoch: int, progress: Progress, on_batch: RolloutBatch | None = None
) -> Rollouts:
    """Roll out this process's share of the epoch's samples in batches of ``sample_batch_size``;
    ``on_batch`` receives each batch as soon as it is decoded. The share: whole pieces of
    ``algo.assignment_unit`` samples dealt round-robin over processes (``data/sampler.py``), so every
    sample is rolled out and trained in the same batch, and optimizer step s covers the same global
    micro-batches, on any process count."""
    cfg, algo = run.cfg, run.cfg.algo
    indices = run.sampler.indices_for_epoch(epoch, algo.assignment_unit)
    examples, prompts, metadata = flow_run.examples_of(run.train_set, indices)
    positions = run.sampler.positions(algo.assignment_unit)  # places in the epoch's global batch
    plan = plan_for(run, epoch, len(indices))
    share = algo.shared_initial_noise or algo.branch == "shared_prefix"  # a prefix is per group
    noise_keys = [p // algo.group_size for p in positions] if share else positions
    initial = sample_generators(cfg.seed, epoch, noise_keys, run.device, salt=Stream.INITIAL_NOISE)
    steps = sample_generators(cfg.seed, epoch, positions, run.device, salt=Stream.STEP_NOISE)
    start = min(plan.sde_steps) if algo.branch == "shared_prefix" else 0
    sources = flow_run.sources_of(run, examples, run.train_set)
    spec = flow_run.step_spec(cfg)
    conds, trajs, images = [], [], []
    with common.progress_task(progress, "rollout", len(indices)) as advance:
        for part in batches(len(indices), algo.sample_batch_size):
            batch_sources = None if sources is None else sources[part]
            cond = run.policy.encode(prompts[part], None if sources is None else batch_sources.to(run.device))
            with cfg_gradient(rollout_cfg_mode(algo)):
                x = initial_latents(run, cond, initial[part], start, plan.num_steps)
                trajs.append(rollout_batch(run, cond, x, plan, spec, steps[part], start))
            conds.append(cond)
            images.append(run.policy.decode(trajs[-1].final).cpu())
            if on_batch is not None:
                on_batch(images[-1], prompts[part], metadata[part], batch_sources)
            advance(part.stop - part.start)
    traj = Trajectory.cat(trajs)
    if plan.train_mask is not None:
        traj = replace(traj, train_mask=plan.train_mask.to(run.device))
    return Rollouts(
        indices=torch.tensor(indices),
        prompts=prompts,
        metadata=metadata,
        cond=Cond.cat(conds),
        traj=traj,
        images=torch.cat(images),
        sources=sources,
    )


def rollout_cfg_mode(algo: FlowGrpoAlgoConfig) -> str:
    """How the rollout runs its CFG branches. Per-step training (``timesteps_per_pass=1``) recomputes
    them as the rollout ran them (``cfg_grad=conditional``: two passes), so the recorded log-probs are
    exactly what training recomputes. Folded training already relies on the network being batch-invariant
    (its passes hold other row counts than the rollout's), so the rollout takes the cheaper single pass:
    without gradients the two modes compute the same values."""
    return algo.cfg_grad if algo.timesteps_per_pass == 1 else "both"


def initial_latents(
    run: FlowRun, cond: Cond, generators: list[torch.Generator], start: int, num_steps: int
) -> Tensor:
    """x at ``sigmas[start]``: the initial noise, or — for a shared prefix — each group's common ODE
    prefix, computed once per distinct noise stream and copied to the group (the cheaper Fast)."""
    x = run.policy.noise(len(generators), generators)
    if start == 0:
        return x
    sigmas = run.policy.schedule(num_steps, x)[: start + 1]
    firsts = first_of_runs(generators)  # one prefix per run of samples sharing a noise stream
    prefix = euler(functools.partial(conditioned, run.policy, cond.index(firsts)), x[firsts], sigmas)
    return prefix[run_ids(generators)]


def rollout_batch(
    run: FlowRun,
    cond: Cond,
    x: Tensor,
    plan: WindowPlan,
    spec: StepSpec,
    steps: list[torch.Generator],
    start: int = 0,
) -> Trajectory:
    """One rollout batch from ``x`` at ``sigmas[start]``; sample i's step noise from generator i."""
    algo = run.cfg.algo
    sigmas = run.policy.schedule(plan.num_steps, x)
    velocity = functools.partial(conditioned, run.policy, cond)
    return rollout(
        velocity,
        x,
        sigmas,
        plan,
        spec,
        steps,
        start=start,
        flash_ratio=algo.flash.ratio if algo.flash.enabled else None,
        store_means=algo.objective == "grpo_guard",  # GRPO-Guard's loss compares new and old step means
    )


# -- update --------------------------------------------------------------------------------------------
def step_logprob(
    run: FlowRun, traj: Trajectory, cond: Cond, j: int, spec: StepSpec
) -> tuple[StepOut, Tensor | None]:
    """The training-path step ``j`` (log-prob and mean, with gradients) — and its KL to the reference
    (LoRA disabled) when ``algo.kl_weight`` > 0."""
    algo = run.cfg.algo
    velocity = functools.partial(conditioned, run.policy, cond)
    with cfg_gradient(algo.cfg_grad):
        out = recompute_step(velocity, traj, j, spec)
    if algo.kl_weight <= 0:
        return out, None
    with torch.no_grad(), run.policy.trainable.reference():
        ref = recompute_step(velocity, traj, j, spec)
    dt = traj.sigmas_next[j] - traj.sigmas[j]
    return out, step_kl(
        out.mean, ref.mean, out.std, dt, form=algo.kl_form, reduce=spec.reduce, kind=spec.kind
    )


def reference_kl(run: FlowRun, rollouts: Rollouts, positions: list[int]) -> list[float]:
    """The KL of the updated policy's SDE step to the reference's (LoRA disabled), measured after the
    update at each probe sample's first trained step (positions: this process's places in the global
    batch): one no-grad forward of each, so runs with ``algo.kl_weight`` 0 show how far they moved too.
    A process that holds no probe sample still runs the forwards (``common.kl_probe_rows``), measuring nothing."""
    algo, spec = run.cfg.algo, flow_run.step_spec(run.cfg)
    values = []
    for i, measured in common.kl_probe_rows(positions):
        one = torch.tensor([i])
        traj = rollouts.traj.index(one)
        trained = trained_rows(traj)
        j = trained[0][0] if trained else 0  # a sample that trains no step still runs the forwards
        velocity = functools.partial(conditioned, run.policy, rollouts.cond.index(one))
        with torch.no_grad():
            out = recompute_step(velocity, traj, j, spec)
            with run.policy.trainable.reference():
                ref = recompute_step(velocity, traj, j, spec)
        if measured and trained:
            dt = traj.sigmas_next[j] - traj.sigmas[j]
            values.append(
                step_kl(
                    out.mean, ref.mean, out.std, dt, form=algo.kl_form, reduce=spec.reduce, kind=spec.kind
                )
                .mean()
                .item()
            )
    return values


def folded_logprobs(
    run: FlowRun, traj: Trajectory, cond: Cond, fold: Fold, spec: StepSpec
) -> list[tuple[StepOut, Tensor | None]]:
    """:func:`step_logprob` for every (step, samples) of ``fold``: one step alone is upstream's call; more
    share one transformer call (rows = samples × steps, each its own x_t and σ; ``sde.recompute_steps``),
    and one reference call for their KLs."""
    if len(fold) == 1:
        j, rows = fold[0]
        return [step_logprob(run, traj.index(rows), cond.index(rows), j, spec)]
    algo = run.cfg.algo
    rows_cond = cond.index(fold_rows(traj.logprobs.shape[0], fold, traj.logprobs.device))
    velocity = functools.partial(conditioned, run.policy, rows_cond)
    with cfg_gradient(algo.cfg_grad):
        outs = recompute_steps(velocity, traj, fold, spec)
    if algo.kl_weight <= 0:
        return [(out, None) for out in outs]
    with torch.no_grad(), run.policy.trainable.reference():
        refs = recompute_steps(velocity, traj, fold, spec)
    return [
        (
            out,
            step_kl(
                out.mean,
                ref.mean,
                out.std,
                traj.sigmas_next[j] - traj.sigmas[j],
                form=algo.kl_form,
                reduce=spec.reduce,
                kind=spec.kind,
            ),
        )
        for (j, _), out, ref in zip(fold, outs, refs)
    ]


def step_loss(
    algo: FlowGrpoAlgoConfig,
    out: StepOut,
    kl: Tensor | None,
    step_traj: Trajectory,
    j: int,
    adv: Tensor,
    kl_gate: Tensor | None = None,
) -> GRPOLossOut:
    """The objective's loss of step ``j`` over the samples of ``step_traj`` (advantages ``adv``); with
    ``kl_gate`` (B,) the KL term averages over the gated samples only (GARDO)."""
    if kl is not None and kl_gate is not None:
        kl = kl * gated_kl_weights(kl_gate).to(kl)
    if algo.objective == "grpo_guard":
        return guard_loss(
            out.logprob,
            step_traj.logprobs[:, j],
            out.mean,
            step_traj.means[:, j],
            *guard_scales(step_traj, j),
            adv,
            clip_range=algo.clip_range,
            kl=kl,
            kl_weight=algo.kl_weight,
        )
    return grpo_loss(
        out.logprob,
        step_traj.logprobs[:, j],
        adv,
        clip_range=algo.clip_range,
        kl=kl,
        kl_weight=algo.kl_weight,
    )


def step_folds(trained: list[tuple[int, Tensor | slice]], per_pass: int) -> list[Fold]:
    """The trained steps in consecutive groups of ``per_pass`` (``algo.timesteps_per_pass``): each group
    shares one transformer call and one backward."""
    return [trained[i : i + per_pass] for i in range(0, len(trained), per_pass)]


def update(
    run: FlowRun, rollouts: Rollouts, advantages: Tensor, progress: Progress, num_batches: int | None = None
) -> dict[str, float]:
    """:func:`update_values`, each statistic summarised over this process's micro-batches."""
    return summarise(update_values(run, rollouts, advantages, progress, num_batches))


def update_values(
    run: FlowRun,
    rollouts: Rollouts,
    advantages: Tensor,
    progress: Progress,
    num_batches: int | None = None,
    kl_gate: Tensor | None = None,
    orders: list[Tensor] | None = None,
) -> dict[str, list[float]]:
    """``num_inner_epochs`` passes of the per-step policy-gradient loss over every trained step, in
    ``num_batches`` equal micro-batches (default: batches of ``algo.train_batch_size``); the optimizer
    steps every ``gradient_accumulation_steps`` ÷ processes micro-batches. A micro-batch's trained steps
    are scored ``algo.timesteps_per_pass`` per transformer call and backward (:func:`folded_logprobs`).
    ``orders``: per inner epoch, the sample order micro-batches are cut from (``algo.shuffle_samples``)."""
    algo, spec = run.cfg.algo, flow_run.step_spec(run.cfg)
    n = len(rollouts.indices)
    micro_batches = list(batches(n, math.ceil(n / num_batches) if num_batches else algo.train_batch_size))
    accumulation = common.accumulation_per_process(algo, run.dist.world_size)  # the global count ÷ processes
    stats: dict[str, list[float]] = defaultdict(list)
    with common.progress_task(progress, "update", algo.num_inner_epochs * len(micro_batches)) as advance:
        for inner in range(algo.num_inner_epochs):
            for k, part in enumerate(micro_batches):
                part = part if orders is None else orders[inner][part]
                traj, cond = rollouts.traj.index(part), rollouts.cond.index(part)
                adv = advantages[part].to(run.device)
                gate = None if kl_gate is None else kl_gate[part].to(run.device)  # GARDO's KL gate
                steps_after = (k + 1) % accumulation == 0
                folds = step_folds(trained_rows(traj), algo.timesteps_per_pass)
                for f, fold in enumerate(folds):
                    losses = []
                    for (j, rows), (out, kl) in zip(fold, folded_logprobs(run, traj, cond, fold, spec)):
                        row_gate = None if gate is None else gate[rows]
                        loss = step_loss(algo, out, kl, traj.index(rows), j, adv[rows], row_gate)
                        losses.append(loss.loss)
                        for key, value in loss.stats.items():
                            stats[key].append(value)
                        stats["policy_loss"].append(loss.policy_loss.item())
                        stats["kl_loss"].append(loss.kl_loss.item())
                    # every step's loss has the same weight; one backward per fold (a sum of per-step
                    # losses: the same gradient); the micro-batch's last backward before an optimizer
                    # step synchronises the gradients over processes
                    run.dist.backward(
                        sum(losses) / (traj.num_steps * accumulation),
                        sync=steps_after and f == len(folds) - 1,
                    )
                if steps_after:
                    stats["grad_norm"].append(flow_run.optimizer_step(run))
                advance(1)
    return stats  # per micro-batch and step: reduced over processes by common.reduce_over_ranks


def trained_rows(traj: Trajectory) -> list[tuple[int, Tensor | slice]]:
    """(step j, the samples that train it) for every step some sample trains: all of them, unless a
    ``train_mask`` (DanceGRPO's per-sample step subsets) leaves samples out of a step."""
    if traj.train_mask is None:
        return [(j, slice(None)) for j in range(traj.num_steps)]
    mask = traj.train_mask
    return [(j, mask[:, j].nonzero().squeeze(1)) for j in range(traj.num_steps) if mask[:, j].any()]


def guard_scales(traj: Trajectory, j: int) -> tuple[Tensor, Tensor]:
    """GRPO-Guard's σ_t (B,) and sqrt(−dt) (B,) of step ``j``: the step's total std is s = σ_t·sqrt(−dt)."""
    sqrt_neg_dt = (traj.sigmas[j] - traj.sigmas_next[j]).sqrt().expand(traj.stds.shape[0])
    return traj.stds[:, j] / sqrt_neg_dt, sqrt_neg_dt


# -- the run -------------------------------------------------------------------------------------------
def console_line(m: dict[str, float]) -> str:
    """reward ± std, eval, the measured KL to the reference, clip fraction, the ratio's largest step away
    from 1, and the epoch's time."""
    ratio_off = max(abs(m.get("ratio_max", 1) - 1), abs(1 - m.get("ratio_min", 1)))
    seconds = m["time/rollout"] + m["time/reward"] + m["time/update"]
    return (
        f"reward {m['reward/mean']:+.4g}±{m['reward/std']:.3g}{flow_run.eval_suffix(m)}  kl {m.get(common.KL_TO_REFERENCE, 0.0):.2e}  "
        f"clipfrac {m.get('clipfrac', 0.0):.3f}  |ratio-1|max {ratio_off:.2e}  {seconds:.1f}s"
    )


def planned_window(cfg: Any, batch: int) -> WindowPlan:
    """The first epoch's window (which steps are stochastic and trained) of ``batch`` samples, as the run
    plans it."""
    return plan_for(types.SimpleNamespace(cfg=cfg), 0, batch)  # plan_for reads run.cfg only


class GrpoTracer(EpochTracer):
    """Flow-GRPO (``recipe=flow_grpo``): ``rollout_batch`` and ``policy.decode`` for one rollout
    batch, its trajectory and conditioning kept; ``update`` for one optimizer step — its folds of
    ``algo.timesteps_per_pass`` steps, the KL reference forward, the CFG branches as ``algo.cfg_grad``
    takes them, the backward, the clip, the AdamW step and the EMA. The step scores two folds of trained
    steps, or two micro-batches when one fold holds every trained step and gradients accumulate over
    micro-batches."""

    def kept_per_sample(self) -> int:
        batch = self.cfg.algo.sample_batch_size
        self.rollout_peak(batch)
        traj, cond = self._kept
        tensors = [getattr(traj, k) for k in traj._PER_SAMPLE] + list(cond.tensors.values())
        return math.ceil(distinct_bytes([t for t in tensors if isinstance(t, Tensor)]) / batch)

    def _rollout(self, batch: int) -> None:
        run, algo = self.run, self.cfg.algo
        cond = self.encode(batch)
        with cfg_gradient(rollout_cfg_mode(algo)):
            x = run.policy.noise(batch)
            traj = rollout_batch(
                run, cond, x, planned_window(self.cfg, batch), flow_run.step_spec(self.cfg), None
            )
        run.policy.decode(traj.final)  # the images go to host memory
        self._keep(batch, (traj, cond), cond)

    def _update_of(self, micro_batch: int) -> Callable[[], Any]:
        """The recipe's update of one optimizer step, ready to run (its inputs made outside the trace:
        they are the rollout's samples, counted as kept)."""
        traj, _ = self._kept
        per_pass = self.cfg.algo.timesteps_per_pass
        steps = min(traj.num_steps, 2 * per_pass)
        micro_batches = 2 if steps <= per_pass and self._accumulates() else 1
        rows = micro_batch * micro_batches
        samples = types.SimpleNamespace(
            indices=torch.arange(rows), traj=resized(traj, rows, steps), cond=self.encode(rows)
        )
        algo = replaced(
            self.cfg.algo, train_batch_size=micro_batch, gradient_accumulation_steps=micro_batches
        )
        run = replaced(self.run, cfg=replaced(self.cfg, algo=algo))
        advantages = torch.zeros(rows, device=META)
        return lambda: update(run, samples, advantages, Progress(False))


class GrpoShape(PlanShape):
    """Per-sample training whose forward scores ``algo.timesteps_per_pass`` trained steps of a sample."""

    tracer = GrpoTracer

    def folded_steps(self, cfg: Any) -> int:
        """``algo.timesteps_per_pass``, at most the steps the first epoch's window trains."""
        return min(cfg.algo.timesteps_per_pass, len(planned_window(cfg, 1).train_steps))


PLAN = GrpoShape()
"""What ``rlgen plan`` reads of this recipe."""

ONPOLICY_SPLITS = ("train", "test")
"""The prompt files ``rlgen check-onpolicy`` reads (its run is set up as training's)."""


def check_onpolicy(typed: FlowGrpoTrainConfig, cfg: DictConfig, perturb: Perturb) -> tuple[float, bool]:
    """``rlgen check-onpolicy``: every trained step's stored log-prob against its training-path recompute
    (folded as the update folds them); the worst error and whether it is within ``check.tolerance``."""
    run = flow_run.setup(typed, cfg)
    check = typed.check
    spec = flow_run.step_spec(typed)
    if check.train_noise_level is not None:
        spec = replace(spec, noise_level=check.train_noise_level)
    batch_size = check.train_batch_size or typed.algo.train_batch_size
    with Progress(typed.progress) as progress:
        rollouts = sample_rollouts(run, 0, progress)  # no scoring: only the log-probs matter
    perturb(run.policy.trainable.parameters())
    n, steps = len(rollouts.indices), rollouts.traj.num_steps
    ratio_err = torch.zeros(steps)
    logp_err = torch.zeros(steps)
    with torch.no_grad():
        for part in batches(n, batch_size):
            traj, cond = rollouts.traj.index(part), rollouts.cond.index(part)
            every_step = [(j, slice(None)) for j in range(steps)]  # folded as the update folds them
            for fold in step_folds(every_step, typed.algo.timesteps_per_pass):
                for (j, _), (out, _) in zip(fold, folded_logprobs(run, traj, cond, fold, spec)):
                    new_logp = out.logprob
                    delta = (new_logp - traj.logprobs[:, j]).abs().max().cpu()
                    ratio = (torch.exp(new_logp - traj.logprobs[:, j]) - 1).abs().max().cpu()
                    logp_err[j] = torch.maximum(logp_err[j], delta)
                    ratio_err[j] = torch.maximum(ratio_err[j], ratio)
    run.logger.close()
    worst = float(ratio_err.max().maximum(logp_err.max()))
    _report_onpolicy(rollouts.traj, ratio_err, logp_err, check.tolerance, worst)
    return worst, worst <= check.tolerance


def _report_onpolicy(
    traj, ratio_err: torch.Tensor, logp_err: torch.Tensor, tolerance: float, worst: float
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="on-policy check: training-path recompute vs rollout")
    for column in ("step", "σ", "σ next", "max |ratio − 1|", "max |Δ log p|"):
        table.add_column(column, justify="right")
    for j in range(len(ratio_err)):
        table.add_row(
            str(int(traj.step_indices[j])),
            f"{float(traj.sigmas[j]):.4f}",
            f"{float(traj.sigmas_next[j]):.4f}",
            f"{float(ratio_err[j]):.3e}",
            f"{float(logp_err[j]):.3e}",
        )
    console = Console()
    console.print(table)
    verdict = "[green]PASS[/]" if worst <= tolerance else "[bold red]FAIL[/]"
    console.print(f"{verdict} max error {worst:.3e} (tolerance {tolerance:.1e})")


def run(cfg: FlowGrpoTrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the shared session (``recipes/flow_run.py``) around :func:`grpo_epoch`; the last epoch's metrics."""
    with session(cfg, raw_cfg) as s:
        log.info("%s window over %d steps", cfg.algo.window.kind, cfg.model.num_steps)
        gardo = GardoHooks.for_run(s.run)
        for epoch in s.epochs():
            metrics = grpo_epoch(s.run, epoch, s.progress, gardo)
            if s.end_epoch(epoch, metrics, console_line, headline=f"reward {metrics['reward/mean']:+.4g}"):
                break
    return s.metrics
