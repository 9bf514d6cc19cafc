"""The lr schedule's clock (``lr_schedule_clock``): where a run stands in its decay under a time limit,
by hand-computed values; the epoch clock that feeds it, restored across a resume; and the epoch-only
clock kept by every experiment but ShapesEval."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlgen_cli._hydra import compose_verb
from rlgen_cli.recipes import session as session_module
from rlgen_cli.recipes.common import TimeLimit
from rlgen_cli.recipes.session import EpochClock
from rlgen_cli.training.control.schedule import epoch_lr, time_share


def test_the_time_share_counts_training_against_the_budget_net_of_other_time():
    # 300 s trained, 120 s spent evaluating, next epoch 10 s, 600 s budget: 310 / (600 − 120)
    assert time_share(300.0, 120.0, 10.0, 600.0) == pytest.approx(310 / 480)
    assert time_share(300.0, 120.0, 10.0, 0.0) == 0.0  # no budget: epochs alone
    assert time_share(500.0, 90.0, 20.0, 600.0) == 1.0  # capped: the epoch ends past the budget
    assert time_share(10.0, 700.0, 1.0, 600.0) == 1.0  # nothing left for training


def test_the_schedule_stands_at_the_further_along_of_epochs_and_time():
    # 101 epochs, hold for half (the last held epoch is floor(0.5 · 101) = 50), cosine to 0 at epoch 100
    def lr(epoch: int, time_progress: float) -> float:
        return epoch_lr(1.0, "cosine", epoch, 101, 0.5, 0.0, time_progress)

    assert lr(10, 0.0) == 1.0 and lr(10, 0.4) == 1.0  # both still in the hold
    # time ahead: position 0.75 · 100 = 75, progress (75 − 50) / 50 = 0.5 → ½(1 + cos π/2) = 0.5
    assert lr(10, 0.75) == pytest.approx(0.5)
    # epochs ahead: position 90, progress 0.8 → ½(1 + cos 0.8π)
    assert lr(90, 0.75) == pytest.approx(0.5 * (1 + math.cos(0.8 * math.pi)))
    assert lr(90, 0.0) == lr(90, 0.75)
    assert lr(10, 1.0) == pytest.approx(0.0)  # the budget spent: the decay has ended
    assert epoch_lr(1.0, "constant", 10, 101, 0.5, 0.0, 1.0) == 1.0


class FakeTime:
    """A ``time.monotonic`` the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _clock(
    monkeypatch,
    clock: str = "time_or_epochs",
    minutes: float = 10.0,
    clock_seconds: float = 0.0,
    train_seconds: float = 0.0,
    counts: str = "wall",
    last_epoch_seconds: float = 0.0,
) -> tuple[EpochClock, SimpleNamespace, FakeTime]:
    """A clock on a run holding the counters a checkpoint carries (as a FlowRun, fresh or resumed)."""
    fake = FakeTime()
    monkeypatch.setattr(session_module.time, "monotonic", fake)
    cfg = SimpleNamespace(epochs=100)
    run = SimpleNamespace(
        cfg=cfg,
        start_epoch=0,
        dist=SimpleNamespace(gather=lambda t: t),
        time_progress=0.0,
        train_seconds=train_seconds,
        clock_seconds=clock_seconds,
        last_epoch_seconds=last_epoch_seconds,
        time_limit=lambda: TimeLimit(minutes, counts, clock),
        unit="epoch",
    )
    progress = SimpleNamespace(task=lambda *a, **k: 0)
    return EpochClock.start(run, progress), run, fake  # type: ignore[arg-type]


def test_the_epoch_clock_feeds_the_schedule_its_time_share(monkeypatch):
    clock, run, fake = _clock(monkeypatch)  # 600 s budget
    clock.before_epoch()
    assert run.time_progress == 0.0  # nothing measured yet
    fake.now += 30.0  # a 30 s epoch…
    clock.epoch_ended(30.0)
    fake.now += 90.0  # …then a 90 s evaluation
    clock.before_epoch()
    # (30 trained + 30 expected) / (600 − 90 spent elsewhere)
    assert run.time_progress == pytest.approx(60 / 510)
    assert run.train_seconds == 30.0 and run.clock_seconds == pytest.approx(30.0)
    clock.stamp()
    assert run.clock_seconds == pytest.approx(120.0)
    assert not clock.is_last(5)
    fake.now += 480.0
    assert clock.is_last(5)  # 600 s on the clock


def test_a_limit_on_training_time_ignores_the_seconds_spent_elsewhere(monkeypatch):
    clock, run, fake = _clock(monkeypatch, counts="training")  # 600 s of training
    fake.now += 30.0  # a 30 s epoch…
    clock.epoch_ended(30.0)
    fake.now += 900.0  # …then 900 s of evaluation: past a wall limit, not this one
    clock.before_epoch()
    assert run.time_progress == pytest.approx(60 / 600)  # (30 trained + 30 expected) / 600
    assert not clock.is_last(5)
    fake.now += 569.0
    clock.epoch_ended(569.0)  # 599 s of training
    assert not clock.is_last(6)
    fake.now += 1.0
    clock.epoch_ended(1.0)
    assert clock.is_last(7)  # 600 s of training


def test_the_epochs_clock_leaves_the_schedule_to_the_epochs(monkeypatch):
    clock, run, fake = _clock(monkeypatch, clock="epochs")
    fake.now += 500.0
    clock.epoch_ended(500.0)
    clock.before_epoch()
    assert run.time_progress == 0.0 and run.train_seconds == 500.0
    no_limit, run, _ = _clock(monkeypatch, minutes=0.0)  # time-aware, but no budget to follow
    no_limit.before_epoch()
    assert not no_limit.time_aware and run.time_progress == 0.0 and not no_limit.is_last(5)


def test_a_resumed_clock_goes_on_from_the_saved_seconds(monkeypatch):
    # resumed with 400 s on the clock, 300 of them training, the last epoch 20 s: 200 s of the 600 s
    # budget are left, and the first epoch is expected to take 20 s as the uninterrupted run expects it
    clock, run, fake = _clock(monkeypatch, clock_seconds=400.0, train_seconds=300.0, last_epoch_seconds=20.0)
    assert clock.elapsed() == pytest.approx(400.0)
    clock.before_epoch()
    assert run.time_progress == pytest.approx(320 / 500)  # (300 + 20 expected) / (600 − 100)
    fake.now += 199.0
    assert not clock.is_last(50)
    fake.now += 1.0
    assert clock.is_last(50)
    # a checkpoint saved before the counters held the last epoch's seconds: 0 expected, as then
    older, run, _ = _clock(monkeypatch, clock_seconds=400.0, train_seconds=300.0)
    older.before_epoch()
    assert run.time_progress == pytest.approx(300 / 500)


COUNTERS = ("train_seconds", "clock_seconds", "last_epoch_seconds")
"""The clock's entries of a checkpoint's counters (``recipes/flow_run.py``'s ``save``)."""


def test_a_resumed_clock_predicts_its_first_epoch_as_the_uninterrupted_one(monkeypatch):
    """Two epochs (30 s, then 90 s of evaluation, then 40 s), a checkpoint, and the third epoch's time
    share: a run resumed from the checkpoint's counters sets the one the uninterrupted run sets."""
    clock, run, fake = _clock(monkeypatch)  # 600 s budget
    for seconds, evaluation in ((30.0, 90.0), (40.0, 0.0)):
        clock.before_epoch()
        fake.now += seconds
        clock.epoch_ended(seconds)
        fake.now += evaluation
        clock.stamp()  # before the checkpoint
    counters = {key: getattr(run, key) for key in COUNTERS}
    assert counters == {"train_seconds": 70.0, "clock_seconds": 160.0, "last_epoch_seconds": 40.0}
    clock.before_epoch()
    uninterrupted = run.time_progress
    assert uninterrupted == pytest.approx((70 + 40) / (600 - 90))

    resumed, resumed_run, _ = _clock(monkeypatch, **counters)
    resumed.before_epoch()
    assert resumed_run.time_progress == uninterrupted
    assert resumed.last_epoch_seconds == clock.last_epoch_seconds == 40.0


@pytest.mark.parametrize(
    "args", ["experiment=tiny_cpu", "experiment=geneval_sd3", "experiment=shapes_pretrain", "algo=grpo"]
)
def test_other_runs_keep_the_epoch_clock(args: str):
    assert compose_verb("train", [args]).lr_schedule_clock == "epochs"


def test_rlgen_train_defaults_to_shapes_eval_with_the_time_aware_clock_and_the_heldout_split():
    cfg = compose_verb("train", ["experiment=shapes_grpo_fast"])
    assert cfg.lr_schedule_clock == "time_or_epochs" and cfg.time_limit_minutes > 0
    assert cfg.eval_heldout == "builtin:shapes_heldout.jsonl"
    assert compose_verb("train", ["experiment=shapes_grpo_fast", "eval_heldout=null"]).eval_heldout is None


def test_the_time_share_reaches_every_rank_from_rank_0(monkeypatch):
    clock, run, fake = _clock(monkeypatch)
    run.dist = SimpleNamespace(gather=lambda t: torch.cat([t, torch.tensor([0.9], dtype=t.dtype)]))
    fake.now += 60.0
    clock.epoch_ended(60.0)
    clock.before_epoch()
    assert run.time_progress == pytest.approx(120 / 600)  # rank 0's value, not rank 1's 0.9


def _counters(run: Path, epochs_done: int) -> dict:
    state = torch.load(
        run / "checkpoints" / f"epoch_{epochs_done:06d}" / "trainer_state.pt", weights_only=False
    )
    return state["counters"]


@pytest.mark.slow
def test_resume_restores_the_clock_from_the_checkpoint_counters(cli, tmp_path: Path):
    """A ShapesEval run stopped after 2 epochs and resumed for a third: the third checkpoint's training
    seconds are the second's plus the third epoch's (a fresh clock would hold the third epoch's alone),
    and the third epoch's time share predicts its length from the second epoch's, saved in the
    counters, as the uninterrupted run would (a fresh clock would predict 0 s)."""
    from tests.shapes.test_shapes_train import SMALL

    run = tmp_path / "clock"
    # eval_every=10: only the last epoch evaluates (the experiment's guard needs an evaluation)
    common = ["experiment=shapes_grpo_fast", *SMALL, "eval_every=10", "eval_before=false", "save_every=1",
              "time_limit_minutes=600", f"hydra.run.dir={run}"]  # fmt: skip
    code, out = cli("train", *common, "epochs=2")
    assert code == 0, out
    # the cosine schedule spans the epochs: a longer run is a change the resume names
    code, out = cli("train", *common, "epochs=3", "resume=auto", "resume_changes=[epochs]")
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    first, second, third = (_counters(run, n) for n in (1, 2, 3))
    assert first["train_seconds"] == rows[0]["time/epoch"]
    assert second["train_seconds"] == first["train_seconds"] + rows[1]["time/epoch"]
    assert third["train_seconds"] == second["train_seconds"] + rows[2]["time/epoch"]
    assert third["clock_seconds"] > second["clock_seconds"] >= second["train_seconds"]
    assert all(0 < r["time/budget_share"] < 0.01 for r in rows[1:])  # 600 minutes: barely started
    assert [c["last_epoch_seconds"] for c in (first, second, third)] == [r["time/epoch"] for r in rows]
    # resumed: (trained + the second epoch's length) / (budget − the clock's other seconds at the save);
    # the clock runs on a few milliseconds between resuming and the third epoch, a relative 1e-7 here
    budget, other = 600 * 60, second["clock_seconds"] - second["train_seconds"]
    predicted = (second["train_seconds"] + second["last_epoch_seconds"]) / (budget - other)
    assert rows[2]["time/budget_share"] == pytest.approx(predicted, rel=1e-5)
