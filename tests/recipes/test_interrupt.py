"""Ctrl-C during ``rlgen train``: exit code 130, one line saying in which epoch the run stopped, from
which checkpoint it resumes and the command that does, and the reward curve drawn all the same. The
run is a real ``rlgen train`` process sent SIGINT mid-training; the printed command then resumes it."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import TINY_RUN, run_cli

LINE = re.compile(
    r"^interrupted in epoch (\d+) \((\d+) completed\); to resume from checkpoints/(\S+) run: (.+)$"
)
STARTUP_S = 300  # a loaded CI machine: imports, the tiny model, the first epoch and its checkpoint


def _rlgen() -> list[str]:
    """The ``rlgen`` console script of this environment (``python -m rlgen_cli.cli`` without one)."""
    script = Path(sys.executable).with_name("rlgen")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "rlgen_cli.cli"]


def _default_sigint() -> None:
    """A child of a shell's background job inherits SIGINT ignored; Ctrl-C must reach it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def _interrupt_once(ready: Callable[[], bool], args: list[str]) -> tuple[int, str]:
    """Start ``rlgen train ARGS``, send SIGINT once ``ready()``; returns its exit code and output."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*_rlgen(), "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + STARTUP_S
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    running = proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert running, f"the run ended before it was interrupted (exit {proc.returncode}):\n{out}"
    return proc.returncode, out


def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume_and_draws_the_curve(tmp_path: Path):
    run = tmp_path / "run"
    args = [*TINY_RUN, "epochs=1000", "eval_every=1", "save_every=1", f"hydra.run.dir={run}"]
    code, out = _interrupt_once(lambda: (run / "checkpoints" / "epoch_000001").is_dir(), args)
    assert code == 130, out
    lines = [line for line in out.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1, out
    match = LINE.match(lines[0])
    assert match, lines[0]
    steps = _steps(run)
    completed = int(match[2])
    assert int(match[1]) == completed + 1 and steps == list(range(1, completed + 1))  # one row an epoch
    newest = sorted(p.name for p in (run / "checkpoints").glob("epoch_*"))[-1]
    assert match[3] == newest and completed >= 1
    assert lines[0] in (run / "run.log").read_text()
    assert (run / "reward_curve.png").stat().st_size > 0  # drawn at the interrupt: the run never finished

    command = shlex.split(match[4])
    assert command[:2] == ["rlgen", "train"] and command[-2:] == ["resume=auto", f"hydra.run.dir={run}"]
    assert command[2:-2] == args[:-1]  # the run's own overrides
    resumed_to = int(newest.removeprefix("epoch_")) + 1
    code, out = run_cli(*command[1:], f"epochs={resumed_to}")  # the printed command, one epoch more
    assert code == 0, out
    assert _steps(run) == list(range(1, resumed_to + 1))  # the redone epochs logged once
