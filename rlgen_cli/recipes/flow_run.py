"""What a flow recipe (``flow_grpo``, ``flow_pref``, ``flow_pretrain``, ``flow_forward``) trains with, as
plain functions over one small record — no base class, no hooks: what a run holds (:class:`FlowRun`, built
by :func:`setup`: seed, processes, policy, reward, prompts, optimizer, EMA, resume, loggers), reward
scoring (:func:`score`), the ODE evaluation (:func:`evaluate`) and the reward-hacking guard's look at it
(:func:`guard_evaluation`, ``training/control/hacking_guard.py``), full-state checkpoints (:func:`save`)
and the end of an epoch. Each recipe writes its own loop from them inside the epoch session of
``recipes/session.py``; what every recipe shares (reductions over ranks, timing, when work is due) is
``recipes/common.py``.

An epoch function returns its metrics (``lr``, losses, ``reward/*``, ``time/*``, ``global_step``, and
``dist.loss_scale_metrics()``); it steps the optimizer through :func:`optimizer_step` (EMA and step
count included) and scores through :func:`score`. Recipe-specific state (a reference copy, a σ table,
an old policy) lives in the recipe's own small dataclass, built after :func:`setup`.

``run.report`` is the evaluation report the experiment chose (``eval_report``, ``training/reporting/report.py``):
it sees every evaluation and writes its files when the session finishes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from rlgen_cli.data import GroupSampler, PromptDataset
from rlgen_cli.data.images import source_images
from rlgen_cli.data.paths import load_prompts
from rlgen_cli.errors import UserError
from rlgen_cli.models import FlowPolicy, build_policy
from rlgen_cli.recipes.common import REWARD_CURVE, TimeLimit, due, progress_task
from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.rewards.mix import WeightedMix
from rlgen_cli.schema.recipes import FlowRunConfig
from rlgen_cli.sde.rollout import StepSpec
from rlgen_cli.sde.sampling import sample_images
from rlgen_cli.training.checkpoints.checkpoint import (
    CHECKPOINTS_DIR,
    COUNTERS_KEY,
    OPTIMIZER_KEY,
    RNG_KEY,
    SAMPLER_KEY,
    Checkpoint,
    NonFiniteRewards,
    engine_staging,
    resolve_resume,
    save_checkpoint,
    set_rng_state,
)
from rlgen_cli.training.checkpoints.resume_config import check_resume_config
from rlgen_cli.training.control.ema import EMA
from rlgen_cli.training.control.hacking_guard import (
    BEST_HELDOUT,
    GUARD_CURVES,
    GUARD_KEY,
    RunGuard,
    plot_guard,
)
from rlgen_cli.training.distributed.dist import Dist, make_dist
from rlgen_cli.training.reporting.images import grid_name, save_grid
from rlgen_cli.training.reporting.labels import readable_reward
from rlgen_cli.training.reporting.metrics import (
    BEFORE_TRAINING,
    METRICS_FILE,
    NullLogger,
    build_loggers,
    read_metrics,
    step_after,
)
from rlgen_cli.training.reporting.plots import plot_runs
from rlgen_cli.training.reporting.progress import Progress
from rlgen_cli.training.reporting.report import EvalReport, detail_summaries, eval_report

log = logging.getLogger(__name__)

EMA_KEY, RAW_KEY = "ema", "raw_trainable"
LOOP_STATE_KEYS = (OPTIMIZER_KEY, SAMPLER_KEY, COUNTERS_KEY, RNG_KEY, EMA_KEY, RAW_KEY, GUARD_KEY)
"""Trainer-state entries :func:`save` writes and :func:`setup` restores; the rest are the recipe's."""


@dataclass
class FlowRun:
    """What a flow recipe trains with; :func:`setup` builds it, the recipe's functions read it."""

    cfg: FlowRunConfig
    raw_cfg: DictConfig
    run_dir: Path
    dist: Dist
    policy: FlowPolicy
    reward: WeightedMix
    train_set: PromptDataset
    test_set: PromptDataset
    sampler: GroupSampler
    """Which prompts each epoch draws (its position travels in checkpoints)."""
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    logger: Any
    report: EvalReport
    start_epoch: int = 0
    global_step: int = 0
    """Optimizer steps so far (EMA warm-up and per-step schedules read it)."""
    resumed_extra: dict[str, Any] = field(default_factory=dict)
    """The resumed checkpoint's recipe entries (what the recipe saved as ``extra_state``); empty when fresh."""
    guard: RunGuard | None = None
    """The reward-hacking guard (``guard.monitors`` set): :func:`guard_evaluation` after every evaluation."""
    heldout_set: PromptDataset | None = None
    """``eval_heldout``'s prompts, evaluated after the last epoch (and before the first with
    ``eval_before``)."""
    time_progress: float = 0.0
    """Share of the time budget used by the end of the epoch about to run, under
    ``lr_schedule_clock=time_or_epochs`` (``recipes/session.py``; 0 otherwise): the lr schedule reads it."""
    train_seconds: float = 0.0
    """Seconds spent in epochs since the run began; carried over a resume in the counters."""
    clock_seconds: float = 0.0
    """Seconds on the time limit's clock (epochs, evaluations, checkpoints) since the first epoch;
    carried over a resume in the counters."""
    last_epoch_seconds: float = 0.0
    """Seconds of the latest epoch, from which the time-aware lr clock predicts the next one's
    (``recipes/session.py``); carried over a resume in the counters."""
    unit: str = "epoch"
    """What one pass of the session's loop is called in logs and bars."""

    @property
    def device(self) -> torch.device:
        return self.dist.device

    # -- the epoch session's Run (recipes/session.py) ------------------------------------------------------
    def time_limit(self) -> TimeLimit:
        cfg = self.cfg
        return TimeLimit(cfg.time_limit_minutes, cfg.time_limit_counts, cfg.lr_schedule_clock)

    def evaluate_before(self, progress: Progress) -> dict[str, float] | None:
        return evaluate_before(self, progress)

    def evaluate_if_due(
        self, epoch: int, last: bool, progress: Progress, extra_state: dict[str, Any] | None
    ) -> dict[str, float]:
        return evaluate_if_due(self, epoch, last, progress, extra_state)

    def stop_requested(self) -> bool:
        return self.guard is not None and self.guard.stop_requested

    def log_epoch(self, epoch: int, metrics: dict[str, float], console: str) -> None:
        log_epoch(self, epoch, metrics, console)

    def save_if_due(self, epoch: int, last: bool, extra_state: dict[str, Any] | None) -> None:
        save_if_due(self, epoch, last, extra_state)

    def draw_curves(self) -> None:
        """The reward curve, and the guard's when it watches the run, from what ``metrics.jsonl`` holds."""
        plot_runs([self.run_dir], self.run_dir / REWARD_CURVE)
        if self.guard is not None:
            plot_guard(self.run_dir, self.run_dir / GUARD_CURVES)

    def finish(self, before: dict[str, float] | None, after: dict[str, float]) -> None:
        """Rank 0 draws the curves and writes the evaluation report; every rank closes its loggers."""
        if self.dist.is_main:
            self.draw_curves()
            self.report.write(before, after)
        self.logger.close()

    def close(self) -> None:
        self.logger.close()


def splits_read(cfg: FlowRunConfig) -> tuple[str, ...]:
    """The prompt files a flow run reads: both (it trains on one and evaluates on the other)."""
    return ("train", "test")


def setup(cfg: FlowRunConfig, raw_cfg: DictConfig) -> FlowRun:
    """Seed, processes, policy, reward, prompts, sampler, optimizer and EMA; resume from ``cfg.resume``;
    the distributed engine takes the model; loggers on rank 0. The order is part of reproducibility: the
    seeded draws (adapter init) happen in the same order in every run, resumed or not."""
    torch.manual_seed(cfg.seed)
    dist = make_dist(cfg.device)
    run_dir = Path(cfg.run_dir)
    # prompts first (no random draws): a bad prompt file or tag_repeats stops the run before a model loads
    train_set = load_prompts(cfg.data.train, run_dir, "data.train", tag_repeats=cfg.data.tag_repeats)
    test_set = load_prompts(cfg.data.test, run_dir, "data.test")
    policy = build_policy(cfg.model, dist.device)
    require_ema_engine(cfg.algo.ema.enabled, fsdp=dist.engine == "fsdp")
    reward = build_mix(dict(cfg.reward.weights), **{k: dict(v) for k, v in cfg.reward.kwargs.items()})
    sampler = GroupSampler(
        len(train_set),
        cfg.algo.prompts_per_epoch,
        cfg.algo.group_size,
        seed=cfg.seed,
        num_replicas=dist.world_size,
        rank=dist.rank,
        prompts_per_draw=getattr(
            cfg.algo, "prompts_per_draw", None
        ),  # flow_grpo's key; the others use passes
    )
    params = policy.trainable.parameters()
    num_trainable = sum(p.numel() for p in params)  # counted before an engine shards them
    algo = cfg.algo
    optimizer = torch.optim.AdamW(
        params,
        lr=algo.lr,
        betas=(algo.adam_beta1, algo.adam_beta2),
        eps=algo.adam_eps,
        weight_decay=algo.weight_decay,
    )
    ema = (  # ZeRO-3: updates and swaps gather the shards in the engine's own context
        EMA(
            params,
            decay=algo.ema.decay,
            update_every=algo.ema.update_every,
            warmup=algo.ema.warmup,
            gather=dist.gathered,
        )
        if algo.ema.enabled
        else None
    )
    run = FlowRun(
        cfg,
        raw_cfg,
        run_dir,
        dist,
        policy,
        reward,
        train_set,
        test_set,
        sampler,
        optimizer,
        ema,
        logger=NullLogger(),
        report=eval_report(cfg.eval_report, run_dir),
    )
    if cfg.eval_heldout:
        run.heldout_set = load_prompts(cfg.eval_heldout, run_dir, "eval_heldout")
    resumed = _resume_weights(run)  # into the whole modules, before an engine shards them
    # DDP wraps the transformer; DeepSpeed / FSDP also take the optimizer (training/distributed/dist.py)
    run.optimizer = dist.prepare(
        policy.trainable,
        optimizer,
        max_grad_norm=algo.max_grad_norm,
        micro_batch_size=algo.train_batch_size,
        compute_dtype=cfg.model.dtype,  # fp16 compute: the engine scales the loss
        exact_reduction=cfg.launcher.reduces_exactly,  # float64 gradient sums: any process count, same bits
    )
    if resumed is not None:
        ckpt, state = resumed
        dist.load_optimizer_state(run.optimizer, state[OPTIMIZER_KEY], ckpt.engine)
        set_rng_state(state[RNG_KEY])
        run.resumed_extra = {k: v for k, v in state.items() if k not in LOOP_STATE_KEYS}
    run.guard = RunGuard.build(cfg.guard, dist, algo, resumed[1].get(GUARD_KEY) if resumed else None)
    if dist.is_main:
        run.logger = build_loggers(run_dir, cfg.logging, raw_cfg)
    log.info(
        "%s on %s: %d trainable parameters, %d prompts × %d samples per epoch",
        cfg.model.family,
        dist.device,
        num_trainable,
        algo.prompts_per_epoch,
        algo.group_size,
    )
    if run.guard is not None and run.guard.stop_requested and dist.is_main:  # resumed after the guard's stop
        log.warning(run.guard.resumed_message())  # and the session trains no epoch (recipes/session.py)
    return run


def require_ema_engine(ema: bool, fsdp: bool) -> None:
    """FSDP2 swaps in new (DTensor) parameters when it shards the model and never writes gathered values
    back to the shards, so an EMA can neither follow the live weights nor be swapped in for evaluation
    (ZeRO-3 can: ``Dist.gathered``)."""
    if fsdp and ema:
        raise UserError(
            "algo.ema is not supported with launcher=fsdp (FSDP2 cannot write gathered weights back to its "
            "shards for an EMA swap): use launcher=deepspeed_zero3, deepspeed_zero2 or accelerate, or "
            "algo.ema.enabled=false"
        )


def _resume_weights(run: FlowRun) -> tuple[Checkpoint, dict[str, Any]] | None:
    """Weights, EMA, sampler and counters of the checkpoint to resume (if any); returns it and its state,
    whose optimizer and RNG entries :func:`setup` restores once the engine has the optimizer."""
    ckpt = resolve_resume(run.cfg.resume, run.run_dir, run.cfg.resume_unverified)
    if ckpt is None:
        return None
    steps_per_process = run.cfg.recipe not in STEPS_OF_FIXED_SIZE
    check_resume_config(
        ckpt.path, ckpt.config(), run.raw_cfg, schedule_spans_length(run.cfg), steps_per_process
    )
    state = ckpt.state()
    _load_trained(run, ckpt, state)
    run.sampler.load_state_dict(state[SAMPLER_KEY])
    run.start_epoch = state[COUNTERS_KEY]["epoch"]
    run.global_step = state[COUNTERS_KEY]["global_step"]
    run.train_seconds = state[COUNTERS_KEY].get("train_seconds", 0.0)  # absent from older checkpoints
    run.clock_seconds = state[COUNTERS_KEY].get("clock_seconds", 0.0)
    run.last_epoch_seconds = state[COUNTERS_KEY].get("last_epoch_seconds", 0.0)
    log.info("resumed from %s at epoch %d", ckpt.path, run.start_epoch)
    return ckpt, state


STEPS_OF_FIXED_SIZE = ("flow_pref", "flow_pretrain")
"""Recipes whose optimizer step is the same on any process count (they refuse
``algo.gradient_accumulation_steps``): a resume on another count changes nothing there."""


def schedule_spans_length(cfg: FlowRunConfig) -> bool:
    """Whether the learning rate depends on ``epochs`` / ``time_limit_minutes``: a decaying schedule, or
    pretraining's per-step one (a constant schedule, warm-up included, depends on the epoch alone)."""
    return cfg.recipe == "flow_pretrain" or cfg.algo.lr_schedule != "constant"


def _load_trained(run: FlowRun, ckpt: Checkpoint, state: dict[str, Any]) -> None:
    """The checkpoint's trained weights (and EMA) into the live modules, in place."""
    run.policy.trainable.load(ckpt.weights)
    if run.ema is not None and EMA_KEY in state:
        run.ema.load_state_dict(state[EMA_KEY])
        with torch.no_grad():  # weights/ holds the EMA weights; training resumes from the raw ones
            for param, raw in zip(run.policy.trainable.parameters(), state[RAW_KEY], strict=True):
                param.copy_(raw)


def step_spec(cfg: FlowRunConfig) -> StepSpec:
    """The SDE step of rollouts (``sampler.*``; the noise level defaults to the model family's)."""
    noise_level = cfg.sampler.noise_level if cfg.sampler.noise_level is not None else cfg.model.noise_level
    return StepSpec(cfg.sampler.kind, noise_level, cfg.sampler.logprob_reduce, cfg.sampler.logprob_form)


def optimizer_step(run: FlowRun) -> float:
    """Clip, step and zero the gradients (the engine's way), count the step, update the EMA; returns the
    pre-clip gradient norm."""
    max_norm = run.cfg.algo.max_grad_norm if run.cfg.algo.max_grad_norm > 0 else math.inf
    grad_norm = run.dist.clip_and_step(run.optimizer, run.policy.trainable.parameters(), max_norm)
    run.global_step += 1
    if run.ema is not None:
        run.ema.step(run.global_step)
    return grad_norm


def ema_weights(run: FlowRun) -> AbstractContextManager[Any]:
    """Context in which the policy holds its EMA weights (a no-op without EMA)."""
    return run.ema.swap() if run.ema is not None else nullcontext()


def examples_of(dataset: PromptDataset, indices: Sequence[int]) -> tuple[list, list[str], list[dict]]:
    """The examples at ``indices``, their prompts and (copied) metadata."""
    examples = [dataset[i] for i in indices]
    return examples, [ex.prompt for ex in examples], [dict(ex.metadata) for ex in examples]


def sources_of(run: FlowRun, examples: list, dataset: PromptDataset) -> Tensor | None:
    """Source images for editing families (``capabilities.takes_source_images``), else None: (B, 3, H, W),
    or (B, N, 3, H, W) when the set lists N paths per example (multi-image editing)."""
    if not run.policy.capabilities.takes_source_images:
        return None
    model = run.policy.cfg
    return source_images(examples, dataset, model.height or model.resolution, model.width or model.resolution)


@torch.no_grad()
def score(
    run: FlowRun,
    images: Tensor,
    prompts: list[str],
    metadata: list[dict],
    sources: Tensor | None = None,
    by_tag: bool = False,
    reward: WeightedMix | None = None,
) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Per-component rewards (B,) and scalar summaries of the mix's details (``detail_summaries``);
    see :func:`score_samples`."""
    components, details = score_samples(run, images, prompts, metadata, sources, reward)
    return components, detail_summaries(details, by_tag=by_tag)


@torch.no_grad()
def score_samples(
    run: FlowRun,
    images: Tensor,
    prompts: list[str],
    metadata: list[dict],
    sources: Tensor | None = None,
    reward: WeightedMix | None = None,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Per-component rewards (B,) and the mix's per-sample details (``"<reward>/<name>"``). A
    non-finite reward stops the run: a failed score is never replaced by a number. ``sources`` (see
    :func:`sources_of`) reach the rewards as ``ref_images``; one compared with the source averages over
    N sources (``rewards/base.py``). ``reward``: the mix to score (default: the trained one; the guard
    passes its monitors)."""
    batch = RewardBatch(prompts=prompts, images=images, metadata=metadata, ref_images=sources)
    mix = reward or run.reward
    result = mix.score(batch)
    components = {name: torch.as_tensor(result.details[name], dtype=torch.float32) for name in mix.rewards}
    bad = {
        k: f"{int(v.isnan().sum())} NaN, {int(v.isinf().sum())} inf"
        for k, v in components.items()
        if not torch.isfinite(v).all()
    }
    if bad:
        raise NonFiniteRewards(
            f"non-finite rewards {bad} in a scored batch of {len(prompts)} samples: the run stops rather than train on "
            "them (a failed score is never replaced by 0); fix the reward"
        )
    return components, result.details


def weighted_total(run: FlowRun, components: dict[str, Tensor]) -> Tensor:
    """The mix's reward per sample: Σ weight·component."""
    return sum(run.cfg.reward.weights[k] * v for k, v in components.items())


def reward_metrics(run: FlowRun, components: dict[str, Tensor], prefix: str = "") -> dict[str, float]:
    """``reward/mean``, ``reward/std`` and each component's mean (``prefix`` e.g. ``eval/``)."""
    total = weighted_total(run, components)
    return {
        f"{prefix}reward/mean": total.mean().item(),
        f"{prefix}reward/std": total.std().item(),
        **{f"{prefix}reward/{k}/mean": v.mean().item() for k, v in components.items()},
    }


@torch.no_grad()
def evaluate(run: FlowRun, epoch: int, progress: Progress, split: str = "eval") -> dict[str, float]:
    """ODE sampling on the first prompts of a test split with fixed noise (EMA weights if kept), scored
    per tag; the grid goes to ``images/`` (captioned as ``run.report`` says) and the samples to
    ``run.report``. ``epoch`` −1: before training. ``split``: ``eval`` (``data.test``, the guard's
    monitors too) or ``eval_heldout`` (``eval_heldout``'s prompts), the prefix of its metrics and grids."""
    cfg = run.cfg
    dataset = run.heldout_set if split == "eval_heldout" else run.test_set
    assert dataset is not None, split
    n_prompts = min(cfg.data.eval_num_prompts or len(dataset), len(dataset))
    rows = [i for i in range(n_prompts) for _ in range(cfg.data.eval_images_per_prompt)]
    examples, prompts, metadata = examples_of(dataset, rows)
    sources = sources_of(run, examples, dataset)
    with ema_weights(run), progress_task(progress, "sampling", len(prompts)) as advance:
        images = sample_images(
            run.policy,
            prompts,
            cfg.model.eval_num_steps,
            cfg.algo.sample_batch_size,
            cfg.seed,
            sources=sources,
            on_batch=advance,
        )
    components, samples = score_samples(run, images, prompts, metadata, sources)
    details = detail_summaries(samples, by_tag=True)
    total = weighted_total(run, components)
    heldout = {}  # the guard's monitors on the same images, per prompt with the trained reward (training/control/hacking_guard.py)
    if run.guard is not None and split == "eval":
        monitored, _ = score(run, images, prompts, metadata, sources, reward=run.guard.monitors)
        heldout = run.guard.score_evaluation(total, monitored, cfg.data.eval_images_per_prompt)
    if split == "eval":
        run.report.evaluated(epoch, images, prompts, samples)
    if run.dist.is_main:
        labels = run.report.tile_labels(prompts, samples)  # captions and pass / fail marks, if any
        save_grid(images, run.run_dir / "images" / grid_name(split, step_after(epoch)), upscale=2, **labels)
        run.logger.log_images(f"{split}/images", images[:16], step_after(epoch))  # TensorBoard, W&B
    return {
        f"{split}/reward/mean": total.mean().item(),
        **({f"{split}/num_samples": float(len(prompts))} if split == "eval_heldout" else {}),
        **{f"{split}/reward/{k}/mean": v.mean().item() for k, v in components.items()},
        **{f"{split}/{k}": v for k, v in details.items()},
        **heldout,
    }


def save_rollout_images(run: FlowRun, images: Tensor, epoch: int) -> None:
    """Every ``images_every`` epochs rank 0 saves the epoch's rollouts as a grid and logs the first 16."""
    every = run.cfg.images_every
    if run.dist.is_main and every and epoch % every == 0:
        save_grid(images, run.run_dir / "images" / grid_name("train", step_after(epoch)), upscale=2)
        run.logger.log_images("train/images", images[:16], step_after(epoch))


def evaluate_before(run: FlowRun, progress: Progress) -> dict[str, float] | None:
    """With ``eval_before``, evaluate the starting weights of a fresh run (logged at step 0); a resumed
    run reads that evaluation back (:func:`logged_before`)."""
    cfg = run.cfg
    if not (cfg.eval_before and cfg.eval_every):
        return None
    if run.start_epoch > 0:
        return logged_before(run)
    metrics: dict[str, float] = {}
    if run.dist.is_main or run.dist.sharded:  # sharded weights: every rank takes part in the forwards
        metrics = evaluate(run, -1, progress)
        if run.heldout_set is not None:
            metrics |= evaluate(run, -1, progress, split="eval_heldout")
    metrics = guard_evaluation(run, -1, metrics)
    if run.dist.is_main:
        run.logger.log(metrics, step=BEFORE_TRAINING)
        log.info("before training: eval %+.4g%s", metrics["eval/reward/mean"], readable_reward(metrics))
    run.dist.barrier()
    return metrics


def logged_before(run: FlowRun) -> dict[str, float] | None:
    """The evaluation before training as the run's ``metrics.jsonl`` holds it (its step-0 row), for the
    before → after report of a resumed run (rank 0; None elsewhere, or, with a warning, where the file
    holds none: a checkpoint resumed into another run directory)."""
    if not run.dist.is_main:
        return None
    rows = [row for row in read_metrics(run.run_dir) if row.get("step") == BEFORE_TRAINING]
    if not rows:
        log.warning(
            "%s holds no evaluation before training (step %d): this resumed run writes no before → after report",
            run.run_dir / METRICS_FILE,
            BEFORE_TRAINING,
        )
        return None
    return {key: value for key, value in rows[-1].items() if value is not None}  # null: a non-finite value


def evaluate_if_due(
    run: FlowRun, epoch: int, last: bool, progress: Progress, extra_state: dict[str, Any] | None = None
) -> dict[str, float]:
    """The evaluation after ``epoch`` when one is due (the first, the last, every ``eval_every``);
    ``extra_state``: the recipe's entries, for the guard's best checkpoint (:func:`guard_evaluation`)."""
    cfg = run.cfg
    if not (cfg.eval_every and (epoch == 0 or last or due(epoch, cfg.eval_every, cfg.epochs))):
        return {}
    evaluates = run.dist.is_main or run.dist.sharded  # sharded weights: every rank runs the forwards
    metrics = evaluate(run, epoch, progress) if evaluates else {}
    if evaluates and last and run.heldout_set is not None:  # the held-out split: after the last epoch
        metrics |= evaluate(run, epoch, progress, split="eval_heldout")
    return guard_evaluation(run, epoch, metrics, extra_state)


def guard_evaluation(
    run: FlowRun, epoch: int, metrics: dict[str, float], extra_state: dict[str, Any] | None = None
) -> dict[str, float]:
    """The guard's look at the evaluation after ``epoch`` (−1: before training; ``metrics``: rank 0's):
    a new best held-out value is saved to ``checkpoints/best_heldout`` (with the recipe's ``extra_state``,
    so that it resumes as any checkpoint does); a flagged evaluation warns, stops or rolls back
    (``training/control/hacking_guard.py``). Every rank enters: saving and rolling back are collective."""
    if run.guard is None:
        return metrics
    decision = run.guard.decide(run.dist, epoch)
    if decision.new_best:
        save(run, epoch + 1, extra_state, name=BEST_HELDOUT)
    metrics = {**metrics, **run.guard.status_metrics()}
    if decision.event is not None:
        log.warning(decision.event.describe(run.cfg.guard.window, run.cfg.guard.margin))
        metrics |= decision.event.metrics()
    if decision.action == "rollback":
        metrics |= roll_back(run)
    return metrics


def roll_back(run: FlowRun) -> dict[str, float]:
    """Load ``checkpoints/best_heldout``'s weights, EMA and optimizer state (not its sampler, counters or
    RNG: training goes on with the next epoch's prompts), then scale the learning rate and KL weight;
    returns the guard's cumulative scales."""
    assert run.guard is not None
    ckpt = Checkpoint(run.run_dir / CHECKPOINTS_DIR / BEST_HELDOUT)
    state = ckpt.state()
    run.guard.require_best_state(state[COUNTERS_KEY]["epoch"])
    lrs = [group["lr"] for group in run.optimizer.param_groups]
    _load_trained(run, ckpt, state)
    run.dist.load_optimizer_state(run.optimizer, state[OPTIMIZER_KEY], ckpt.engine)
    return run.guard.rescale_after_rollback(run.cfg.algo, run.optimizer, lrs)


def log_epoch(run: FlowRun, epoch: int, metrics: dict[str, float], console: str) -> None:
    """``metrics`` to every logger (rank 0), and ``epoch N  <console>`` to the console and run.log, both
    at the step the epoch completes (N = ``epoch + 1``, as the epochs bar and the checkpoints count)."""
    run.logger.log(metrics, step=step_after(epoch))
    if run.dist.is_main:
        log.info("epoch %d  %s", step_after(epoch), console)


def eval_suffix(metrics: dict[str, float]) -> str:
    """`` eval +0.123`` when the epoch evaluated (`` held-out +0.456`` with the guard), then the reward's
    readable detail if it has one (``  1.5 kB/img (eval 1.48)``, ``training/reporting/labels.py``), for console
    lines."""
    readable = readable_reward(metrics)
    if "eval/reward/mean" not in metrics:
        return readable
    heldout = f" held-out {metrics['guard/heldout']:+.4g}" if "guard/heldout" in metrics else ""
    return f" eval {metrics['eval/reward/mean']:+.4g}{heldout}{readable}"


def save(
    run: FlowRun, epochs_done: int, extra_state: dict[str, Any] | None = None, name: str | None = None
) -> None:
    """A full-state checkpoint; with EMA, ``weights/`` holds the EMA weights and the raw ones travel in
    the trainer state for resume. ``extra_state``: a recipe's own entries (e.g. an old policy's weights);
    ``name``: a fixed folder instead of ``epoch_N`` (the guard's ``best_heldout``). Every rank enters:
    optimizer shards, gathers and swaps are collective."""
    staging = engine_staging(run.run_dir, epochs_done)  # DeepSpeed's per-rank optimizer shards
    state = {
        OPTIMIZER_KEY: run.dist.optimizer_state(run.optimizer, staging),
        SAMPLER_KEY: run.sampler.state_dict(),
        COUNTERS_KEY: {
            "epoch": epochs_done,
            "global_step": run.global_step,
            "train_seconds": run.train_seconds,
            "clock_seconds": run.clock_seconds,
            "last_epoch_seconds": run.last_epoch_seconds,
        },
        **(extra_state or {}),
    }
    if run.guard is not None:
        state[GUARD_KEY] = run.guard.state_dict()
    if run.ema is not None:
        params = run.policy.trainable.parameters()
        with run.dist.gathered(params):  # ZeRO-3 shards them
            state[RAW_KEY] = [p.detach().cpu().clone() for p in params]
        state[EMA_KEY] = run.ema.state_dict()
    # the weights users sample from are the EMA ones; ZeRO-3 / FSDP gather the sharded weights
    with ema_weights(run), run.dist.full_weights():
        if not run.dist.is_main:
            return
        ckpt = save_checkpoint(
            run.run_dir,
            epochs_done,
            run.policy.trainable.save,
            state,
            run.raw_cfg,
            run.cfg.keep_last,
            engine_state=staging if run.dist.shards_optimizer else None,
            name=name,
        )
    log.info("saved %s", ckpt.path)


def save_if_due(run: FlowRun, epoch: int, last: bool, extra_state: dict[str, Any] | None = None) -> None:
    """A checkpoint after the last epoch and every ``save_every`` (``extra_state``: see :func:`save`)."""
    if last or due(epoch, run.cfg.save_every, run.cfg.epochs):
        save(run, epoch + 1, extra_state)
