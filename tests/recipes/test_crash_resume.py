"""kill -9 in the middle of a run, or a damaged newest checkpoint, then resume=auto: the final weights
equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import shutil
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
        pytest.param([], id="one-process", marks=pytest.mark.slow),  # ~31 s; test_flow_grpo_cli resumes
        pytest.param(
            [
                "launcher=accelerate",
                "launcher.num_processes=2",
                "algo.sample_batch_size=2",
                "algo.train_batch_size=2",
            ],
            id="two-processes",
            marks=pytest.mark.slow,
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


# -- a damaged newest checkpoint: resume=auto falls back to the one before it -------------------------
THREE_EPOCHS = [*TINY_RUN, "epochs=3", "save_every=1", "keep_last=5", "eval_every=0", "images_every=0",
                "algo.lr=1e-2"]  # fmt: skip
UNTIMED = ("time/", "peak_memory_mb")  # differ between any two runs


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(UNTIMED)} for row in rows]


@pytest.mark.slow  # three tiny runs: ~50 s on two cores
def test_truncated_newest_weights_resume_from_the_checkpoint_before(tmp_path: Path):
    """The newest checkpoint's weights cut in half (a full disk): ``resume=auto`` warns naming the file,
    resumes from the checkpoint before it and ends where an uninterrupted run ends, with every epoch in
    metrics.jsonl once; ``resume=`` that checkpoint's path exits 2 naming the file."""
    from tests.conftest import run_cli

    straight, damaged = tmp_path / "straight", tmp_path / "damaged"
    code, out = run_cli("train", *THREE_EPOCHS, f"hydra.run.dir={straight}")
    assert code == 0, out
    for epoch in (1, 2):  # where a run killed during its third epoch stands, its log already past epoch 2
        name = f"checkpoints/epoch_{epoch:06d}"
        shutil.copytree(straight / name, damaged / name)
    shutil.copy(straight / "metrics.jsonl", damaged / "metrics.jsonl")
    weights = damaged / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    code, out = run_cli("train", *THREE_EPOCHS, f"resume={weights.parent.parent}", f"hydra.run.dir={damaged}")
    assert code == 2 and f"{weights} is truncated" in out, out
    code, out = run_cli("train", *THREE_EPOCHS, "resume=auto", f"hydra.run.dir={damaged}")
    assert code == 0, out
    log = (damaged / "run.log").read_text()
    assert f"{weights} is truncated" in log and "resumed from" in log and "epoch_000001 at epoch 1" in log
    a, b = _final_of(straight, 3), _final_of(damaged, 3)
    assert a.keys() == b.keys()
    assert max((a[k] - _final_of(straight, 1)[k]).abs().max().item() for k in a) > 1e-4  # epochs 2–3 trained
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
    expected, got = _rows(straight), _rows(damaged)
    assert [r["step"] for r in got] == [1, 2, 3]
    for one, two in zip(expected, got, strict=True):
        assert one.keys() == two.keys()
        for key, value in one.items():
            assert two[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def _final_of(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"epoch_{epoch:06d}" / "weights" / LORA_WEIGHTS_NAME)
