"""A run the reward-hacking guard stopped stays stopped (``guard.action=stop``; rlgen_cli/training/control/
hacking_guard.py, recipes/session.py): the stop travels in the guard's state with its epoch and reason, a
state saved before stops were kept reads as not stopped, and a tiny SD3 run the guard stopped, resumed
as a requeue resumes it (``resume=auto``), trains no further epoch, says why and exits 0.

The rule's curves and the tiny SD3 settings are tests/training/test_hacking_guard.py's.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import torch

from rlgen_cli.training.control.hacking_guard import RunGuard
from tests.conftest import run_cli
from tests.training.test_hacking_guard import (
    GUARDED_RUN,
    _decide,
    _guard_events,
    _OneProcess,
    _rows,
    _run_guard,
    _state,
)


def _saved_and_loaded(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)  # as a checkpoint's trainer state holds it
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resumed(guard: RunGuard, state: dict) -> RunGuard:
    resumed = RunGuard.build(guard.cfg, _OneProcess(), SimpleNamespace(lr=1e-3), _saved_and_loaded(state))
    assert resumed is not None
    return resumed


def test_a_stop_travels_in_the_guard_state_with_its_epoch_and_reason():
    guard = _run_guard(window=1, margin=0.125, action="stop")
    _decide(guard, -1, trained=0.0, heldout=0.5)
    assert guard.state_dict()["stop"] is None
    _decide(guard, 0, trained=0.25, heldout=0.25)  # flagged after epoch 1
    resumed = _resumed(guard, guard.state_dict())
    assert resumed.stop_requested and resumed.stop == guard.stop
    assert resumed.stop is not None and resumed.stop.epochs_done == 1
    assert resumed.stop.reason.startswith("the trained reward rose +0.25 (no spread) over 1 evaluation")
    message = resumed.resumed_message()
    assert "guard stopped this run after epoch 1: the trained reward rose +0.25" in message
    assert "trains no further epoch (exit code 0" in message
    assert "start a new run" in message and "~guard.monitors.brightness" in message


def test_a_stop_past_max_rollbacks_says_so():
    guard = _run_guard(window=1, margin=0.125, action="rollback", max_rollbacks=0)
    _decide(guard, -1, trained=0.0, heldout=0.5)
    assert _decide(guard, 2, trained=0.25, heldout=0.25).action == "stop"
    assert guard.stop is not None and guard.stop.epochs_done == 3
    assert guard.stop.reason.endswith("(margin 0.125), after 0 rollbacks (guard.max_rollbacks=0)")


def test_a_guard_state_saved_before_stops_were_kept_reads_as_not_stopped():
    guard = _run_guard(window=1, margin=0.125, action="stop")
    _decide(guard, -1, trained=0.0, heldout=0.5)
    _decide(guard, 0, trained=0.25, heldout=0.25)
    older = {k: v for k, v in guard.state_dict().items() if k != "stop"}
    resumed = _resumed(guard, older)
    assert not resumed.stop_requested and resumed.stop is None
    assert resumed.rule.best == guard.rule.best and resumed.rule.history == guard.rule.history


def test_a_run_the_guard_stopped_stays_stopped_when_resumed(tmp_path: Path):
    """Margin 0 and guard.action=stop: epoch 0 is flagged (test_hacking_guard.py's measured +0.00034) and
    the run of 3 epochs ends after 1. A requeue resuming it (resume=auto, same settings) trains no further
    epoch, writes nothing, says when and why the guard stopped the run, and exits 0 so that its loop ends."""
    run = tmp_path / "run"
    settings = [*GUARDED_RUN, "guard.action=stop", "guard.margin=0", "epochs=3", f"hydra.run.dir={run}"]
    code, out = run_cli("train", *settings)
    assert code == 0, out
    assert _guard_events(_rows(run)) == {1: ["stop"]}  # metrics.jsonl steps: epochs completed
    assert [row["step"] for row in _rows(run)] == [0, 1]  # before training, after epoch 1
    metrics = (run / "metrics.jsonl").read_text()
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["best_heldout", "epoch_000001"]
    stop = _state(run / "checkpoints" / "epoch_000001")["guard"]["stop"]
    assert stop["epochs_done"] == 1 and stop["reason"].startswith("the trained reward rose +")

    code, out = run_cli("train", *settings, "resume=auto")
    assert code == 0, out
    assert (run / "metrics.jsonl").read_text() == metrics  # no further epoch
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints
    said = "guard: the reward-hacking guard stopped this run after epoch 1: the trained reward rose +"
    console = " ".join(out.split())  # the console wraps its lines
    assert said in console and said in (run / "run.log").read_text()
    assert "trains no further epoch" in console and "start a new run" in console
