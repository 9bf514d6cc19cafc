"""kill -9 in the middle of a run, resume=auto, and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from tests.conftest import TINY_RUN

RUN = [*TINY_RUN, "epochs=4", "save_every=1", "keep_last=5", "eval_every=0", "images_every=0", "algo.lr=1e-2"]


def _train(run: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rlgen_cli.cli", "train", *RUN, *extra, f"hydra.run.dir={run}"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "epoch_000004" / "weights" / LORA_WEIGHTS_NAME)


def test_kill_9_then_resume_equals_uninterrupted(tmp_path: Path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    victim = _train(crashed)
    deadline = time.monotonic() + 240
    while not (crashed / "checkpoints" / "epoch_000002").is_dir():
        assert victim.poll() is None, victim.stderr.read()
        assert time.monotonic() < deadline, "no second checkpoint within 240 s"
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)  # mid-run: epoch 3 is sampling or updating
    victim.wait()
    assert not (crashed / "checkpoints" / "epoch_000004").exists()

    resumed = _train(crashed, "resume=auto")
    uninterrupted = _train(straight)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read()
    a, b = _final(straight), _final(crashed)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
