"""kill -9 in the middle of a run, resume=auto, and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from tests.conftest import TINY_RUN

RUN = [*TINY_RUN, "epochs=4", "save_every=1", "keep_last=5", "eval_every=0", "images_every=0", "algo.lr=1e-2"]


def _train(run: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rlgen_cli.cli", "train", *RUN, *extra, f"hydra.run.dir={run}"]
    # its own session, so a kill reaches the launcher's worker processes too
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "epoch_000004" / "weights" / LORA_WEIGHTS_NAME)


@pytest.mark.parametrize(
    "launch",
    [
        pytest.param([], id="one-process"),
        pytest.param(
            [
                "launcher=accelerate",
                "launcher.num_processes=2",
                "algo.sample_batch_size=2",
                "algo.train_batch_size=2",
            ],
            id="two-processes",
        ),  # fmt: skip
        pytest.param(  # the optimizer state is ZeRO's per-rank shards, in the checkpoint's engine/
            [
                "launcher=deepspeed_zero2",
                "launcher.num_processes=2",
                "algo.sample_batch_size=2",
                "algo.train_batch_size=2",
            ],
            id="deepspeed-zero2",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_kill_9_then_resume_equals_uninterrupted(tmp_path: Path, launch: list[str]):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    victim = _train(crashed, *launch)
    deadline = time.monotonic() + 240
    while not (crashed / "checkpoints" / "epoch_000002").is_dir():
        assert victim.poll() is None, victim.stderr.read()
        assert time.monotonic() < deadline, "no second checkpoint within 240 s"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # mid-run: epoch 3 is sampling or updating, in every process
    victim.wait()
    assert not (crashed / "checkpoints" / "epoch_000004").exists()

    resumed = _train(crashed, *launch, "resume=auto")
    uninterrupted = _train(straight, *launch)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert uninterrupted.wait(timeout=300) == 0, uninterrupted.stderr.read()
    a, b = _final(straight), _final(crashed)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
