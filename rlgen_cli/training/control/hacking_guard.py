"""The reward-hacking guard: held-out rewards watched at every evaluation, a divergence rule, an action.

A policy can raise the reward it is trained on in ways that make its images worse by any other
measure: clutter that earns GenEval partial credit, flat images that compress well. The guard scores
every evaluation's images (the test prompts, fixed noise, EMA weights when kept) with *monitors* —
registered rewards the policy is not trained on (``guard.monitors: {name: weight}``, ``guard.kwargs``
as ``reward.kwargs``) — and records, at evaluation n,

    r_n = the trained reward mix on those images              (``eval/reward/mean``)
    h_n = Σ_m weight_m · mean score of monitor m on them      (``guard/heldout``)

Both come from the same images, so their changes are paired: the noisier mean of the epoch's rollouts
(other prompts, stochastic steps) plays no part.

**Rule.** With W = ``guard.window``, δ = ``guard.margin``, k = ``guard.noise_k`` and k_r =
``guard.rise_k``, evaluation n is *flagged* when W evaluations precede it in the guard's history and

    r_n − r_{n−W} > k_r · se(r_n − r_{n−W})          the trained reward rose beyond its noise, and
    h_b − h_n > max(δ, k · se(h_b − h_n))            the held-out metric fell more than δ and beyond its
                                                     noise below its best in the window, h_b = max_{n−W ≤ j ≤ n} h_j

(both changes > 0 as well, so k = k_r = 0 is the bare sign and margin rule). se is the standard error
of a change between two evaluations, estimated from the evaluations themselves: both score the same
prompts with the same noise, so it is the spread of the per-prompt changes d_i (a prompt's images
averaged) over the n prompts, se = std(d) / √n — for an accuracy (scores 0 or 1) the binomial error of
the prompts that changed outcome. Prompt-to-prompt differences cancel in d; what is left is how much
the evaluation moves by chance. On pure noise (every evaluation an independent draw) the defaults k = 3,
k_r = 1 flag 0.5–3 % of 40-evaluation runs with W = 3, the bare rule nearly all of them
(tests/training/test_guard_noise.py).

The best of the window rather than its first value, so a rise and fall inside the window counts; the
window rather than the whole run, so an old peak does not flag a run that has since recovered. The
history is every evaluation since the start (the one before training included, with ``eval_before``)
or since the last rollback. An evaluation with a non-finite score is logged and left out of it: the
window is the last W + 1 finite evaluations, whatever order they came in.

**Best checkpoint.** Whenever h_n exceeds every earlier value, the run's full state (weights, EMA,
optimizer, counters) is saved to ``checkpoints/best_heldout``, which ``keep_last`` never deletes and
``resume=auto`` never picks (``rlgen sample checkpoint=RUN/checkpoints/best_heldout`` samples it).

**Actions** (``guard.action``), on a flagged evaluation:

* ``warn`` — log the event and train on;
* ``stop`` — end the run after this epoch (its checkpoint saved as after a last epoch);
* ``rollback`` — load ``best_heldout``'s weights, EMA and optimizer state, multiply the learning rate
  (``algo.lr`` and the optimizer's) by ``rollback_lr_scale`` and ``algo.kl_weight`` by
  ``rollback_kl_scale``, and continue with the next epoch's prompts (sampler, counters and noise
  streams are not rolled back). The history restarts from the restored evaluation, so the next flag
  needs W new evaluations. A flag after ``max_rollbacks`` rollbacks stops the run.

**Logs.** Every evaluation logs ``guard/heldout``, ``guard/reward/<monitor>/mean``, ``guard/best`` and
``guard/best_step`` (the metrics.jsonl step of the best evaluation, 0 = before training), and once
the window is full ``guard/train_rise`` (r_n − r_{n−W}), ``guard/heldout_drop`` (h_b − h_n) and their
standard errors ``guard/train_rise_se`` and ``guard/heldout_drop_se`` — what δ and k are compared
with, so a run shows how close it came; a skipped evaluation ``guard/skipped`` = 1; a flagged evaluation adds
``guard/event/<warn|stop|rollback>`` = 1, a rollback ``guard/lr_scale`` and ``guard/kl_scale``
(cumulative); the console gets one warning line per event. ``guard_curves.png`` draws r and h with the
events at the end of the run.

**Resume.** The guard's state (history, best, rollbacks, scales, and a stop) travels in every
checkpoint, so a resumed run flags, saves and rolls back as an uninterrupted one does; the scales are
applied to ``algo.lr`` / ``algo.kl_weight`` again at resume. A run the guard stopped stays stopped: resumed
from the checkpoint written after the stop (a requeue's ``resume=auto``), it trains no further epoch and
ends with exit code 0, saying when and why the guard stopped it and how to go on
(:meth:`RunGuard.resumed_message`). A checkpoint written before the guard recorded its stops reads as
not stopped.

**Processes.** Rank 0 evaluates and decides; the decision (new best? which action?) is shared with every
rank, which all take part in saving and rolling back. Rollbacks need weights that can be reloaded
mid-run: one process or DDP (``schema/hacking_guard.py`` refuses the sharding launchers).

:class:`HackingGuard` is the rule alone, pure and unit-tested; :class:`RunGuard` adds the monitors, the
scales and the decision shared over ranks; ``recipes/flow_run.py`` calls it from its evaluations and saves.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, get_args

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.rewards import available, build_mix
from rlgen_cli.rewards.mix import WeightedMix
from rlgen_cli.rewards.registry import check_kwargs
from rlgen_cli.schema.choices import GuardAction
from rlgen_cli.schema.hacking_guard import GuardConfig
from rlgen_cli.training.reporting.metrics import read_metrics

__all__ = [
    "BEST_HELDOUT", "GUARD_CURVES", "GUARD_KEY", "HELDOUT", "TRAINED", "Decision", "Evaluation", "GuardEvent",
    "GuardStop", "HackingGuard", "RunGuard", "WindowChange", "change_standard_error", "plot_guard",
    "require_known_monitors",
]  # fmt: skip

log = logging.getLogger(__name__)

GUARD_KEY = "guard"
"""Trainer-state entry of the guard's state in every checkpoint."""
BEST_HELDOUT = "best_heldout"
"""``checkpoints/best_heldout``: the state of the best evaluation by the held-out metric."""
TRAINED, HELDOUT = "eval/reward/mean", "guard/heldout"
"""The two metrics the rule reads from an evaluation: r_n and h_n."""
GUARD_CURVES = "guard_curves.png"
_ACTIONS = get_args(GuardAction)  # warn, stop, rollback: codes 1, 2, 3 when shared over ranks


@dataclass(frozen=True)
class Evaluation:
    """One evaluation as the rule sees it: 0-based epoch (−1 before training) and, per evaluation prompt
    (its images averaged), the trained reward and the held-out metric; r and h are their means."""

    epoch: int
    trained_scores: tuple[float, ...]
    heldout_scores: tuple[float, ...]

    @cached_property
    def trained(self) -> float:
        return math.fsum(self.trained_scores) / len(self.trained_scores)

    @cached_property
    def heldout(self) -> float:
        return math.fsum(self.heldout_scores) / len(self.heldout_scores)

    def as_dict(self) -> dict[str, Any]:
        scores = {"trained": list(self.trained_scores), "heldout": list(self.heldout_scores)}
        return {"epoch": self.epoch, **scores}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Evaluation:
        return cls(int(values["epoch"]), _floats(values["trained"]), _floats(values["heldout"]))


def _floats(values: Sequence[float] | Tensor) -> tuple[float, ...]:
    if isinstance(values, Tensor):
        return tuple(values.detach().double().flatten().tolist())
    return tuple(map(float, values))


def change_standard_error(before: Sequence[float], after: Sequence[float]) -> float:
    """Standard error of mean(after) − mean(before) over the same n prompts: std(d) / √n of the
    per-prompt changes d (Bessel-corrected). The same prompts and noise give both evaluations, so
    prompt-to-prompt differences cancel; for 0/1 scores this is the binomial error of the prompts that
    changed outcome, √((b + c − (b − c)² / n) / (n − 1)) / √n with b up and c down."""
    assert len(before) == len(after) >= 2
    changes = list(map(operator.sub, after, before))
    n = len(changes)
    mean = math.fsum(changes) / n
    deviations = [d - mean for d in changes]
    return math.sqrt(math.fsum(map(operator.mul, deviations, deviations)) / (n - 1) / n)


@dataclass(frozen=True)
class WindowChange:
    """The window's two changes and their standard errors (:func:`change_standard_error`)."""

    train_rise: float
    """r_n − r_{n−W}."""
    train_rise_se: float
    heldout_drop: float
    """h_b − h_n, h_b the best held-out value of the window."""
    heldout_drop_se: float

    def metrics(self) -> dict[str, float]:
        return {
            "guard/train_rise": self.train_rise,
            "guard/train_rise_se": self.train_rise_se,
            "guard/heldout_drop": self.heldout_drop,
            "guard/heldout_drop_se": self.heldout_drop_se,
        }


@dataclass(frozen=True)
class GuardEvent:
    """A flagged evaluation and the action taken."""

    epoch: int
    action: str
    change: WindowChange
    best: Evaluation
    """The run's best evaluation by the held-out metric (what a rollback restores)."""

    @property
    def train_rise(self) -> float:
        return self.change.train_rise

    @property
    def heldout_drop(self) -> float:
        return self.change.heldout_drop

    def metrics(self) -> dict[str, float]:
        return {f"guard/event/{self.action}": 1.0}

    def describe(self, window: int, margin: float) -> str:
        then = {
            "warn": "training goes on (guard.action=warn)",
            "stop": "stopping after this epoch",
            "rollback": f"rolling back to checkpoints/{BEST_HELDOUT} ({_when(self.best.epoch)}, held-out "
            f"{self.best.heldout:.4g})",
        }[self.action]
        evidence = self.evidence(window, margin)
        return f"guard: reward hacking suspected after epoch {self.epoch + 1}: {evidence}; {then}"

    def evidence(self, window: int, margin: float) -> str:
        """What flagged the evaluation: the window's two changes against their noise and the margin."""
        change = self.change
        rise, drop = change.train_rise, change.heldout_drop
        return (
            f"the trained reward rose {rise:+.4g} ({_in_errors(rise, change.train_rise_se)}) over {window} "
            f"evaluation{'s' if window > 1 else ''} while the held-out metric fell {drop:.4g} "
            f"({_in_errors(drop, change.heldout_drop_se)}) below its best of the window (margin {margin:g})"
        )


def _when(epoch: int) -> str:
    return "before training" if epoch < 0 else f"after epoch {epoch + 1}"  # epochs completed


def _in_errors(change: float, standard_error: float) -> str:
    return "no spread" if standard_error == 0 else f"{change / standard_error:.1f} standard errors"


@dataclass(frozen=True)
class Verdict:
    """What one observation found: a new best held-out value, the event if the rule fired, the window's
    change once the window is full, and whether the evaluation was skipped (a non-finite score)."""

    new_best: bool
    event: GuardEvent | None
    change: WindowChange | None = None
    skipped: bool = False


class HackingGuard:
    """The rule of the module docstring over a history of evaluations, and the best one seen.

    Args:
        window: W ≥ 1, evaluations looked back over.
        margin: δ ≥ 0, in the held-out metric's units.
        action: ``warn``, ``stop`` or ``rollback``.
        max_rollbacks: Rollbacks allowed before a flag stops instead.
        noise_k: k ≥ 0, standard errors the held-out drop must exceed (0: the margin alone).
        rise_k: k_r ≥ 0, standard errors the trained reward's rise must exceed (0: any rise).
    """

    def __init__(
        self,
        window: int,
        margin: float,
        action: str = "warn",
        max_rollbacks: int = 3,
        noise_k: float = 3.0,
        rise_k: float = 1.0,
    ) -> None:
        assert window >= 1 and margin >= 0 and action in _ACTIONS and max_rollbacks >= 0
        assert noise_k >= 0 and rise_k >= 0
        self.window, self.margin, self.action, self.max_rollbacks = window, margin, action, max_rollbacks
        self.noise_k, self.rise_k = noise_k, rise_k
        self.history: list[Evaluation] = []
        """The last W + 1 finite evaluations since the start or the last rollback, oldest first."""
        self.best: Evaluation | None = None
        self.rollbacks = 0

    def observe(
        self, epoch: int, trained: Sequence[float] | Tensor, heldout: Sequence[float] | Tensor
    ) -> Verdict:
        """Record the evaluation after ``epoch`` (−1: before training) and judge it. ``trained`` and
        ``heldout``: each evaluation prompt's trained reward and held-out metric, in the same prompt
        order at every evaluation. One with a non-finite score is logged and skipped.

        Raises:
            UserError: Fewer than 2 prompts (no spread to estimate the noise from), or another number of
                prompts than the evaluations in the history (a resumed run that evaluates other prompts).
        """
        current = Evaluation(epoch, _floats(trained), _floats(heldout))
        self._require_comparable(current)
        if not all(map(math.isfinite, current.trained_scores + current.heldout_scores)):
            log.warning(
                "guard: the evaluation after epoch %d has non-finite scores (trained %s, held-out %s): "
                "skipped, the window is the finite evaluations around it",
                epoch + 1,
                _count_non_finite(current.trained_scores),
                _count_non_finite(current.heldout_scores),
            )
            return Verdict(False, None, skipped=True)
        new_best = self.best is None or current.heldout > self.best.heldout
        if new_best:
            self.best = current
        self.history = [*self.history, current][-(self.window + 1) :]
        change = self._window_change()
        event = None if change is None else self._judge(change)
        if event is not None and event.action == "rollback":
            self.rollbacks += 1
            self.history = [self.best]  # the restored state's evaluation opens the next window
        return Verdict(new_best, event, change)

    def _require_comparable(self, current: Evaluation) -> None:
        n = len(current.trained_scores)
        if n != len(current.heldout_scores):
            raise ValueError(f"{n} trained scores but {len(current.heldout_scores)} held-out scores")
        if n < 2:
            raise UserError(
                f"the guard estimates an evaluation's noise from the spread over its prompts, and this one "
                f"has {n}: evaluate at least 2 (data.eval_num_prompts, or a longer data.test)"
            )
        recorded = self.history[-1] if self.history else self.best
        if recorded is not None and len(recorded.trained_scores) != n:
            raise UserError(
                f"the guard's history was recorded on {len(recorded.trained_scores)} evaluation prompts and "
                f"this evaluation has {n}: resume with the data.eval_num_prompts and "
                "data.eval_images_per_prompt the run started with"
            )

    def _window_change(self) -> WindowChange | None:
        """r_n − r_{n−W}, h_b − h_n and their standard errors once W evaluations precede the current one."""
        if len(self.history) <= self.window:
            return None
        start, current = self.history[0], self.history[-1]
        best = max(reversed(self.history), key=lambda e: e.heldout)  # the latest of equal bests
        return WindowChange(
            current.trained - start.trained,
            change_standard_error(start.trained_scores, current.trained_scores),
            best.heldout - current.heldout,
            change_standard_error(best.heldout_scores, current.heldout_scores),
        )

    def _judge(self, change: WindowChange) -> GuardEvent | None:
        rose = _beyond(change.train_rise, self.rise_k, change.train_rise_se)
        drop, drop_se = change.heldout_drop, change.heldout_drop_se
        fell = drop > self.margin and _beyond(drop, self.noise_k, drop_se)
        if not (rose and fell):
            return None
        current = self.history[-1]
        action = self.action
        if action == "rollback" and self.rollbacks >= self.max_rollbacks:
            action = "stop"
        assert self.best is not None
        return GuardEvent(current.epoch, action, change, self.best)

    def state_dict(self) -> dict[str, Any]:
        """Plain lists and numbers (``torch.load(weights_only=True)`` reads them back)."""
        return {
            "history": [e.as_dict() for e in self.history],
            "best": None if self.best is None else self.best.as_dict(),
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """
        Raises:
            UserError: A guard state without per-prompt scores (written before the guard kept them).
        """
        if not all(isinstance(e, Mapping) for e in [*state["history"], state["best"] or {}]):
            raise UserError(
                "the checkpoint's guard state has no per-prompt scores (an earlier rlgen wrote it), so the "
                "guard cannot estimate the noise of its window: start the run afresh, or resume without "
                "the guard (guard.monitors={})"
            )
        self.history = [Evaluation.from_dict(e) for e in state["history"]]
        self.best = None if state["best"] is None else Evaluation.from_dict(state["best"])
        self.rollbacks = int(state["rollbacks"])


def _beyond(change: float, k: float, standard_error: float) -> bool:
    """A positive change of more than k standard errors."""
    return change > 0 and change > k * standard_error


def _count_non_finite(scores: Sequence[float]) -> str:
    return f"{sum(not math.isfinite(v) for v in scores)} of {len(scores)}"


@dataclass(frozen=True)
class GuardStop:
    """A ``stop`` decision, kept in the guard's state so that a resumed run stays stopped."""

    epochs_done: int
    """The run stopped after this many epochs (the checkpoint written then is ``epoch_<epochs_done>``)."""
    reason: str
    """What flagged the evaluation (:meth:`GuardEvent.evidence`); empty where it is not known (a rank
    other than 0, which never writes the state)."""

    def as_dict(self) -> dict[str, Any]:
        return {"epochs_done": self.epochs_done, "reason": self.reason}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GuardStop:
        return cls(int(values["epochs_done"]), str(values["reason"]))


@dataclass(frozen=True)
class Decision:
    """The guard's decision after an evaluation, the same on every rank (``event``: rank 0 only)."""

    new_best: bool
    action: str | None
    event: GuardEvent | None = None


class RunGuard:
    """The guard of one run: its monitors, the rule, and the scales its rollbacks applied.

    Args:
        cfg: ``guard``.
        monitors: The held-out rewards, built like the trained ones.
    """

    def __init__(self, cfg: GuardConfig, monitors: WeightedMix) -> None:
        self.cfg, self.monitors = cfg, monitors
        rule = HackingGuard(cfg.window, cfg.margin, cfg.action, cfg.max_rollbacks, cfg.noise_k, cfg.rise_k)
        self.rule = rule
        self.lr_scale = 1.0
        self.kl_scale = 1.0
        self.stop: GuardStop | None = None
        """Set by a ``stop`` decision (or a resumed state holding one): the recipe's loop ends after this
        epoch, a resumed run before its first."""
        self.verdict: Verdict | None = None
        """Rank 0's latest observation."""
        self.pending: tuple[Tensor, Tensor] | None = None
        """The latest evaluation's per-prompt trained reward and held-out metric, for :meth:`decide`."""

    @property
    def stop_requested(self) -> bool:
        """Whether the guard stopped the run (:attr:`stop`)."""
        return self.stop is not None

    @classmethod
    def build(
        cls, cfg: GuardConfig, dist: Any, algo: Any, state: Mapping[str, Any] | None
    ) -> RunGuard | None:
        """The run's guard (None without monitors); ``state``: a resumed checkpoint's, whose scales are
        applied to ``algo`` again.

        Raises:
            UserError: A rollback under an engine that shards weights or optimizer state (a
                ``launcher.config_file`` can choose one; ``schema/hacking_guard.py`` catches the named launchers).
        """
        if not cfg.enabled:
            return None
        if cfg.action == "rollback" and (dist.sharded or dist.shards_optimizer):
            raise UserError(
                f"guard.action=rollback reloads weights and optimizer state mid-run, which the {dist.engine} "
                "engine shards: launch with DDP (launcher=accelerate without a DeepSpeed or FSDP config "
                "file) or use guard.action=warn or stop"
            )
        kwargs = {name: dict(value) for name, value in cfg.kwargs.items()}
        guard = cls(cfg, build_mix(dict(cfg.monitors), **kwargs))
        if state is not None:
            guard.load_state_dict(state)
            guard._scale(algo, guard.lr_scale, guard.kl_scale)
        log.info(
            "guard: monitors %s, window W=%d, margin δ=%g, noise_k k=%g, rise_k k_r=%g, action %s",
            dict(cfg.monitors),
            cfg.window,
            cfg.margin,
            cfg.noise_k,
            cfg.rise_k,
            cfg.action,
        )
        return guard

    def score_evaluation(
        self, trained: Tensor, components: Mapping[str, Tensor], images_per_prompt: int
    ) -> dict[str, float]:
        """An evaluation's per-sample trained reward ``trained`` and monitor scores ``components`` (the
        ``images_per_prompt`` images of each prompt consecutive): each prompt's mean of both is kept for
        :meth:`decide`; returns ``guard/heldout`` (h: Σ weight · mean) and each monitor's mean."""
        heldout = sum(self.monitors.weights[name] * scores.double() for name, scores in components.items())
        self.pending = (_per_prompt(trained, images_per_prompt), _per_prompt(heldout, images_per_prompt))
        means = {f"guard/reward/{name}/mean": float(scores.mean()) for name, scores in components.items()}
        return {HELDOUT: float(self.pending[1].mean()), **means}

    def decide(self, dist: Any, epoch: int) -> Decision:
        """Rank 0 observes the evaluation :meth:`score_evaluation` kept; every rank gets its decision.
        Collective: every rank calls it after every evaluation."""
        verdict = None
        if dist.is_main:
            assert self.pending is not None, "score_evaluation before decide"
            verdict = self.rule.observe(epoch, *self.pending)
            self.pending = None
        self.verdict = verdict
        local = [0.0, 0.0]
        if verdict is not None:
            action = verdict.event.action if verdict.event is not None else None
            local = [float(verdict.new_best), float(_ACTIONS.index(action) + 1 if action else 0)]
        new_best, code = dist.gather(torch.tensor([local], dtype=torch.float64))[0].tolist()
        action = _ACTIONS[int(code) - 1] if code else None
        if action == "stop":
            self.stop = GuardStop(epoch + 1, self._stop_reason(verdict))
        return Decision(bool(new_best), action, verdict.event if verdict is not None else None)

    def _stop_reason(self, verdict: Verdict | None) -> str:
        """Why the guard stops: the flagged change, and the rollbacks spent when they ran out (rank 0)."""
        if verdict is None or verdict.event is None:
            return ""
        reason = verdict.event.evidence(self.cfg.window, self.cfg.margin)
        if self.cfg.action == "rollback":
            reason += (
                f", after {self.rule.rollbacks} rollbacks (guard.max_rollbacks={self.cfg.max_rollbacks})"
            )
        return reason

    def resumed_message(self) -> str:
        """What a run resumed after the guard's stop says before it ends untrained: when and why the guard
        stopped it, where its result is, and how to train further."""
        assert self.stop is not None
        cfg, epochs = self.cfg, self.stop.epochs_done
        why = f": {self.stop.reason}" if self.stop.reason else ""
        monitors = [f"~guard.monitors.{name}" for name in cfg.monitors]
        without = " ".join(monitors + [f"~guard.kwargs.{name}" for name in cfg.kwargs])
        return (
            f"guard: the reward-hacking guard stopped this run after epoch {epochs}{why}. The run is complete "
            "and trains no further epoch (exit code 0: a requeue loop ends here). Its last checkpoint holds "
            f"the state after epoch {epochs}, checkpoints/{BEST_HELDOUT} the best by the held-out metric. "
            "To train further, start a new run (another hydra.run.dir) with a looser guard (a larger "
            "guard.margin or guard.noise_k, or guard.action=warn), or resume this one without the guard "
            f"(drop its monitors: {without})"
        )

    def status_metrics(self) -> dict[str, float]:
        """The best held-out value so far and its step, the window's change and its standard errors once
        the window is full, ``guard/skipped`` for a skipped evaluation (rank 0, after :meth:`decide`)."""
        best, verdict = self.rule.best, self.verdict
        if verdict is None:
            return {}
        metrics = (
            {} if best is None else {"guard/best": best.heldout, "guard/best_step": float(best.epoch + 1)}
        )
        if verdict.skipped:
            metrics["guard/skipped"] = 1.0
        if verdict.change is not None:
            metrics |= verdict.change.metrics()
        return metrics

    def require_best_state(self, epochs_done: int) -> None:
        """``checkpoints/best_heldout`` (the state after ``epochs_done`` epochs) is the guard's best.

        Raises:
            UserError: It is not — a crashed attempt wrote a later best after the checkpoint this run
                resumed from — rather than rolling back to weights the guard never chose.
        """
        best = self.rule.best
        if best is not None and best.epoch + 1 != epochs_done:
            raise UserError(
                f"checkpoints/{BEST_HELDOUT} holds the state after {epochs_done} epochs, but the guard's best "
                f"is the state after {best.epoch + 1}: an earlier attempt of this run wrote it past the "
                f"checkpoint this one resumed from. Resume from a checkpoint after epoch {epochs_done}, or "
                "set guard.action=warn or stop"
            )

    def rescale_after_rollback(self, algo: Any, optimizer: Any, lrs: Sequence[float]) -> dict[str, float]:
        """After a rollback loaded the best state's optimizer: every param group's learning rate is its
        pre-rollback value ``lrs`` × ``rollback_lr_scale``, ``algo.lr`` and ``algo.kl_weight`` are
        scaled too (the recipes read them every epoch or step). Returns the cumulative scales."""
        lr_factor, kl_factor = self.cfg.rollback_lr_scale, self.cfg.rollback_kl_scale
        self.lr_scale *= lr_factor
        self.kl_scale *= kl_factor
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr * lr_factor
        self._scale(algo, lr_factor, kl_factor)
        return {"guard/lr_scale": self.lr_scale, "guard/kl_scale": self.kl_scale}

    @staticmethod
    def _scale(algo: Any, lr_factor: float, kl_factor: float) -> None:
        algo.lr *= lr_factor
        if kl_factor != 1:  # schema/hacking_guard.py allows it only where algo.kl_weight trains
            algo.kl_weight *= kl_factor

    def state_dict(self) -> dict[str, Any]:
        stop = None if self.stop is None else self.stop.as_dict()
        return {**self.rule.state_dict(), "lr_scale": self.lr_scale, "kl_scale": self.kl_scale, "stop": stop}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rule.load_state_dict(state)
        self.lr_scale, self.kl_scale = float(state["lr_scale"]), float(state["kl_scale"])
        stop = state.get("stop")  # absent from checkpoints written before the guard kept its stops
        self.stop = None if stop is None else GuardStop.from_dict(stop)


def _per_prompt(scores: Tensor, images_per_prompt: int) -> Tensor:
    """Each prompt's mean of its ``images_per_prompt`` consecutive per-sample ``scores``."""
    return scores.detach().double().reshape(-1, images_per_prompt).mean(dim=1)


def require_known_monitors(guard: GuardConfig) -> None:
    """``guard.monitors`` are registered rewards and ``guard.kwargs`` ones they take (the config
    boundary, before any model loads).

    Raises:
        UserError: Naming the unknown monitor (and the known rewards) or the bad kwarg.
    """
    unknown = sorted(set(guard.monitors) - set(available()))
    if unknown:
        raise UserError(
            f"guard.monitors names unknown reward{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; known rewards: {', '.join(available())}"
        )
    for name in guard.monitors:
        try:
            check_kwargs(name, guard.kwargs.get(name, {}))
        except UserError as err:  # the registry names reward.kwargs; these are the guard's
            raise UserError(str(err).replace(f"reward.kwargs.{name}", f"guard.kwargs.{name}")) from None


def plot_guard(run_dir: Path, out: Path) -> Path | None:
    """r (trained reward on the evaluation images) and h (held-out metric) against epochs completed,
    with the guard's events as vertical lines and the best held-out evaluation starred; None when the
    run logged no held-out metric."""
    rows = [row for row in read_metrics(run_dir) if row.get(HELDOUT) is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [row["step"] for row in rows]  # epochs completed, as every output of a run counts
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in (
        (axes[0], TRAINED, "trained reward (eval images)"),
        (axes[1], HELDOUT, "held-out"),
    ):
        ax.plot(x, [row.get(key, math.nan) for row in rows], marker="o", ms=3)
        ax.set_xlabel("epochs completed")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(label)
        for row, at in zip(rows, x, strict=True):
            for action, colour in zip(_ACTIONS, ("tab:orange", "tab:red", "tab:purple"), strict=True):
                if row.get(f"guard/event/{action}"):
                    ax.axvline(at, color=colour, ls="--", lw=1, label=action)
    best = max(rows, key=lambda row: row[HELDOUT])
    axes[1].plot([best["step"]], [best[HELDOUT]], marker="*", ms=12, color="gold", ls="", label="best")
    handles = dict(zip(*reversed(axes[1].get_legend_handles_labels()), strict=True))
    axes[1].legend(handles.values(), handles.keys(), fontsize=8)
    monitors = ", ".join(
        k.removeprefix("guard/reward/").removesuffix("/mean")
        for k in rows[0]
        if k.startswith("guard/reward/")
    )
    fig.suptitle(f"{run_dir.name}: guard, held-out = {monitors}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
