"""Flow-GRPO and its family: online reinforcement learning of a flow-matching image model.

Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models via Online RL". Each epoch:

1. **rollout** — K samples per prompt; the window policy (``sde/window.py``) decides which steps are
   stochastic and trained; their transitions and log-probabilities are stored (fp32);
2. **score** — the reward mix scores the decoded images (every component logged);
3. **advantages** — rewards normalised within each prompt's group, groups keyed by dataset index;
4. **update** — ``num_inner_epochs`` passes of the per-step objective over the trained steps, with
   gradient accumulation, grad-norm clipping and an optional KL to the reference (LoRA disabled);
5. **log / eval / checkpoint** — metrics.jsonl, periodic ODE evaluation, full-state checkpoints.

The variants are configuration, not code paths: Flow-GRPO-Fast = ``window.kind=random_window``
(+ ``branch=shared_prefix``), MixGRPO = ``sliding`` (+ ``flash``), DanceGRPO = ``random_subset`` +
``sampler=dance`` + ``shared_initial_noise`` (+ ``best_of_n``), GRPO-Guard = ``objective=grpo_guard``.

Deliberate choices: samples keep their rollout batches in training (no shuffle), so with
``train_batch_size == sample_batch_size`` the first update is exactly on-policy (ratio == 1, checked by
``rlgen check-onpolicy``); every sample draws its noise from its own stream keyed by (seed, epoch,
position), so a resumed run draws the same noise as an uninterrupted one and the rollout batch size
does not change the samples.

    rlgen train                                     # tiny SD3 + JPEG compressibility on the CPU
    rlgen train model=sd3 algo=grpo_fast reward=jpeg_compressibility
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.algos import best_and_worst, combine_rewards, nonzero_advantage_rows
from rlgen_cli.algos.objectives import STEP_OBJECTIVES
from rlgen_cli.data import GroupSampler, PromptDataset
from rlgen_cli.data.paths import load_prompts
from rlgen_cli.launch.dist import Dist, make_dist
from rlgen_cli.models import Cond, FlowPolicy, build_policy, cfg_gradient
from rlgen_cli.recipes.loop import due, headline, peak_memory_mb, reduce_over_ranks, summarise, timed
from rlgen_cli.recipes.sampling import (
    INITIAL_NOISE,
    STEP_NOISE,
    WINDOW,
    batches,
    conditioned,
    sample_images,
    source_images_for,
)
from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import AlgoConfig, TrainConfig
from rlgen_cli.sde import euler, step_kl
from rlgen_cli.sde.noise import first_of_runs, run_ids, sample_generators, stream_seed
from rlgen_cli.sde.rollout import StepSpec, Trajectory, recompute_step, rollout
from rlgen_cli.sde.step import StepOut
from rlgen_cli.sde.window import WindowPlan, plan_window
from rlgen_cli.training.checkpoint import (
    COUNTERS_KEY,
    OPTIMIZER_KEY,
    SAMPLER_KEY,
    Checkpoint,
    engine_staging,
    resolve_resume,
    save_checkpoint,
    set_rng_state,
)
from rlgen_cli.training.ema import EMA
from rlgen_cli.training.images import save_grid
from rlgen_cli.training.metrics import NullLogger, build_loggers
from rlgen_cli.training.plots import plot_runs
from rlgen_cli.training.progress import Progress
from rlgen_cli.training.report import SHAPES_CURVES, detail_summaries, write_before_after
from rlgen_cli.training.schedule import apply_lr_schedule

log = logging.getLogger(__name__)
REWARD_CURVE = "reward_curve.png"
SHAPES_CURVE = "shapes_curves.png"
EMA_KEY, RAW_KEY = "ema", "raw_trainable"
ZERO_ADVANTAGE_FILL = 4  # salt of the stream that picks zero-advantage samples to fill micro-batches


@dataclass
class Rollouts:
    """One epoch's samples, in rollout order. N = prompts_per_epoch × group_size."""

    indices: Tensor  # (N,) dataset indices: the group keys
    prompts: list[str]
    metadata: list[dict]
    cond: Cond  # (N, ...)
    traj: Trajectory  # (N, S, ...)
    images: Tensor  # (N, 3, H, W) in [0, 1]
    sources: Tensor | None = None  # (N, 3, H, W) source images of editing sets
    scores: list[Future] = field(default_factory=list)  # per rollout batch: (components, summaries)

    def rewards(self) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Wait for the batches' scores: components (N,) in rollout order, summaries averaged by size."""
        results = [future.result() for future in self.scores]
        components = {k: torch.cat([r[0][k] for r in results]) for k in results[0][0]}
        sizes = [len(next(iter(r[0].values()))) for r in results]
        summaries = {k: sum(n * r[1][k] for n, r in zip(sizes, results)) / sum(sizes) for k in results[0][1]}
        return components, summaries

    def select(self, keep: Tensor) -> Rollouts:
        """The samples at positions ``keep`` (N',)."""
        picked = keep.tolist()
        return Rollouts(
            self.indices[keep], [self.prompts[i] for i in picked], [self.metadata[i] for i in picked],
            self.cond.index(keep), self.traj.index(keep), self.images[keep],
            None if self.sources is None else self.sources[keep],
        )  # fmt: skip


EpochFn = Callable[["FlowRLRecipe", int, Progress], dict[str, float]]


class FlowRLRecipe:
    """setup → train (rollout → score → advantages → update → log → eval → checkpoint) → cleanup."""

    def __init__(self, cfg: TrainConfig, raw_cfg: DictConfig, epoch_fn: EpochFn | None = None) -> None:
        """``epoch_fn`` replaces the policy-gradient epoch (``flow_pref`` plugs DPO / SFT in here); the
        loop around it — eval, logging, checkpoints, resume — stays the same."""
        self.cfg = cfg
        self.raw_cfg = raw_cfg
        self.run_dir = Path(cfg.run_dir)
        self.epoch_fn: EpochFn = epoch_fn or FlowRLRecipe.train_epoch
        self.eval_images: Tensor | None = None  # the last evaluation's samples (and the first's, below)
        self.before_images: Tensor | None = None

    # -- setup ----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.dist: Dist = make_dist(cfg.device)
        self.device = self.dist.device
        self.policy: FlowPolicy = build_policy(cfg.model, self.device)
        if self.dist.world_size > 1 or self.dist.sharded:
            _require_rank_symmetric(cfg.algo, fsdp=self.dist.engine == "fsdp")
        self.reward = build_mix(
            dict(cfg.reward.weights), **{k: dict(v) for k, v in cfg.reward.kwargs.items()}
        )
        self.train_set: PromptDataset = load_prompts(cfg.data.train, self.run_dir, "data.train")
        self.test_set: PromptDataset = load_prompts(cfg.data.test, self.run_dir, "data.test")
        self.sampler = GroupSampler(
            len(self.train_set), cfg.algo.prompts_per_epoch, cfg.algo.group_size, seed=cfg.seed,
            num_replicas=self.dist.world_size, rank=self.dist.rank,
        )  # fmt: skip
        noise_level = (
            cfg.sampler.noise_level if cfg.sampler.noise_level is not None else cfg.model.noise_level
        )
        self.spec = StepSpec(
            cfg.sampler.kind, noise_level, cfg.sampler.logprob_reduce, cfg.sampler.logprob_form
        )
        self.objective = STEP_OBJECTIVES[cfg.algo.objective]
        self.scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlgen-reward")
        params = self.policy.trainable_parameters()
        num_trainable = sum(p.numel() for p in params)  # counted before an engine shards them
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.algo.lr, betas=(cfg.algo.adam_beta1, cfg.algo.adam_beta2),
            eps=cfg.algo.adam_eps, weight_decay=cfg.algo.weight_decay,
        )  # fmt: skip
        ema = cfg.algo.ema
        self.ema = (  # ZeRO-3: updates and swaps gather the shards in the engine's own context
            EMA(
                params,
                decay=ema.decay,
                update_every=ema.update_every,
                warmup=ema.warmup,
                gather=self.dist.gathered,
            )  # fmt: skip
            if ema.enabled
            else None
        )
        self.start_epoch, self.global_step = 0, 0
        resumed = self._maybe_resume()  # into the whole modules, before an engine shards them
        # DDP wraps the transformer; DeepSpeed / FSDP also take the optimizer (launch/dist.py)
        self.optimizer = self.dist.prepare(
            self.policy, self.optimizer, max_grad_norm=cfg.algo.max_grad_norm,
            micro_batch_size=cfg.algo.train_batch_size,
        )  # fmt: skip
        if resumed is not None:
            ckpt, state = resumed
            self.dist.load_optimizer_state(self.optimizer, state[OPTIMIZER_KEY], ckpt.engine)
            set_rng_state(state["rng"])
        self.logger = (
            build_loggers(self.run_dir, cfg.logging, self.raw_cfg) if self.dist.is_main else NullLogger()
        )
        log.info(
            "%s on %s: %d trainable parameters, %d prompts × %d samples per epoch, %s window over %d steps",
            cfg.model.family, self.device, num_trainable, cfg.algo.prompts_per_epoch,
            cfg.algo.group_size, cfg.algo.window.kind, cfg.model.num_steps,
        )  # fmt: skip

    def _maybe_resume(self) -> tuple[Checkpoint, dict[str, Any]] | None:
        """Weights, EMA, sampler and counters of the checkpoint to resume (if any); returns it and its state,
        whose optimizer and RNG entries ``setup`` restores once the optimizer is prepared."""
        ckpt = resolve_resume(self.cfg.resume, self.run_dir)
        if ckpt is None:
            return None
        state = ckpt.state()
        self.policy.load_trainable(ckpt.weights)
        self.sampler.load_state_dict(state[SAMPLER_KEY])
        if self.ema is not None and EMA_KEY in state:
            self.ema.load_state_dict(state[EMA_KEY])
            with torch.no_grad():  # weights/ holds the EMA weights; training resumes from the raw ones
                for param, raw in zip(self.policy.trainable_parameters(), state[RAW_KEY], strict=True):
                    param.copy_(raw)
        self.start_epoch = state[COUNTERS_KEY]["epoch"]
        self.global_step = state[COUNTERS_KEY]["global_step"]
        log.info("resumed from %s at epoch %d", ckpt.path, self.start_epoch)
        return ckpt, state

    # -- the loop -------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        metrics: dict[str, float] = {}
        main = self.dist.is_main
        with Progress(enabled=cfg.progress and main) as progress:
            before = self.evaluate_before(progress)
            # after the baseline evaluation, so the bar's pace (its time left) counts epochs only
            epochs = progress.task("epochs", total=cfg.epochs, completed=self.start_epoch)
            deadline = time.monotonic() + 60 * cfg.time_limit_minutes if cfg.time_limit_minutes else math.inf
            for epoch in range(self.start_epoch, cfg.epochs):
                start = time.perf_counter()
                lr = apply_lr_schedule(self.optimizer, cfg.algo, epoch, cfg.epochs)
                metrics = {"lr": lr} | self.epoch_fn(self, epoch, progress)
                metrics["time/epoch"] = time.perf_counter() - start
                # the run's last epoch: the configured one, or the first past the time limit (decided
                # on rank 0 so every rank stops together)
                final = epoch + 1 == cfg.epochs or self._out_of_time(deadline)
                # with sharded weights (ZeRO-3, FSDP) every rank takes part in the evaluation's forwards
                evaluates = main or self.dist.sharded
                if (
                    evaluates
                    and cfg.eval_every
                    and (epoch == 0 or final or due(epoch, cfg.eval_every, cfg.epochs))
                ):
                    metrics |= self.evaluate(epoch, progress)
                self.logger.log(metrics, step=epoch)
                if main:
                    self._log_console(epoch, metrics)
                if final or due(epoch, cfg.save_every, cfg.epochs):
                    self.save(epoch + 1)
                self.dist.barrier()
                progress.advance(epochs, description=f"epoch {epoch + 1}: {headline(metrics)}")
                if final:
                    if epoch + 1 < cfg.epochs:
                        log.info("time limit (%g min) hit after epoch %d", cfg.time_limit_minutes, epoch + 1)
                    break
        if main:
            plot_runs([self.run_dir], self.run_dir / REWARD_CURVE)
            self.report(before, metrics)
        return metrics

    def _out_of_time(self, deadline: float) -> bool:
        """Whether the time limit has passed, as rank 0 sees it (every rank gets the same answer)."""
        if deadline == math.inf:
            return False
        late = torch.tensor([float(time.monotonic() >= deadline)])
        return bool(self.dist.gather(late)[0] > 0)

    def evaluate_before(self, progress: Progress) -> dict[str, float] | None:
        """With ``eval_before``, evaluate the starting weights (logged at step −1) of a fresh run."""
        cfg = self.cfg
        if not (cfg.eval_before and cfg.eval_every and self.start_epoch == 0):
            return None
        metrics = {}
        if self.dist.is_main or self.dist.sharded:
            metrics = self.evaluate(-1, progress)
            self.before_images = self.eval_images
            self.logger.log(metrics, step=-1)
            log.info("before training: eval %+.4g", metrics["eval/reward/mean"])
        self.dist.barrier()
        return metrics

    def report(self, before: dict[str, float] | None, after: dict[str, float]) -> None:
        """The curves of tagged metrics and, after an ``eval_before`` run, the before → after table."""
        if any(key.startswith("eval/reward/shapes_geneval/") for key in after):
            plot_runs([self.run_dir], self.run_dir / SHAPES_CURVE, keys=SHAPES_CURVES)
        if before and "eval/reward/mean" in after:
            table = write_before_after(self.run_dir, before, after, self.before_images, self.eval_images)
            if table:
                log.info("test accuracy before → after training (%s):\n%s", self.run_dir, table)

    def train_epoch(self, epoch: int, progress: Progress) -> dict[str, float]:
        timings: dict[str, float] = {}
        with timed(timings, "time/rollout"):
            rollouts = self.sample_epoch(epoch, progress)
        with timed(timings, "time/reward"):  # only the part of scoring that sampling did not hide
            local, reward_details = rollouts.rewards()
        # every rank sees the whole batch's rewards with their dataset indices, so a group that spans
        # ranks is normalised as one; each rank then keeps the advantages of its own samples
        components = {k: self.dist.gather(v).cpu() for k, v in local.items()}
        group_ids = self.dist.gather(rollouts.indices).cpu()
        advantages, adv_stats = combine_rewards(
            components, dict(self.cfg.reward.weights), group_ids, mode=self.cfg.reward.aggregation,
            global_std=self.cfg.algo.global_std, clip_max=self.cfg.algo.adv_clip_max,
            std_estimator=self.cfg.algo.std_estimator, eps=self.cfg.algo.adv_eps,
        )  # fmt: skip
        mine = slice(self.dist.rank * len(rollouts.indices), (self.dist.rank + 1) * len(rollouts.indices))
        total = sum(self.cfg.reward.weights[k] * v for k, v in components.items())
        keep = best_and_worst(total[mine], rollouts.indices, self.cfg.algo.best_of_n)
        advantages = advantages[mine]
        num_batches = None  # micro-batches of algo.train_batch_size
        if self.cfg.algo.drop_zero_advantage:  # as many micro-batches, each smaller (docs/maths.md §4.5)
            num_batches = math.ceil(len(keep) / self.cfg.algo.train_batch_size)
            fill = torch.Generator().manual_seed(
                stream_seed(self.cfg.seed, epoch, self.dist.rank, salt=ZERO_ADVANTAGE_FILL)
            )
            keep = keep[nonzero_advantage_rows(advantages[keep], num_batches, fill)]
        with timed(timings, "time/update"):
            update_stats = self.update(rollouts.select(keep), advantages[keep], progress, num_batches)
        if self.dist.is_main and self.cfg.images_every and epoch % self.cfg.images_every == 0:
            save_grid(rollouts.images, self.run_dir / "images" / f"train_epoch_{epoch:05d}.png", upscale=2)
            self.logger.log_images("train/images", rollouts.images[:16], epoch)
        local_stats = reduce_over_ranks(
            self.dist, {**reward_details, **update_stats, "trained_samples": len(keep)}
        )
        return {
            "reward/mean": total.mean().item(), "reward/std": total.std().item(),
            **{f"reward/{k}/mean": v.mean().item() for k, v in components.items()},
            **{f"reward/{k}/std": v.std().item() for k, v in components.items()},
            **local_stats, "zero_std_ratio": adv_stats.zero_std_ratio, "num_groups": adv_stats.num_groups,
            **timings,
            "peak_memory_mb": peak_memory_mb(self.device), "global_step": self.global_step,
        }  # fmt: skip

    # -- phases ---------------------------------------------------------------------------------
    def plan_for(self, epoch: int, batch_size: int) -> WindowPlan:
        """This epoch's window (shared by every rollout batch of the epoch)."""
        window = self.cfg.algo.window
        generator = torch.Generator().manual_seed(stream_seed(self.cfg.seed, epoch, 0, salt=WINDOW))
        return plan_window(
            window.kind, self.cfg.model.num_steps, epoch=epoch, generator=generator, batch_size=batch_size,
            **window.options(),
        )  # fmt: skip

    def sample_epoch(self, epoch: int, progress: Progress) -> Rollouts:
        """Roll out this epoch's prompts in batches of ``sample_batch_size``."""
        algo = self.cfg.algo
        indices = self.sampler.indices_for_epoch(epoch)
        examples = [self.train_set[i] for i in indices]
        prompts = [ex.prompt for ex in examples]
        offset = self.dist.rank * len(indices)
        positions = list(range(offset, offset + len(indices)))  # places in the epoch's global batch
        plan = self.plan_for(epoch, len(indices))
        share = algo.shared_initial_noise or algo.branch == "shared_prefix"  # a prefix is per group
        noise_keys = [p // algo.group_size for p in positions] if share else positions
        initial = sample_generators(self.cfg.seed, epoch, noise_keys, self.device, salt=INITIAL_NOISE)
        steps = sample_generators(self.cfg.seed, epoch, positions, self.device, salt=STEP_NOISE)
        start = min(plan.sde_steps) if algo.branch == "shared_prefix" else 0
        sources = self.source_images(examples, self.train_set)
        metadata = [dict(ex.metadata) for ex in examples]
        conds, trajs, images, scores = [], [], [], []
        task = progress.task("rollout", total=len(indices))
        for part in batches(len(indices), algo.sample_batch_size):
            cond = self.policy.encode(
                prompts[part], None if sources is None else sources[part].to(self.device)
            )
            # the CFG branches run as training will run them (cfg_grad=conditional: two passes), so the
            # recorded log-probs are exactly what the training forward recomputes
            with cfg_gradient(algo.cfg_grad):
                x = self.initial_latents(cond, initial[part], start, plan.num_steps)
                trajs.append(self.rollout_batch(cond, x, plan, steps[part], start))
            conds.append(cond)
            images.append(self.policy.decode(trajs[-1].final).cpu())
            # score this batch while the next one samples: reward time hides behind generation
            batch_sources = None if sources is None else sources[part]
            scores.append(
                self.scorer.submit(self.score, images[-1], prompts[part], metadata[part], batch_sources)
            )
            progress.advance(task, part.stop - part.start)
        progress.remove(task)
        traj = Trajectory.cat(trajs)
        if plan.train_mask is not None:
            traj = replace(traj, train_mask=plan.train_mask.to(self.device))
        return Rollouts(
            indices=torch.tensor(indices), prompts=prompts, metadata=metadata, cond=Cond.cat(conds), traj=traj,
            images=torch.cat(images), sources=sources, scores=scores,
        )  # fmt: skip

    def source_images(self, examples: list, dataset: PromptDataset) -> Tensor | None:
        """(N, 3, H, W) source images for editing families (``policy.takes_source_images``), else None."""
        return source_images_for(self.policy, examples, dataset)

    def initial_latents(
        self, cond: Cond, generators: list[torch.Generator], start: int, num_steps: int
    ) -> Tensor:
        """x at ``sigmas[start]``: the initial noise, or — for a shared prefix — each group's common ODE
        prefix, computed once per distinct noise stream and copied to the group (the cheaper Fast)."""
        x = self.policy.noise(len(generators), generators)
        if start == 0:
            return x
        sigmas = self.policy.schedule(num_steps, x)[: start + 1]
        firsts = first_of_runs(generators)  # one prefix per run of samples sharing a noise stream
        prefix = euler(functools.partial(conditioned, self.policy, cond.index(firsts)), x[firsts], sigmas)
        return prefix[run_ids(generators)]

    def rollout_batch(
        self, cond: Cond, x: Tensor, plan: WindowPlan, steps: list[torch.Generator], start: int = 0
    ) -> Trajectory:
        """One rollout batch from ``x`` at ``sigmas[start]``; sample i's step noise from generator i."""
        sigmas = self.policy.schedule(plan.num_steps, x)
        velocity = functools.partial(conditioned, self.policy, cond)
        flash = self.cfg.algo.flash
        return rollout(
            velocity, x, sigmas, plan, self.spec, steps, start=start,
            flash_ratio=flash.ratio if flash.enabled else None, store_means=self.cfg.algo.objective == "grpo_guard",
        )  # fmt: skip

    @torch.no_grad()
    def score(
        self,
        images: Tensor,
        prompts: list[str],
        metadata: list[dict],
        sources: Tensor | None = None,
        by_tag: bool = False,
    ) -> tuple[dict[str, Tensor], dict]:
        """Per-component rewards (N,) and scalar summaries of the mix's details (see
        :func:`detail_summaries`)."""
        batch = RewardBatch(prompts=prompts, images=images, metadata=metadata, ref_images=sources)
        result = self.reward.score(batch)
        components = {
            name: torch.as_tensor(result.details[name], dtype=torch.float32) for name in self.reward.rewards
        }
        bad = {
            k: f"{int(v.isnan().sum())} NaN, {int(v.isinf().sum())} inf"
            for k, v in components.items()
            if not torch.isfinite(v).all()
        }
        if bad:
            raise RuntimeError(
                f"non-finite rewards {bad} out of {len(prompts)} samples: the run stops rather than train on "
                "them (a failed score is never replaced by 0); fix the reward, then resume=auto continues "
                "from the last checkpoint"
            )
        return components, detail_summaries(result.details, by_tag=by_tag)

    def step_logprob(
        self, traj: Trajectory, cond: Cond, j: int, spec: StepSpec
    ) -> tuple[StepOut, Tensor | None]:
        """The training-path step ``j`` (log-prob and mean, with gradients) — and its KL when β > 0."""
        velocity = functools.partial(conditioned, self.policy, cond)
        with cfg_gradient(self.cfg.algo.cfg_grad):
            out = recompute_step(velocity, traj, j, spec)
        if self.cfg.algo.beta <= 0:
            return out, None
        with torch.no_grad(), self.policy.reference():
            ref = recompute_step(velocity, traj, j, spec)
        dt = traj.sigmas_next[j] - traj.sigmas[j]
        return out, step_kl(out.mean, ref.mean, out.std, dt, form=self.cfg.algo.kl_form, kind=spec.kind)

    def update(
        self, rollouts: Rollouts, advantages: Tensor, progress: Progress, num_batches: int | None = None
    ) -> dict[str, float]:
        """``num_inner_epochs`` passes of per-step policy-gradient updates over every trained step, in
        ``num_batches`` equal micro-batches (default: batches of ``algo.train_batch_size``)."""
        algo = self.cfg.algo
        n = len(rollouts.indices)
        size = math.ceil(n / num_batches) if num_batches else algo.train_batch_size
        micro_batches = list(batches(n, size))
        stats: dict[str, list[float]] = defaultdict(list)
        task = progress.task("update", total=algo.num_inner_epochs * len(micro_batches))
        for _ in range(algo.num_inner_epochs):
            for k, part in enumerate(micro_batches):
                steps_after = (k + 1) % algo.gradient_accumulation_steps == 0
                self.train_micro_batch(
                    rollouts.traj.index(part), rollouts.cond.index(part), advantages[part], stats, steps_after
                )
                if steps_after:
                    stats["grad_norm"].append(self.optimizer_step())
                progress.advance(task)
        progress.remove(task)
        return summarise(stats)

    def train_micro_batch(
        self,
        traj: Trajectory,
        cond: Cond,
        adv: Tensor,
        stats: dict[str, list[float]],
        steps_after: bool = True,
    ) -> None:
        """Backward through every trained step of one micro-batch (masked samples sit a step out);
        ``steps_after``: the optimizer steps after this micro-batch (its last backward syncs gradients)."""
        algo, adv = self.cfg.algo, adv.to(self.device)
        trained = [j for j in range(traj.num_steps) if traj.train_mask is None or traj.train_mask[:, j].any()]
        for j in trained:
            rows = slice(None) if traj.train_mask is None else traj.train_mask[:, j].nonzero().squeeze(1)
            sub_traj, sub_cond = (
                (traj, cond) if traj.train_mask is None else (traj.index(rows), cond.index(rows))
            )
            out, kl = self.step_logprob(sub_traj, sub_cond, j, self.spec)
            loss = self.objective(out, sub_traj, j, adv[rows], kl, algo)
            self.dist.backward(
                loss.loss / (traj.num_steps * algo.gradient_accumulation_steps),
                sync=steps_after and j == trained[-1],
            )
            for key, value in {
                **loss.stats,
                "policy_loss": loss.policy_loss.item(),
                "kl_loss": loss.kl_loss.item(),
            }.items():
                stats[key].append(value)

    def optimizer_step(self) -> float:
        params = self.policy.trainable_parameters()
        max_norm = self.cfg.algo.max_grad_norm if self.cfg.algo.max_grad_norm > 0 else math.inf
        grad_norm = self.dist.clip_and_step(self.optimizer, params, max_norm)
        self.global_step += 1
        if self.ema is not None:
            self.ema.step(self.global_step)
        return grad_norm

    def ema_weights(self) -> Any:
        """Context in which the policy holds its EMA weights (a no-op without EMA)."""
        return self.ema.swap() if self.ema is not None else nullcontext()

    @torch.no_grad()
    def evaluate(self, epoch: int, progress: Progress) -> dict[str, float]:
        """ODE sampling on the first test prompts with fixed noise (EMA weights if kept), scored."""
        n_prompts = self.cfg.data.eval_num_prompts or len(self.test_set)
        examples = [self.test_set[i] for i in range(min(n_prompts, len(self.test_set)))]
        examples = [ex for ex in examples for _ in range(self.cfg.data.eval_images_per_prompt)]
        prompts = [ex.prompt for ex in examples]
        sources = self.source_images(examples, self.test_set)
        with self.ema_weights():
            images = sample_images(
                self.policy, prompts, self.cfg.model.eval_num_steps, self.cfg.algo.sample_batch_size,
                self.cfg.seed, progress, sources=sources,
            )  # fmt: skip
        metadata = [dict(ex.metadata) for ex in examples]
        components, details = self.score(images, prompts, metadata, sources, by_tag=True)
        self.eval_images = images
        if self.dist.is_main:
            name = "eval_before.png" if epoch < 0 else f"eval_epoch_{epoch:05d}.png"
            save_grid(images, self.run_dir / "images" / name, upscale=2)
        total = sum(self.cfg.reward.weights[k] * v for k, v in components.items())
        return {
            "eval/reward/mean": total.mean().item(),
            **{f"eval/reward/{k}/mean": v.mean().item() for k, v in components.items()},
            **{f"eval/{k}": v for k, v in details.items()},
        }

    def save(self, epochs_done: int) -> None:
        """A full-state checkpoint; with EMA, ``weights/`` holds the EMA weights and the raw ones travel in
        the trainer state for resume. Every rank enters: optimizer shards, gathers and swaps are collective."""
        staging = engine_staging(self.run_dir, epochs_done)  # DeepSpeed's per-rank optimizer shards
        state = {
            OPTIMIZER_KEY: self.dist.optimizer_state(self.optimizer, staging),
            SAMPLER_KEY: self.sampler.state_dict(),
            COUNTERS_KEY: {"epoch": epochs_done, "global_step": self.global_step},
        }
        if self.ema is not None:
            params = self.policy.trainable_parameters()
            with self.dist.gathered(params):  # ZeRO-3 shards them
                state[RAW_KEY] = [p.detach().cpu().clone() for p in params]
            state[EMA_KEY] = self.ema.state_dict()
        # the weights users sample from are the EMA ones; ZeRO-3 / FSDP gather the sharded weights
        with self.ema_weights(), self.dist.full_weights():
            if not self.dist.is_main:
                return
            ckpt = save_checkpoint(
                self.run_dir, epochs_done, self.policy, state, self.raw_cfg, self.cfg.keep_last,
                engine_state=staging if self.dist.shards_optimizer else None,
            )  # fmt: skip
        log.info("saved %s", ckpt.path)

    def _log_console(self, epoch: int, m: dict[str, float]) -> None:
        extra = f" eval {m['eval/reward/mean']:+.4g}" if "eval/reward/mean" in m else ""
        if "reward/mean" not in m:  # an epoch without rollouts (pretraining)
            log.info("epoch %d  %s%s", epoch, headline(m), extra)
            return
        log.info(
            "epoch %d  reward %+.4g±%.3g%s  kl %.2e  clipfrac %.3f  |ratio-1|max %.2e  %.1fs",
            epoch, m["reward/mean"], m["reward/std"], extra, m.get("kl_loss", 0.0), m.get("clipfrac", 0.0),
            max(abs(m.get("ratio_max", 1) - 1), abs(1 - m.get("ratio_min", 1))),
            m["time/rollout"] + m["time/reward"] + m["time/update"],
        )  # fmt: skip

    def cleanup(self) -> None:
        self.scorer.shutdown(wait=True)
        self.logger.close()


def _require_rank_symmetric(algo: AlgoConfig, fsdp: bool = False) -> None:
    """DDP needs every rank to run the same number of backward passes; per-sample step subsets and
    best-of-N selection can give ranks different counts. FSDP2 swaps in new (DTensor) parameters when it
    shards the model and never writes gathered values back to the shards, so an EMA can neither follow the
    live weights nor be swapped in for evaluation (ZeRO-3 can: ``Dist.gathered``)."""
    if algo.window.kind == "random_subset" or algo.best_of_n > 0:
        raise UserError(
            "algo.window.kind=random_subset and algo.best_of_n are single-process for now (ranks would run "
            "different numbers of backward passes); use launcher=local or another window"
        )
    if fsdp and algo.ema.enabled:
        raise UserError(
            "algo.ema is not supported with launcher=fsdp (FSDP2 cannot write gathered weights back to its "
            "shards for an EMA swap): use launcher=deepspeed_zero3, deepspeed_zero2 or accelerate, or "
            "algo.ema.enabled=false"
        )


def run(cfg: TrainConfig, raw_cfg: DictConfig) -> dict[str, Any]:
    """Entry point: the recipe, start to finish."""
    recipe = FlowRLRecipe(cfg, raw_cfg)
    recipe.setup()
    try:
        return recipe.train()
    finally:
        recipe.cleanup()
