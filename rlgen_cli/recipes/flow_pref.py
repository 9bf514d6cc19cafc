"""Flow-DPO and reward-filtered SFT: preference and imitation objectives on online samples.

* **Flow-DPO** (Diffusion-DPO, Wallace et al. 2023, in its flow-matching form, Liu et al. 2025): each
  epoch the *reference* samples K images per prompt; the best and worst by reward form a pair; both are
  noised with the same σ (logit-normal over the 1000-step training schedule) and ε, and the policy is
  pushed to lower its flow-matching error on the winner relative to the reference more than on the
  loser. ``ref_update_step = 0`` keeps the base model as reference (offline); N > 0 copies the policy
  into the reference every N optimizer steps (online DPO).
* **SFT**: the policy samples; the ``top_k`` best of each group are regressed on with the flow-matching
  loss, weighted by their (non-negative) advantage — honoured whatever the anchor weight is (upstream
  drops it at 0) — plus ``anchor_weight``·‖v_θ − v_base‖² to stay near the base model.

:func:`pref_epoch` is one epoch: sample → reward → update (one optimizer step per trained σ). :func:`run`
wraps the epochs in the shared loop (``recipes/loop.py``): evaluation, logs, checkpoints, resume.

    rlgen train algo=dpo
    rlgen train algo=sft algo.pref.top_k=2
"""

from __future__ import annotations

import functools
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.algos import (
    dpo_loss,
    flow_matching_error,
    group_advantages,
    preference_pairs,
    sample_dpo_sigmas,
    select_best,
    sft_loss,
)
from rlgen_cli.models import Cond
from rlgen_cli.recipes import loop
from rlgen_cli.recipes.loop import FlowRun, summarise, timed
from rlgen_cli.recipes.session import session
from rlgen_cli.schema.recipes import FlowPrefTrainConfig
from rlgen_cli.sde.noise import Stream, stream_seed
from rlgen_cli.sde.sampling import batches, conditioned, sample_latents
from rlgen_cli.training.ema import EMA
from rlgen_cli.training.progress import Progress
from rlgen_cli.training.schedule import apply_lr_schedule

TRAIN_SCHEDULE_STEPS = 1000


@dataclass
class Preference:
    """What DPO / SFT add to the run: the training σ table and, for online DPO, the reference copy."""

    sigma_table: Tensor
    """σ of the 1000-step training schedule (the model's shift applied), where training σ are drawn."""
    reference_copy: EMA | None
    """Online DPO: an EMA with decay 0 — an exact copy of the policy every ``ref_update_step`` steps."""

    @classmethod
    def build(cls, run: FlowRun) -> Preference:
        pref = run.cfg.algo.pref
        table = run.policy.schedule(TRAIN_SCHEDULE_STEPS, run.policy.noise(1))[:-1]
        copy = None
        if pref.loss == "dpo" and pref.ref_update_step > 0:
            params = run.policy.trainable.parameters()
            copy = EMA(params, decay=0.0, update_every=pref.ref_update_step, gather=run.dist.gathered)
        return cls(table, copy)

    def reference(self, run: FlowRun) -> AbstractContextManager[Any]:
        """The DPO reference: the periodic copy of the policy (online) or the base model (offline)."""
        return (
            self.reference_copy.swap()
            if self.reference_copy is not None
            else run.policy.trainable.reference()
        )


def pref_epoch(run: FlowRun, pref_state: Preference, epoch: int, progress: Progress) -> dict[str, float]:
    """sample (DPO: from the reference) → reward → DPO or SFT update; the epoch's metrics."""
    cfg, algo = run.cfg, run.cfg.algo
    lr = apply_lr_schedule(run.optimizer, algo, epoch, cfg.epochs, run.time_progress)
    indices = run.sampler.indices_for_epoch(epoch)
    _, prompts, metadata = loop.examples_of(run.train_set, indices)
    timings: dict[str, float] = {}
    with timed(timings, "time/rollout"):
        sampler = pref_state.reference(run) if algo.pref.loss == "dpo" else nullcontext()
        with sampler, loop.progress_task(progress, "sampling", len(prompts)) as advance:
            x0 = sample_latents(
                run.policy, prompts, cfg.model.num_steps, algo.sample_batch_size, cfg.seed,
                spec=loop.step_spec(cfg), epoch=epoch, on_batch=advance,
            )  # fmt: skip
        parts = list(batches(len(x0), algo.sample_batch_size))
        images = torch.cat([run.policy.decode(x0[p]).cpu() for p in parts])
    with timed(timings, "time/reward"):
        components, details = loop.score(run, images, prompts, metadata)
    total = loop.weighted_total(run, components)
    loop.save_rollout_images(run, images, epoch)
    with timed(timings, "time/update"):
        cond = Cond.cat([run.policy.encode(prompts[p]) for p in parts])
        groups = torch.tensor(indices)
        if algo.pref.loss == "dpo":
            stats = dpo_update(run, pref_state, epoch, x0, cond, total, groups)
        else:
            stats = sft_update(run, pref_state, epoch, x0, cond, total, groups)
    return {
        "lr": lr, **loop.reward_metrics(run, components), **details, **stats, **timings,
        "global_step": run.global_step, **run.dist.loss_scale_metrics(),
    }  # fmt: skip


def noised(
    run: FlowRun, pref_state: Preference, epoch: int, x0: Tensor, t: int
) -> tuple[Tensor, Tensor, Tensor]:
    """σ (B,), ε (B, ...) and x_σ for every row of ``x0`` — rows passed together share nothing."""
    generator = torch.Generator(device=run.device).manual_seed(
        stream_seed(run.cfg.seed, epoch, t, Stream.PREF_SIGMA)
    )
    sigma = sample_dpo_sigmas(x0.shape[0], pref_state.sigma_table, generator)
    noise = torch.randn(x0.shape, generator=generator, device=run.device)
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return sigma, noise, (1 - s) * x0 + s * noise


def dpo_update(
    run: FlowRun, pref_state: Preference, epoch: int, x0: Tensor, cond: Cond, rewards: Tensor, groups: Tensor
) -> dict[str, float]:
    """One optimizer step per training σ on the best-vs-worst pair of every group."""
    pairs = preference_pairs(rewards, groups)
    chosen, rejected = pairs.chosen.to(x0.device), pairs.rejected.to(x0.device)
    stats: dict[str, list[float]] = defaultdict(list)
    for t in range(run.cfg.algo.pref.timesteps_per_sample):
        sigma, noise, _ = noised(run, pref_state, epoch, x0[chosen], t)  # one σ, ε per pair
        s = sigma.view(-1, *([1] * (x0.dim() - 1)))
        errors = {}
        # reference first: the online reference swaps weights in place, which must not happen between
        # the policy's forward and its backward
        for owner in ("ref", "policy"):
            for name, rows in (("w", chosen), ("l", rejected)):
                velocity = functools.partial(conditioned, run.policy, cond.index(rows))
                frozen = torch.no_grad() if owner == "ref" else nullcontext()
                weights = pref_state.reference(run) if owner == "ref" else nullcontext()
                with frozen, weights:
                    v = velocity((1 - s) * x0[rows] + s * noise, sigma)
                    errors[f"{owner}_{name}"] = flow_matching_error(v, x0[rows], noise)
        out = dpo_loss(
            errors["policy_w"], errors["policy_l"], errors["ref_w"], errors["ref_l"],
            beta=run.cfg.algo.pref.dpo_beta,
        )  # fmt: skip
        run.dist.backward(out.loss)
        stats["grad_norm"].append(loop.optimizer_step(run))
        if pref_state.reference_copy is not None:
            pref_state.reference_copy.step(run.global_step)
        for key, value in {**out.stats, "dpo_loss": out.loss.item()}.items():
            stats[key].append(float(value))
    stats["pairs"].append(float(len(chosen)))
    stats["skipped_groups"].append(float(pairs.num_skipped))
    return summarise(stats)


def sft_update(
    run: FlowRun, pref_state: Preference, epoch: int, x0: Tensor, cond: Cond, rewards: Tensor, groups: Tensor
) -> dict[str, float]:
    """One optimizer step per training σ on the ``top_k`` best of every group, weighted by advantage."""
    algo, pref = run.cfg.algo, run.cfg.algo.pref
    keep = select_best(rewards, groups, top_k=pref.top_k)
    advantages, _ = group_advantages(
        rewards, groups, global_std=algo.global_std, std_estimator=algo.std_estimator, eps=algo.adv_eps
    )
    weights = advantages[keep].clamp(min=0).to(x0.device)
    rows = keep.to(x0.device)
    velocity = functools.partial(conditioned, run.policy, cond.index(rows))
    stats: dict[str, list[float]] = defaultdict(list)
    for t in range(pref.timesteps_per_sample):
        sigma, noise, x_sigma = noised(run, pref_state, epoch, x0[rows], t)
        v_base = None
        if pref.anchor_weight > 0:
            with torch.no_grad(), run.policy.trainable.reference():
                v_base = velocity(x_sigma, sigma)
        out = sft_loss(
            velocity(x_sigma, sigma),
            x0[rows],
            noise,
            v_base=v_base,
            anchor_weight=pref.anchor_weight,
            weights=weights,
        )
        run.dist.backward(out.loss)
        stats["grad_norm"].append(loop.optimizer_step(run))
        for key, value in {**out.stats, "sft_loss": out.loss.item()}.items():
            stats[key].append(float(value))
    stats["trained_samples"].append(float(len(keep)))
    return summarise(stats)


def console_line(m: dict[str, float]) -> str:
    """reward ± std, eval, the epoch's loss and time."""
    loss = m.get("dpo_loss", m.get("sft_loss", float("nan")))
    seconds = m["time/rollout"] + m["time/reward"] + m["time/update"]
    return f"reward {m['reward/mean']:+.4g}±{m['reward/std']:.3g}{loop.eval_suffix(m)}  loss {loss:.4g}  {seconds:.1f}s"


def run(cfg: FlowPrefTrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the shared session (``recipes/loop.py``) around :func:`pref_epoch`; the last epoch's metrics."""
    with session(cfg, raw_cfg) as s:
        pref_state = Preference.build(s.run)
        for epoch in s.epochs():
            metrics = pref_epoch(s.run, pref_state, epoch, s.progress)
            if s.end_epoch(epoch, metrics, console_line, headline=f"reward {metrics['reward/mean']:+.4g}"):
                break
    return s.metrics
