"""Flow-DPO and reward-filtered SFT: preference and imitation objectives on online samples.

* **Flow-DPO** (Diffusion-DPO, Wallace et al. 2023, in its flow-matching form, Liu et al. 2025): each
  epoch the *reference* samples K images per prompt; the best and worst by reward form a pair; both are
  noised with the same σ (logit-normal over the 1000-step training schedule) and ε, and the policy is
  pushed to lower its flow-matching error on the winner relative to the reference more than on the
  loser. ``ref_update_step = 0`` keeps the base model as reference (offline); N > 0 copies the policy
  into the reference every N optimizer steps (online DPO), and checkpoints keep that copy, so a resumed
  run samples from the same reference as an uninterrupted one.
* **SFT**: the policy samples; the ``top_k`` best of each group are regressed on with the flow-matching
  loss, weighted by their (non-negative) advantage — honoured whatever the anchor weight is (upstream
  drops it at 0) — plus ``anchor_weight``·‖v_θ − v_base‖² to stay near the base model.

:func:`pref_epoch` is one epoch: sample → reward → update (one optimizer step per trained σ). :func:`run`
wraps the epochs in the shared loop (``recipes/flow_run.py``): evaluation, logs, checkpoints, resume.

    rlgen train algo=dpo
    rlgen train algo=sft algo.pref.top_k=2
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import types
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from rlgen_cli.algos import (
    dpo_loss,
    flow_matching_error,
    group_advantages,
    preference_pairs,
    sample_dpo_sigmas,
    select_best,
    sft_loss,
)
from rlgen_cli.errors import UserError
from rlgen_cli.recipes import common, flow_run
from rlgen_cli.recipes.common import reduce_over_ranks, timed
from rlgen_cli.recipes.flow_run import FlowRun
from rlgen_cli.recipes.flow_run import splits_read as splits_read
from rlgen_cli.recipes.plan_shape import PlanShape
from rlgen_cli.recipes.plan_trace import Encode, EpochTracer, replaced, rows_of, rows_per_unit
from rlgen_cli.recipes.session import session
from rlgen_cli.schema.recipes import FlowPrefTrainConfig
from rlgen_cli.sde.noise import Stream, randn_per_sample, sample_generators
from rlgen_cli.sde.sampling import batches, conditioned, sample_latents
from rlgen_cli.training.control.ema import EMA
from rlgen_cli.training.control.schedule import apply_lr_schedule
from rlgen_cli.training.reporting.progress import Progress

log = logging.getLogger(__name__)

TRAIN_SCHEDULE_STEPS = 1000
REFERENCE_KEY = "dpo_reference"  # trainer-state entry of online DPO's reference copy


@dataclass
class Preference:
    """What DPO / SFT add to the run: the training σ table and, for online DPO, the reference copy."""

    sigma_table: Tensor
    """σ of the 1000-step training schedule (the model's shift applied), where training σ are drawn."""
    reference_copy: EMA | None
    """Online DPO: an EMA with decay 0 — an exact copy of the policy every ``ref_update_step`` steps."""

    @classmethod
    def build(cls, run: FlowRun) -> Preference:
        """The σ table and, for online DPO, the reference copy: the resumed checkpoint's, else a copy of
        the current weights (:func:`_resumed_reference` says when that is refused)."""
        pref = run.cfg.algo.pref
        table = run.policy.schedule(TRAIN_SCHEDULE_STEPS, run.policy.noise(1))[:-1]
        copy = None
        if pref.loss == "dpo" and pref.ref_update_step > 0:
            params = run.policy.trainable.parameters()
            copy = EMA(params, decay=0.0, update_every=pref.ref_update_step, gather=run.dist.gathered)
            saved = _resumed_reference(run)
            if saved is not None:
                copy.load_state_dict(saved)
        return cls(table, copy)

    def extra_state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this state (``flow_run.save``'s ``extra_state``): the online
        reference copy, which a resume cannot rebuild from the weights between two refreshes."""
        if self.reference_copy is None:
            return None
        return {REFERENCE_KEY: self.reference_copy.state_dict()}

    def reference(self, run: FlowRun) -> AbstractContextManager[Any]:
        """The DPO reference: the periodic copy of the policy (online) or the base model (offline)."""
        return (
            self.reference_copy.swap()
            if self.reference_copy is not None
            else run.policy.trainable.reference()
        )


def _resumed_reference(run: FlowRun) -> dict[str, Any] | None:
    """Online DPO: the reference copy the resumed checkpoint saved (None when the run starts afresh, or
    resumes a checkpoint without one at a refresh, where the copy equals the weights it was loaded with).

    Raises:
        UserError: A checkpoint without the copy (saved before rlgen kept it) between two refreshes:
            the copy was the weights of an earlier step, which the checkpoint does not hold.
    """
    if REFERENCE_KEY in run.resumed_extra:
        return run.resumed_extra[REFERENCE_KEY]
    every, step = run.cfg.algo.pref.ref_update_step, run.global_step
    if step % every:
        raise UserError(
            f"the resumed checkpoint (epoch {run.start_epoch}, global_step {step}) does not hold online "
            "DPO's reference copy (one saved by an older rlgen lacks it), and "
            f"with algo.pref.ref_update_step={every} that copy holds the weights of global_step "
            f"{step - step % every}, not the checkpoint's: resume a checkpoint whose global_step is a "
            f"multiple of algo.pref.ref_update_step={every} (resume=PATH; "
            "there the copy equals the weights), or start the run afresh"
        )
    return None


@dataclass
class EpochSamples:
    """The epoch's samples over every process, in global order (B = prompts_per_epoch × group_size)."""

    x0: Tensor  # (B, ...) clean latents
    prompts: list[str]
    rewards: Tensor  # (B,) the mix's total
    groups: Tensor  # (B,) the group keys (GroupSampler.group_keys: each draw of a prompt)


@dataclass
class TrainingUnits:
    """What one optimizer step trains over all processes: DPO's pairs or SFT's kept samples, as rows of
    :class:`EpochSamples` (``rejected`` for DPO only), with SFT's per-sample weights."""

    rows: Tensor  # (U,) the chosen / kept samples
    rejected: Tensor | None = None  # (U,) DPO: the rejected sample of each pair
    weights: Tensor | None = None  # (U,) SFT: the non-negative advantages

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, part: slice) -> TrainingUnits:
        """The units in ``part``."""
        return TrainingUnits(
            *(None if v is None else v[part] for v in (self.rows, self.rejected, self.weights))
        )


def pref_epoch(run: FlowRun, pref_state: Preference, epoch: int, progress: Progress) -> dict[str, float]:
    """sample (DPO: from the reference) → reward → DPO or SFT update; the epoch's metrics. Every process
    rolls out whole rollout batches dealt round-robin, its noise keyed by global position; the samples are
    gathered in global order, the pairs (or kept samples) chosen from all of them, and every optimizer step
    trains them in global micro-batches (:func:`train_units`): the run does not depend on the process count."""
    cfg, algo = run.cfg, run.cfg.algo
    lr = apply_lr_schedule(run.optimizer, algo, epoch, cfg.epochs, run.time_progress)
    positions = run.sampler.positions(algo.sample_batch_size)  # this process's places in the global batch
    indices = run.sampler.indices_for_epoch(epoch, algo.sample_batch_size)
    _, prompts, metadata = flow_run.examples_of(run.train_set, indices)
    timings: dict[str, float] = {}
    with timed(timings, "time/rollout"):
        sampler = pref_state.reference(run) if algo.pref.loss == "dpo" else nullcontext()
        with sampler, common.progress_task(progress, "sampling", len(prompts)) as advance:
            x0 = sample_latents(
                run.policy,
                prompts,
                cfg.model.num_steps,
                algo.sample_batch_size,
                cfg.seed,
                spec=flow_run.step_spec(cfg),
                epoch=epoch,
                on_batch=advance,
                keys=positions,
            )
        parts = list(batches(len(x0), algo.sample_batch_size))
        images = torch.cat([run.policy.decode(x0[p]).cpu() for p in parts])
    with timed(timings, "time/reward"):  # batch by batch, as on any process count
        scores = [flow_run.score(run, images[p], prompts[p], metadata[p]) for p in parts]
    flow_run.save_rollout_images(run, images, epoch)
    samples, components = gather_samples(run, epoch, torch.tensor(positions), x0, scores)
    sizes = [float(p.stop - p.start) for p in parts]
    details = {k: common.Weighted([s[1][k] for s in scores], sizes) for k in scores[0][1]}
    with timed(timings, "time/update"):
        if algo.pref.loss == "dpo":
            stats, counts = dpo_update(run, pref_state, epoch, samples)
        else:
            stats, counts = sft_update(run, pref_state, epoch, samples)
    return {
        "lr": lr,
        **flow_run.reward_metrics(run, components),
        **reduce_over_ranks(run.dist, {**details, **stats}),
        **counts,
        **timings,
        "global_step": run.global_step,
        **run.dist.loss_scale_metrics(),
    }


def gather_samples(
    run: FlowRun, epoch: int, positions: Tensor, x0: Tensor, scores: list[tuple[dict[str, Tensor], Any]]
) -> tuple[EpochSamples, dict[str, Tensor]]:
    """Every process's latents and rewards of the epoch, put back in global order; and the reward
    components (B,) in that order."""
    dist = run.dist
    order = dist.gather(positions.to(run.device)).cpu().argsort()  # gathered rank by rank → global order
    local = {k: torch.cat([s[0][k] for s in scores]) for k in scores[0][0]}
    components = {k: dist.gather(v.to(run.device)).cpu()[order] for k, v in local.items()}
    everyone = run.sampler.global_indices_for_epoch(epoch)
    _, prompts, _ = flow_run.examples_of(run.train_set, everyone)
    samples = EpochSamples(
        x0=dist.gather(x0).to(run.device)[order.to(run.device)],
        prompts=prompts,
        rewards=flow_run.weighted_total(run, components),
        groups=run.sampler.group_keys(torch.arange(len(everyone)), torch.tensor(everyone)),
    )
    return samples, components


def noised(
    run: FlowRun, pref_state: Preference, epoch: int, x0: Tensor, t: int, keys: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """σ (B,), ε (B, ...) and x_σ for every row of ``x0``: row i draws them from its own stream keyed by
    (seed, epoch, training σ ``t``, ``keys[i]`` — its sample's place in the global batch), so neither the
    micro-batch nor the process that trains it changes them."""
    per_epoch = run.sampler.global_batch_size
    draws = sample_generators(
        run.cfg.seed, epoch, [t * per_epoch + int(k) for k in keys], run.device, salt=Stream.PREF_SIGMA
    )
    sigma = torch.cat([sample_dpo_sigmas(1, pref_state.sigma_table, g) for g in draws]).to(x0.dtype)
    noise = randn_per_sample(x0.shape[1:], draws, run.device).to(x0.dtype)
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return sigma, noise, (1 - s) * x0 + s * noise


def micro_batches(run: FlowRun, count: int) -> list[tuple[slice, float]]:
    """This process's micro-batches of one optimizer step over ``count`` units: the units cut into global
    micro-batches of ``algo.train_batch_size``, micro-batch b to process b mod N, each with the weight
    that makes the step's gradient the mean over all ``count`` units (its share × N: processes average
    their gradients). When the micro-batches do not fill every process's last round, the short processes
    repeat their first one with weight 0: every process runs the same forwards and backwards."""
    size, ranks = run.cfg.algo.train_batch_size, run.dist.world_size
    everyone = list(batches(count, size))
    rounds = math.ceil(len(everyone) / ranks)
    mine = []
    for b in range(run.dist.rank, rounds * ranks, ranks):
        part = everyone[b] if b < len(everyone) else everyone[0]
        weight = (part.stop - part.start) * ranks / count if b < len(everyone) else 0.0
        mine.append((part, weight))
    return mine


def dpo_update(
    run: FlowRun, pref_state: Preference, epoch: int, samples: EpochSamples
) -> tuple[dict[str, Any], dict[str, float]]:
    """One optimizer step per training σ on the best-vs-worst pair of every group (over all processes);
    the per-micro-batch statistics (weighted by their pairs) and the epoch's pair counts."""
    pairs = preference_pairs(samples.rewards, samples.groups)
    units = TrainingUnits(pairs.chosen, rejected=pairs.rejected)
    counts = {"pairs": float(len(units)), "skipped_groups": float(pairs.num_skipped)}
    loss = functools.partial(_dpo_loss, run, pref_state, samples)
    return train_units(
        run, epoch, units, loss, after_step=functools.partial(_refresh_reference, run, pref_state)
    ), counts


def _refresh_reference(run: FlowRun, pref_state: Preference) -> None:
    """Online DPO: the reference becomes a copy of the policy every ``ref_update_step`` steps."""
    if pref_state.reference_copy is not None:
        pref_state.reference_copy.step(run.global_step)


def _dpo_loss(
    run: FlowRun, pref_state: Preference, samples: EpochSamples, units: TrainingUnits, epoch: int, t: int
) -> tuple[Tensor, dict[str, float]]:
    """The mean DPO loss of ``units``' pairs at their training σ ``t`` (one σ and ε per pair)."""
    chosen, rejected = units.rows.to(run.device), units.rejected.to(run.device)
    cond = run.policy.encode([samples.prompts[i] for i in units.rows.tolist()])  # a pair shares its prompt
    sigma, noise, _ = noised(run, pref_state, epoch, samples.x0[chosen], t, units.rows)
    s = sigma.view(-1, *([1] * (noise.dim() - 1)))
    velocity = functools.partial(conditioned, run.policy, cond)
    errors = {}
    # reference first: the online reference swaps weights in place, which must not happen between the
    # policy's forward and its backward
    for owner in ("ref", "policy"):
        for name, rows in (("w", chosen), ("l", rejected)):
            frozen = torch.no_grad() if owner == "ref" else nullcontext()
            weights = pref_state.reference(run) if owner == "ref" else nullcontext()
            with frozen, weights:
                x0 = samples.x0[rows]
                errors[f"{owner}_{name}"] = flow_matching_error(
                    velocity((1 - s) * x0 + s * noise, sigma), x0, noise
                )
    out = dpo_loss(
        errors["policy_w"],
        errors["policy_l"],
        errors["ref_w"],
        errors["ref_l"],
        beta=run.cfg.algo.pref.dpo_beta,
    )
    return out.loss, {**out.stats, "dpo_loss": out.loss.item()}


def sft_update(
    run: FlowRun, pref_state: Preference, epoch: int, samples: EpochSamples
) -> tuple[dict[str, Any], dict[str, float]]:
    """One optimizer step per training σ on the ``top_k`` best of every group (over all processes),
    weighted by advantage; the per-micro-batch statistics and the epoch's count of trained samples."""
    algo, pref = run.cfg.algo, run.cfg.algo.pref
    keep = select_best(samples.rewards, samples.groups, top_k=pref.top_k)
    advantages, _ = group_advantages(
        samples.rewards,
        samples.groups,
        global_std=algo.global_std,
        std_estimator=algo.std_estimator,
        eps=algo.adv_eps,
    )
    units = TrainingUnits(keep, weights=advantages[keep].clamp(min=0))
    loss = functools.partial(_sft_loss, run, pref_state, samples)
    return train_units(run, epoch, units, loss), {"trained_samples": float(len(units))}


def _sft_loss(
    run: FlowRun, pref_state: Preference, samples: EpochSamples, units: TrainingUnits, epoch: int, t: int
) -> tuple[Tensor, dict[str, float]]:
    """The advantage-weighted flow-matching loss (+ the anchor) of ``units``' samples at training σ ``t``."""
    pref = run.cfg.algo.pref
    rows = units.rows.to(run.device)
    x0 = samples.x0[rows]
    cond = run.policy.encode([samples.prompts[i] for i in units.rows.tolist()])
    velocity = functools.partial(conditioned, run.policy, cond)
    sigma, noise, x_sigma = noised(run, pref_state, epoch, x0, t, units.rows)
    v_base = None
    if pref.anchor_weight > 0:
        with torch.no_grad(), run.policy.trainable.reference():
            v_base = velocity(x_sigma, sigma)
    out = sft_loss(
        velocity(x_sigma, sigma),
        x0,
        noise,
        v_base=v_base,
        anchor_weight=pref.anchor_weight,
        weights=units.weights.to(run.device),
    )
    return out.loss, {**out.stats, "sft_loss": out.loss.item()}


def train_units(
    run: FlowRun,
    epoch: int,
    units: TrainingUnits,
    loss_of: Callable[[TrainingUnits, int, int], tuple[Tensor, dict[str, float]]],
    after_step: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """``algo.pref.timesteps_per_sample`` optimizer steps, each over every unit at its own training σ, in
    this process's micro-batches (:func:`micro_batches`); ``loss_of(units, epoch, t)`` is a micro-batch's
    mean loss and its statistics. Returns each statistic per micro-batch, weighted by its units."""
    if len(units) == 0:  # every group tied: nothing to prefer or to keep
        log.info("epoch %d: no group has a preference; no update", epoch)
        return {}
    values: dict[str, list[float]] = defaultdict(list)
    sizes: list[float] = []
    norms: list[float] = []
    for t in range(run.cfg.algo.pref.timesteps_per_sample):
        for part, weight in micro_batches(run, len(units)):
            piece = units.select(part)
            loss, stats = loss_of(piece, epoch, t)
            run.dist.backward(loss * weight)
            if weight > 0:  # a repeated micro-batch (weight 0) only keeps the processes in step
                sizes.append(float(len(piece)))
                for key, value in stats.items():
                    values[key].append(float(value))
        norms.append(flow_run.optimizer_step(run))
        after_step()
    return {**{k: common.Weighted(v, sizes) for k, v in values.items()}, "grad_norm": norms}


def console_line(m: dict[str, float]) -> str:
    """reward ± std, eval, the epoch's loss and time."""
    loss = m.get("dpo_loss", m.get("sft_loss", float("nan")))
    seconds = m["time/rollout"] + m["time/reward"] + m["time/update"]
    return f"reward {m['reward/mean']:+.4g}±{m['reward/std']:.3g}{flow_run.eval_suffix(m)}  loss {loss:.4g}  {seconds:.1f}s"


class PrefTracer(EpochTracer):
    """Flow-DPO and reward-filtered SFT (``recipe=flow_pref``): ``sample_latents`` (DPO: under the
    reference's weights) and the decode for one batch, its x₀ kept; ``train_units`` for one
    optimizer step over its micro-batches of ``algo.train_batch_size`` units — DPO: a pair's reference
    velocities without gradients, then the policy's on the winner and on the loser, both graphs alive until
    the backward; SFT: the kept samples (and the base model's velocity for the anchor) — the backward, the
    clip, the AdamW step, the EMA, the online reference's refresh. The update holds this process's x₀ and
    the epoch's, gathered from every process. Two micro-batches are traced when gradients accumulate over
    them."""

    update_copies = 1
    update_global_copies = 1

    def __init__(self, cfg: Any, policy: Any, trained: list[nn.Module], encode: Encode) -> None:
        super().__init__(cfg, policy, trained, encode)
        with self._modes():
            self.pref = Preference.build(self.run)

    def _rollout(self, batch: int) -> None:
        cfg, run = self.cfg, self.run
        weights = self.pref.reference(run) if cfg.algo.pref.loss == "dpo" else contextlib.nullcontext()
        with weights:
            x0 = sample_latents(
                run.policy,
                [""] * batch,
                cfg.model.num_steps,
                batch,
                cfg.seed,
                spec=flow_run.step_spec(cfg),
                keys=range(batch),
            )
        run.policy.decode(x0)  # the images go to host memory
        self._keep(batch, (x0,), run.policy.last_cond)

    def _update_of(self, micro_batch: int) -> Callable[[], Any]:
        dpo = self.cfg.algo.pref.loss == "dpo"
        units = micro_batch * (2 if self._accumulates() else 1)
        rows = units * rows_per_unit(self.cfg)
        chosen = torch.arange(0, rows, rows_per_unit(self.cfg))
        training = TrainingUnits(
            chosen, rejected=chosen + 1 if dpo else None, weights=None if dpo else torch.ones(units)
        )
        samples = EpochSamples(
            x0=rows_of(self._kept[0], rows),
            prompts=[""] * rows,
            rewards=torch.zeros(rows),
            groups=torch.arange(rows),
        )
        algo = replaced(
            self.cfg.algo,
            train_batch_size=micro_batch,
            pref=replaced(self.cfg.algo.pref, timesteps_per_sample=1),
        )
        run = replaced(
            self.run, cfg=replaced(self.cfg, algo=algo), sampler=types.SimpleNamespace(global_batch_size=rows)
        )
        loss = _dpo_loss if dpo else _sft_loss
        after = functools.partial(_refresh_reference, run, self.pref)
        return lambda: train_units(run, 0, training, functools.partial(loss, run, self.pref, samples), after)


class PrefShape(PlanShape):
    """DPO trains pairs (a winner and a loser, two forwards kept for one backward), SFT its kept samples;
    one optimizer step per training σ over every unit of the epoch, so the micro-batches per step follow
    from the epoch (no setting chooses them). Online DPO keeps a reference copy."""

    tracer = PrefTracer

    accumulation_setting = None

    def weight_copies(self, cfg: Any) -> tuple[str, ...]:
        pref = cfg.algo.pref
        return ("online DPO reference",) if pref.loss == "dpo" and pref.ref_update_step > 0 else ()

    def micro_batch_unit(self, cfg: Any) -> str:
        return "pairs" if cfg.algo.pref.loss == "dpo" else "kept samples"

    def micro_batch(self, cfg: Any) -> tuple[int, str | None]:
        return min(cfg.algo.train_batch_size, pref_units(cfg)), "algo.train_batch_size"

    def rows_per_unit(self, cfg: Any) -> int:
        return 2 if cfg.algo.pref.loss == "dpo" else 1

    def micro_batches_per_process(self, cfg: Any) -> int:
        world = cfg.launcher.world_size
        return math.ceil(math.ceil(pref_units(cfg) / cfg.algo.train_batch_size) / world)


def pref_units(cfg: Any) -> int:
    """What one DPO / SFT optimizer step trains over every process: a pair per group (DPO; a group whose
    rewards tie has none: at most), the ``top_k`` best of each (SFT)."""
    groups = cfg.algo.prompts_per_epoch
    return groups if cfg.algo.pref.loss == "dpo" else cfg.algo.pref.top_k * groups


PLAN = PrefShape()
"""What ``rlgen plan`` reads of this recipe."""


def run(cfg: FlowPrefTrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the shared session (``recipes/flow_run.py``) around :func:`pref_epoch`; the last epoch's metrics."""
    with session(cfg, raw_cfg) as s:
        pref_state = Preference.build(s.run)
        for epoch in s.epochs():
            metrics = pref_epoch(s.run, pref_state, epoch, s.progress)
            headline = f"reward {metrics['reward/mean']:+.4g}"
            if s.end_epoch(epoch, metrics, console_line, headline, extra_state=pref_state.extra_state()):
                break
    return s.metrics
