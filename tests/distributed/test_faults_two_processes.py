"""A full disk and a NaN reward on a two-process run (accelerate, gloo on the CPU) stop it as on one
process: exit code 2 and one ``error:`` line naming the last good checkpoint, no traceback from any rank or
from the launcher, no hang; no half-written checkpoint is left, and ``resume=auto`` continues from the last
good one to the end.

The faults are injected into the launched processes by ``fault_plugin/sitecustomize.py`` (first on
``PYTHONPATH``, switched on by ``RLGEN_TEST_FAULT``): ENOSPC at a process's second checkpoint save, or a
reward that turns NaN at epoch 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlgen_cli.training.checkpoints.checkpoint import (
    CHECKPOINTS_DIR,
    COUNTERS_KEY,
    list_checkpoints,
    open_checkpoint,
)
from tests.conftest import TINY_RUN

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).resolve().parent / "fault_plugin"
TWO = [
    "launcher=accelerate",
    "launcher.num_processes=2",
    "algo.sample_batch_size=2",
    "algo.train_batch_size=2",
]
RUN = [*TINY_RUN, *TWO, "save_every=1", "keep_last=5", "eval_every=0", "images_every=0"]
NAN = ["+reward.weights.nan_from_call=1.0", "+reward.kwargs.nan_from_call={from_call: 1}"]  # NaN from epoch 2


def _train(run: Path, fault: str, *extra: str, epochs: int = 3) -> tuple[int, str]:
    """``rlgen train`` as a user starts it, in a subprocess with ``fault`` injected; (exit code, output)."""
    env = {**os.environ, "RLGEN_TEST_FAULT": fault, "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(ROOT)])}
    argv = [
        sys.executable,
        "-m",
        "rlgen_cli.cli",
        "train",
        *RUN,
        f"epochs={epochs}",
        *extra,
        f"hydra.run.dir={run}",
    ]
    done = subprocess.run(
        argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )  # a hang fails
    return done.returncode, done.stdout + done.stderr


def _assert_stopped_after_epoch_1(run: Path, code: int, out: str, reason: str) -> None:
    last_good = run / CHECKPOINTS_DIR / "epoch_000001"
    assert code == 2, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    (line,) = [line for line in out.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {reason}"), out
    assert f"the last good checkpoint is {last_good} (resume=auto continues from it)" in line, out
    # the manifest rule: nothing but the complete epoch 1 (no epoch_000002, no temporary folder)
    assert sorted(p.name for p in (run / CHECKPOINTS_DIR).iterdir()) == ["epoch_000001"]
    assert open_checkpoint(last_good, require_manifest=True).state()[COUNTERS_KEY]["epoch"] == 1


def _assert_resumes_to_the_end(run: Path, fault: str = "", *extra: str) -> None:
    code, out = _train(run, fault, *extra, "resume=auto")
    assert code == 0, out
    assert (
        f"resumed from {run / CHECKPOINTS_DIR / 'epoch_000001'} at epoch 1" in (run / "run.log").read_text()
    )
    assert [c.path.name for c in list_checkpoints(run)] == [f"epoch_{e:06d}" for e in (1, 2, 3)]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [2, 3], steps


@pytest.mark.slow  # two launched two-process runs: ~80 s on two busy cores
def test_a_full_disk_on_rank_0_stops_both_ranks_with_one_line_and_resume_continues(tmp_path: Path):
    run = tmp_path / "run"
    code, out = _train(run, "enospc:2")  # rank 0 saves: its second save (epoch 2) meets a full disk
    failed = run / CHECKPOINTS_DIR / "epoch_000002"
    _assert_stopped_after_epoch_1(run, code, out, f"the disk is full writing {failed}; ")
    _assert_resumes_to_the_end(run)  # the disk freed


@pytest.mark.slow  # two launched two-process runs: ~80 s on two busy cores
def test_a_nan_reward_on_both_ranks_stops_the_run_with_one_line_and_resume_continues(tmp_path: Path):
    run = tmp_path / "run"
    code, out = _train(run, "nan", *NAN)
    _assert_stopped_after_epoch_1(
        run, code, out, "non-finite rewards {'nan_from_call': '2 NaN, 0 inf'} in a scored batch of 2 samples"
    )
    fixed = (
        "+reward.kwargs.nan_from_call={from_call: 99}",
        "resume_changes=[reward.kwargs.nan_from_call.from_call]",
    )
    _assert_resumes_to_the_end(run, "nan", *NAN[:1], *fixed)  # the reward fixed, the change named
