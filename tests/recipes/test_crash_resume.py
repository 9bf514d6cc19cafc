"""kill -9 in the middle of a run, or a damaged newest checkpoint, then resume=auto: the final weights
equal an uninterrupted run's."""

from __future__ import annotations

import errno
import importlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

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
        ),
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


# -- a checkpoint without a manifest is never resumed by accident -------------------------------------
def _strip_manifest_and_flip_a_weight_byte(ckpt: Path) -> Path:
    """The manifest deleted and one byte of the weights flipped: the damage nothing else can see."""
    (ckpt / "manifest.json").unlink()
    weights = ckpt / "weights" / LORA_WEIGHTS_NAME
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return weights


@pytest.mark.slow  # three tiny runs: ~50 s on two cores
def test_a_newest_checkpoint_without_a_manifest_is_skipped_and_the_run_ends_as_uninterrupted(tmp_path: Path):
    """``resume=auto`` skips it, naming it in run.log, and resumes from the checkpoint before it, so the
    final weights equal an uninterrupted run's; ``resume=`` its path exits 2 naming resume_unverified."""
    from tests.conftest import run_cli

    straight, damaged = tmp_path / "straight", tmp_path / "damaged"
    code, out = run_cli("train", *THREE_EPOCHS, f"hydra.run.dir={straight}")
    assert code == 0, out
    for epoch in (1, 2):
        name = f"checkpoints/epoch_{epoch:06d}"
        shutil.copytree(straight / name, damaged / name)
    shutil.copy(straight / "metrics.jsonl", damaged / "metrics.jsonl")
    newest = damaged / "checkpoints" / "epoch_000002"
    _strip_manifest_and_flip_a_weight_byte(newest)

    code, out = run_cli("train", *THREE_EPOCHS, f"resume={newest}", f"hydra.run.dir={damaged}")
    assert code == 2 and f"{newest} has no manifest.json" in out and "resume_unverified=true" in out, out
    code, out = run_cli("train", *THREE_EPOCHS, "resume=auto", f"hydra.run.dir={damaged}")
    assert code == 0, out
    log = (damaged / "run.log").read_text()
    assert f"skips a damaged checkpoint: {newest} has no manifest.json" in log
    assert "epoch_000001 at epoch 1" in log
    a, b = _final_of(straight, 3), _final_of(damaged, 3)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)


def test_resume_to_a_checkpoint_without_a_manifest_needs_resume_unverified(tmp_path: Path, monkeypatch):
    """Refused before any model is built; with resume_unverified=true the prerequisite passes."""
    from rlgen_cli.tasks import prerequisites, train
    from rlgen_cli.training.checkpoints.checkpoint import save_checkpoint
    from tests.conftest import run_cli

    ckpt = save_checkpoint(tmp_path / "old", 1, _lora_writer, {}, OmegaConf.create({}), keep_last=1).path
    _strip_manifest_and_flip_a_weight_byte(ckpt)
    code, out = run_cli("train", *THREE_EPOCHS, f"resume={ckpt}", f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2 and "Traceback" not in out, out
    assert f"resume={ckpt}: {ckpt} has no manifest.json" in out and "add resume_unverified=true" in out, out

    checked = []
    monkeypatch.setattr(train, "require_prerequisites", lambda cfg, run_dir: checked.append(cfg))
    monkeypatch.setattr(importlib.import_module("rlgen_cli.recipes.flow_grpo"), "run", lambda cfg, raw: {})
    code, out = run_cli(
        "train",
        *THREE_EPOCHS,
        f"resume={ckpt}",
        "resume_unverified=true",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert code == 0, out
    assert prerequisites.resume_problems(checked[0]) == []


def _lora_writer(directory: Path) -> None:
    directory.mkdir(parents=True)
    save_file({"w": torch.ones(4)}, directory / LORA_WEIGHTS_NAME)


# -- a full disk, and what a killed save left behind --------------------------------------------------
def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "resolved.yaml")


def test_a_full_disk_saving_the_config_is_one_line_naming_the_last_good_checkpoint(tmp_path, monkeypatch):
    """The run directory's config cannot be written: exit 2, one line, no traceback, and the line says
    which checkpoint a resume continues from."""
    from rlgen_cli.training.checkpoints.checkpoint import save_checkpoint
    from rlgen_cli.training.reporting import run_dir as run
    from tests.conftest import run_cli

    good = save_checkpoint(tmp_path, 1, _lora_writer, {}, OmegaConf.create({}), keep_last=1).path
    monkeypatch.setattr(run, "_write_atomic", _disk_full)
    code, out = run_cli("train", *THREE_EPOCHS, "resume=auto", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "Traceback" not in out, out
    line = out.strip().splitlines()[-1]
    assert line == (
        f"error: the disk is full writing resolved.yaml; the last good checkpoint is {good} "
        "(resume=auto continues from it); free space and run it again"
    ), out


def test_a_full_disk_mid_run_stops_with_one_line_and_a_stale_temporary_is_swept(tmp_path, monkeypatch):
    """A checkpoint save after epoch 2 hits a full disk: exit 2 naming epoch_000001 as the last good
    checkpoint, no temporary folder left; the one a killed process left before the run started is gone
    too, while a live process's stays."""
    from rlgen_cli.training.checkpoints import checkpoint
    from tests.conftest import run_cli

    run_dir, host = tmp_path / "run", platform.node()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = run_dir / "checkpoints" / f".epoch_000009.tmp-{host}-{dead.pid}"
    live = run_dir / "checkpoints" / f".epoch_000008.tmp-{host}-{os.getppid()}"  # pytest's parent: alive
    for folder in (stale, live):
        (folder / "weights").mkdir(parents=True)
    readme, calls = checkpoint.write_checkpoint_readme, []

    def fills_the_disk_at_the_second_save(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        readme(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "write_checkpoint_readme", fills_the_disk_at_the_second_save)
    code, out = run_cli("train", *THREE_EPOCHS, f"hydra.run.dir={run_dir}")
    assert code == 2 and "Traceback" not in out, out
    last_good, failed = run_dir / "checkpoints" / "epoch_000001", run_dir / "checkpoints" / "epoch_000002"
    assert (
        f"error: the disk is full writing {failed}; the last good checkpoint is {last_good} "
        "(resume=auto continues from it); free space and run it again"
    ) in out, out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [live.name, "epoch_000001"]
