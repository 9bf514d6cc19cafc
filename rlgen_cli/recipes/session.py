"""The epoch session every recipe runs in: the progress bars and the evaluation before training, then per
epoch :meth:`Session.end_epoch` (evaluation when due, log line, checkpoint when due, epochs bar, time
limit, a guard stop), and the run's end (:meth:`Run.finish`: curves, report)::

    with session(cfg, raw_cfg) as s:  # a flow recipe; the others: epoch_session(their Run)
        for epoch in s.epochs():
            metrics = my_epoch(s.run, epoch, s.progress)  # e.g. rollout → reward → advantages → update
            if s.end_epoch(epoch, metrics, console_line, headline=f"reward {metrics['reward/mean']:+.4g}"):
                break
    return s.metrics

What an epoch is made of stays in the recipe; what the session asks of the run is :class:`Run` (a flow
run: ``recipes/flow_run.py``; a run whose recipe holds its own optimizer, VLM or R3: ``recipes/trainer_run.py``).

The time limit's clock (:class:`EpochClock`) starts at the first epoch (after any evaluation before
training) and counts everything after it: epochs, evaluations, checkpoints. Its seconds, the seconds
spent in epochs alone and the latest epoch's seconds travel in the checkpoint's counters, so a resumed
run goes on with the time it had left. Under ``lr_schedule_clock=time_or_epochs`` it also tells the lr
schedule, before each epoch, which share of the time budget will have been used when that epoch ends
(``FlowRun.time_progress``, ``training/control/schedule.py``): training seconds against the budget net of
the time spent elsewhere, plus the next epoch's seconds predicted from the latest one's (a resumed run's
first epoch from the checkpoint's, as the uninterrupted run predicts it).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from rlgen_cli.recipes.common import Run
from rlgen_cli.recipes.flow_run import setup
from rlgen_cli.schema.recipes import FlowRunConfig
from rlgen_cli.training.checkpoints.interrupt import on_interrupt
from rlgen_cli.training.control.schedule import time_share
from rlgen_cli.training.reporting.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class EpochClock:
    """The epochs bar, the time limit (which epoch is the run's last, decided on rank 0) and the time
    share the lr schedule reads under ``lr_schedule_clock=time_or_epochs``."""

    run: Run
    progress: Progress
    task: int
    budget: float
    """Seconds of ``time_limit_minutes``; inf without a limit."""
    started: float
    """``time.monotonic()`` at the clock's zero (a resumed run's zero lies its saved seconds back)."""
    time_aware: bool
    """``lr_schedule_clock=time_or_epochs`` under a time limit."""
    last_epoch_seconds: float = 0.0
    """The latest epoch's seconds, the predicted length of the next; a resumed run's comes from its
    checkpoint's counters (0 from one saved without them)."""

    @classmethod
    def start(cls, run: Run, progress: Progress) -> EpochClock:
        """Start after any baseline evaluation, so the bar's pace (its time left) counts epochs only."""
        limit = run.time_limit()
        task = progress.task(f"{run.unit}s", total=run.cfg.epochs, completed=run.start_epoch)
        budget = 60 * limit.minutes if limit.minutes else math.inf
        time_aware = limit.schedule_clock == "time_or_epochs" and budget < math.inf
        started = time.monotonic() - run.clock_seconds
        return cls(run, progress, task, budget, started, time_aware, run.last_epoch_seconds)

    def elapsed(self) -> float:
        """Seconds on the clock, resumed runs' earlier seconds included."""
        return time.monotonic() - self.started

    def spent(self) -> float:
        """The seconds the time limit counts: the epochs' alone (``time_limit_counts=training``) or the wall
        clock's; the time share sees the same."""
        return self.run.train_seconds if self.run.time_limit().counts == "training" else self.elapsed()

    def before_epoch(self) -> None:
        """Under the time-aware schedule clock, set ``run.time_progress`` for the epoch about to run:
        the budget share it will have used when it ends, predicted from the last epoch's length. Rank 0's
        clock decides (collective; every rank calls it), so every rank sets the same learning rate."""
        if not self.time_aware:
            return
        run = self.run
        other_seconds = self.spent() - run.train_seconds  # what the limit counts beyond the epochs
        share = time_share(run.train_seconds, other_seconds, self.last_epoch_seconds, self.budget)
        run.time_progress = float(run.dist.gather(torch.tensor([share], dtype=torch.float64))[0])

    def epoch_ended(self, seconds: float) -> None:
        """Count an epoch's ``seconds`` of training, and stamp the clock into the run's counters."""
        self.run.train_seconds += seconds
        self.last_epoch_seconds = seconds
        self.run.last_epoch_seconds = seconds  # into the counters of the runs whose checkpoints save it
        self.stamp()

    def stamp(self) -> None:
        """The clock's seconds into ``run.clock_seconds`` (what a checkpoint saves)."""
        self.run.clock_seconds = self.elapsed()

    def is_last(self, epoch: int) -> bool:
        """The configured last epoch, or the first to end past the time limit. Collective under a time
        limit (rank 0's clock decides, so every rank stops together): call it once per epoch on every rank."""
        if epoch + 1 == self.run.cfg.epochs:
            return True
        return self.budget_used_up()

    def budget_used_up(self) -> bool:
        """Whether the time limit's seconds are spent. Collective (rank 0's clock decides)."""
        if self.budget == math.inf:
            return False
        late = torch.tensor([float(self.spent() >= self.budget)])
        return bool(self.run.dist.gather(late)[0] > 0)

    def advance(self, epoch: int, last: bool, headline: str) -> None:
        """Wait for every rank, move the bar on; say so when the time limit ended the run early."""
        self.run.dist.barrier()
        self.progress.advance(self.task, description=f"{self.run.unit} {epoch + 1}: {headline}")
        if last and epoch + 1 < self.run.cfg.epochs:
            limit = self.run.time_limit()
            log.info("time limit (%g min, %s) hit after epoch %d", limit.minutes, limit.counts, epoch + 1)


@dataclass
class Session:
    """One run between its setup and its end: what each recipe's epoch loop uses."""

    run: Any
    """A :class:`Run` (typed Any: each recipe reads its own run's fields, a FlowRun's or a TrainerRun's)."""
    progress: Progress
    before: dict[str, float] | None
    clock: EpochClock
    metrics: dict[str, float] = field(default_factory=dict)
    """The latest epoch's metrics (what the run returns and the report compares with ``before``)."""
    epoch_started: float = 0.0
    completed: int = 0
    """Epochs trained and logged, resumed ones included (what a Ctrl-C reports)."""

    def epochs(self) -> Iterator[int]:
        """The epochs left to run (after a resume, from the first not yet done), each one timed; none
        when the run resumed from a checkpoint its guard had stopped (``recipes/flow_run.py`` says so) or
        whose time limit is already used up (the run is complete: a requeue loop ends there)."""
        if self.run.stop_requested():
            return
        if self.run.start_epoch > 0 and self.clock.budget_used_up():  # resumed from a run its limit ended
            limit = self.run.time_limit()
            log.warning(
                "time limit (%g min, %s) already used up by the %d epochs this run resumed from: no further "
                "epoch trains; raise time_limit_minutes (or 0 = none) to train on",
                limit.minutes, limit.counts, self.run.start_epoch,
            )  # fmt: skip
            return
        for epoch in range(self.run.start_epoch, self.run.cfg.epochs):
            self.clock.before_epoch()
            self.epoch_started = time.perf_counter()
            yield epoch

    def end_epoch(
        self,
        epoch: int,
        metrics: dict[str, float],
        console: Callable[[dict[str, float]], str],
        headline: str,
        extra_state: dict[str, Any] | None = None,
    ) -> bool:
        """After ``epoch``'s training: its time, the evaluation when due, the log line (``console`` of the
        metrics), the checkpoint when due, the epochs bar (``headline``). ``extra_state``: the recipe's own
        entries of the state after this epoch, for every checkpoint it saves (the guard's best one too).
        True when this was the run's last epoch."""
        metrics["time/epoch"] = time.perf_counter() - self.epoch_started
        self.clock.epoch_ended(metrics["time/epoch"])
        if self.clock.time_aware:
            metrics["time/budget_share"] = self.run.time_progress  # where the lr schedule's clock stood
        last = self.clock.is_last(epoch)
        metrics |= self.run.evaluate_if_due(epoch, last, self.progress, extra_state)
        stopped = self.run.stop_requested() and not last
        last = last or stopped
        self.run.log_epoch(epoch, metrics, console(metrics))
        self.completed = epoch + 1  # its row is in metrics.jsonl: a Ctrl-C from here on counts it done
        self.clock.stamp()  # the evaluation's seconds too, for the checkpoint's counters
        self.run.save_if_due(epoch, last, extra_state)
        self.clock.advance(epoch, last and not stopped, headline)
        self.metrics = metrics
        return last


@contextmanager
def session(cfg: FlowRunConfig, raw_cfg: DictConfig) -> Iterator[Session]:
    """A flow recipe's session: :func:`~rlgen_cli.recipes.flow_run.setup`, then :func:`epoch_session`."""
    with epoch_session(setup(cfg, raw_cfg)) as current:
        yield current


@contextmanager
def epoch_session(run: Run) -> Iterator[Session]:
    """The progress bars and the evaluation before training; on a normal exit :meth:`Run.finish`; on Ctrl-C
    the curves and a line saying how to resume (``training/checkpoints/interrupt.py``); the loggers are
    closed either way."""
    current: Session | None = None

    def completed() -> int:
        return current.completed if current is not None else run.start_epoch

    try:
        with (
            on_interrupt(run.run_dir, run.dist.is_main, completed, run.draw_curves, unit=run.unit),
            Progress(enabled=run.cfg.progress and run.dist.is_main) as progress,
        ):
            before = run.evaluate_before(progress)
            current = Session(
                run, progress, before, EpochClock.start(run, progress), completed=run.start_epoch
            )
            yield current
        run.finish(current.before, current.metrics)
    finally:
        run.close()
