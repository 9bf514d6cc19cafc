"""What a recipe that holds its own optimizer and lr schedule trains with (the VLM recipes ``vlm_rl`` and
``vlm_sft``, and ``r3``), and its side of the epoch session (``recipes/session.py``): processes, policy,
optimizer and schedule, resume, the optimizer step, full-state checkpoints, the metrics log, the
evaluation (rank 0, every ``eval_every`` epochs, none before training) and the reward curve.

    run = open_vlm_run(cfg, raw_cfg)            # a VLM recipe: seed, processes, policy, optimizer
    ...                                         # the recipe's data, then its schedule's length
    run.schedule(total_steps)
    run.resume_and_prepare(vlm_engine_options(cfg), restore)   # a checkpoint, then the engine wraps the model
    with epoch_session(run) as s: ...
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from omegaconf import DictConfig

from rlgen_cli.recipes.common import REWARD_CURVE, TimeLimit, due, load_resume, save_trainer_checkpoint
from rlgen_cli.training.checkpoints.checkpoint import COUNTERS_KEY, OPTIMIZER_KEY, set_rng_state
from rlgen_cli.training.distributed.dist import Dist, make_dist
from rlgen_cli.training.reporting.metrics import NullLogger, build_loggers, step_after
from rlgen_cli.training.reporting.plots import plot_runs
from rlgen_cli.training.reporting.progress import Progress
from rlgen_cli.vlm.policy import build_vlm
from rlgen_cli.vlm.training import SCHEDULER_KEY, make_scheduler, require_whole_weights

log = logging.getLogger(__name__)

Evaluation = Callable[[int, Progress], dict[str, float]]
"""The recipe's evaluation after an epoch (rank 0, whole weights): its metrics."""


@dataclass
class TrainerRun:
    """A run whose recipe holds its own optimizer, between its setup and the end of its session."""

    cfg: Any
    raw_cfg: DictConfig
    run_dir: Path
    dist: Dist
    policy: Any
    """A VLM or a unified (R3) policy: ``load_trainable``, ``save_trainable``, ``trainable_parameters``."""
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    """The lr schedule (:meth:`schedule`); it steps with the optimizer."""
    logger: Any = None
    evaluation: Evaluation | None = None
    draws_curve: bool = False
    """Whether the run draws the reward curve (the RL recipes; SFT has no reward)."""
    unit: str = "epoch"
    """What one pass of the session's loop is called in logs and bars (R3: a ``step``)."""
    start_epoch: int = 0
    global_step: int = 0
    train_seconds: float = 0.0
    clock_seconds: float = 0.0
    last_epoch_seconds: float = 0.0  # no time limit here: not carried over a resume
    time_progress: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.dist.device

    def schedule(self, total_steps: int) -> None:
        """Warm-up and decay over ``total_steps`` optimizer steps (``algo.token.*``); on the torch optimizer:
        DeepSpeed's ZeRO optimizer steps with its param_groups' learning rates."""
        token = self.cfg.algo.token
        self.scheduler = make_scheduler(self.optimizer, total_steps, token.warmup_ratio, token.lr_schedule)

    def resume_and_prepare(
        self,
        engine_options: dict[str, Any],
        restore: Callable[[dict[str, Any]], None] = lambda state: None,
        loggers: Callable[[], Any] | None = None,
    ) -> None:
        """Weights, schedule, RNG and counters of the checkpoint to resume (if any; ``restore`` takes the
        recipe's own entries, e.g. its sampler) into the bare model; then DDP / the engine wraps the model
        (``engine_options``: ``Dist.prepare``'s) and takes the optimizer, whose state is restored last
        (DeepSpeed reads its shards from the checkpoint's engine/); the loggers on rank 0 (default: the
        metrics log and the backends ``logging.*`` enables, as every recipe builds them: ``build_loggers``)."""
        cfg = self.cfg
        resumed = load_resume(
            cfg.resume, self.run_dir, self.policy.load_trainable, self.raw_cfg, cfg.resume_unverified
        )
        if resumed is not None:
            state = resumed[1]
            self.scheduler.load_state_dict(state[SCHEDULER_KEY])
            restore(state)
            set_rng_state(state["rng"])
            self.start_epoch = state[COUNTERS_KEY]["epoch"]
            self.global_step = state[COUNTERS_KEY]["global_step"]
        self.optimizer = self.dist.prepare(self.policy, self.optimizer, **engine_options)
        if resumed is not None:
            ckpt, state = resumed
            self.dist.load_optimizer_state(self.optimizer, state[OPTIMIZER_KEY], ckpt.engine)
        if not self.dist.is_main:
            self.logger = NullLogger()
        else:
            self.logger = (
                loggers() if loggers is not None else build_loggers(self.run_dir, cfg.logging, self.raw_cfg)
            )

    def optimizer_step(self) -> float:
        """Clip, step, advance the schedule and count the step; the pre-clip global gradient norm."""
        max_norm = self.cfg.algo.max_grad_norm if self.cfg.algo.max_grad_norm > 0 else math.inf
        norm = self.dist.clip_and_step(self.optimizer, self.policy.trainable_parameters(), max_norm)
        self.scheduler.step()
        self.global_step += 1
        return norm

    def save(self, epochs_done: int, entries: dict[str, Any] | None = None) -> None:
        """A full-state checkpoint with the recipe's ``entries`` (every rank calls; rank 0 writes)."""
        entries = {**(entries or {}), SCHEDULER_KEY: self.scheduler.state_dict()}
        save_trainer_checkpoint(
            self.dist,
            self.run_dir,
            epochs_done,
            self.global_step,
            self.optimizer,
            self.policy.save_trainable,
            entries,
            self.raw_cfg,
            self.cfg.keep_last,
        )

    # -- the epoch session's Run (recipes/session.py) ------------------------------------------------------
    def time_limit(self) -> TimeLimit:
        return TimeLimit()  # these recipes have no time limit

    def evaluate_before(self, progress: Progress) -> dict[str, float] | None:
        return None  # these recipes evaluate after epochs only

    def evaluate_if_due(
        self, epoch: int, last: bool, progress: Progress, extra_state: dict[str, Any] | None
    ) -> dict[str, float]:
        """Rank 0 alone (whole weights on every rank: ``require_whole_weights``), every ``eval_every``."""
        cfg = self.cfg
        if self.evaluation is None or not (self.dist.is_main and cfg.eval_every):
            return {}
        return self.evaluation(epoch, progress) if due(epoch, cfg.eval_every, cfg.epochs) else {}

    def stop_requested(self) -> bool:
        return False  # no reward-hacking guard watches these runs

    def log_epoch(self, epoch: int, metrics: dict[str, float], console: str) -> None:
        self.logger.log(metrics, step=step_after(epoch))
        log.info("%s %d  %s", self.unit, step_after(epoch), console)

    def save_if_due(self, epoch: int, last: bool, extra_state: dict[str, Any] | None) -> None:
        if last or due(epoch, self.cfg.save_every, self.cfg.epochs):
            self.save(epoch + 1, extra_state)

    def draw_curves(self) -> None:
        if self.draws_curve:
            plot_runs([self.run_dir], self.run_dir / REWARD_CURVE)

    def finish(self, before: dict[str, float] | None, after: dict[str, float]) -> None:
        if self.dist.is_main:
            self.draw_curves()

    def close(self) -> None:
        self.logger.close()


def open_vlm_run(cfg: Any, raw_cfg: DictConfig, engine: str = "hf") -> TrainerRun:
    """A VLM recipe's run: seed, processes (whole weights on every rank: ``engine`` is
    ``algo.token.engine``), the policy and its AdamW optimizer, in this order (the policy's seeded draws come
    first in every run)."""
    algo = cfg.algo
    torch.manual_seed(cfg.seed)
    dist = make_dist(cfg.device)
    require_whole_weights(dist, engine)
    policy = build_vlm(cfg.model, dist.device)
    optimizer = torch.optim.AdamW(
        policy.trainable_parameters(),
        lr=algo.lr,
        betas=(algo.adam_beta1, algo.adam_beta2),
        eps=algo.adam_eps,
        weight_decay=algo.weight_decay,
    )
    return TrainerRun(cfg, raw_cfg, Path(cfg.run_dir), dist, policy, optimizer)


def vlm_engine_options(cfg: Any) -> dict[str, Any]:
    """How DDP / DeepSpeed take a VLM policy (``Dist.prepare``): ``algo.*``'s clip and micro-batch, the
    model's compute dtype, float64 gradient sums under ``launcher.exact_reduction``."""
    algo = cfg.algo
    return {
        "max_grad_norm": algo.max_grad_norm,
        "micro_batch_size": algo.train_batch_size,
        "compute_dtype": cfg.model.dtype,
        "exact_reduction": cfg.launcher.reduces_exactly,
    }


class Recipe(Protocol):
    """A recipe object that builds its run in ``setup`` and releases what it opened in ``cleanup``."""

    def setup(self) -> None: ...

    def cleanup(self) -> None: ...


R = TypeVar("R", bound=Recipe)


@contextmanager
def opened(recipe: R) -> Iterator[R]:
    """``recipe`` set up, and cleaned up (loggers, rollout engine, sample logs) however the block ends."""
    recipe.setup()
    try:
        yield recipe
    finally:
        recipe.cleanup()
