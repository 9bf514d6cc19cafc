"""Ctrl-C on a two-process run (accelerate, gloo on the CPU), as a terminal sends it: SIGINT to the whole
process group of ``rlgen train``. The controller returns exit code 130 once its workers are done, and the
output holds one line saying where the run stopped and how to resume, no traceback from any rank or from
the launcher; the final reward curve is drawn."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlgen_cli.recipes.common import REWARD_CURVE
from rlgen_cli.training.checkpoints.checkpoint import CHECKPOINTS_DIR, list_checkpoints
from tests.conftest import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
TWO = [
    "launcher=accelerate",
    "launcher.num_processes=2",
    "algo.sample_batch_size=2",
    "algo.train_batch_size=2",
]
RUN = [*TINY_RUN, *TWO, "epochs=50", "save_every=1", "eval_every=0", "images_every=0"]
_INTERRUPTED = re.compile(
    rf"^interrupted in epoch (\d+) \((\d+) completed\); to resume from {CHECKPOINTS_DIR}/(epoch_\d+) run: (.+)$"
)


@pytest.mark.slow  # one launched two-process run, interrupted after its first checkpoint: ~50 s on two busy cores
def test_ctrl_c_stops_both_ranks_with_one_line_and_draws_the_curve(tmp_path: Path):
    run, log = tmp_path / "run", tmp_path / "output.txt"
    argv = [sys.executable, "-m", "rlgen_cli.cli", "train", *RUN, f"hydra.run.dir={run}"]
    with log.open("w") as out:  # a session of its own: the process group a terminal's Ctrl-C reaches
        rlgen = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (run / CHECKPOINTS_DIR / "epoch_000001").is_dir():
        assert rlgen.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "no first checkpoint within 240 s"
        time.sleep(0.05)
    os.killpg(rlgen.pid, signal.SIGINT)
    try:
        code = rlgen.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(rlgen.pid, signal.SIGKILL)
        raise AssertionError(f"still running 120 s after Ctrl-C:\n{log.read_text()}") from None
    text = log.read_text()  # as the terminal shows it when rlgen has returned
    assert code == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    (line,) = [line for line in text.splitlines() if "interrupted in epoch" in line]
    where = _INTERRUPTED.match(line)
    assert where is not None, line
    epoch, completed, named, resume = int(where[1]), int(where[2]), where[3], where[4]
    newest = list_checkpoints(run)[-1].path.name  # epoch 1's, or a later one saved before the signal came
    assert epoch == completed + 1 and named == newest, line
    # an epoch whose metrics row is written counts as completed, its checkpoint may not be saved yet
    assert completed - int(newest.removeprefix("epoch_")) in (0, 1), line
    assert shlex.split(resume)[-2:] == ["resume=auto", f"hydra.run.dir={run}"], line
    assert (run / REWARD_CURVE).stat().st_size > 0  # drawn on the way out: a run draws it only when it ends
