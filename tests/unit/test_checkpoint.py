"""Checkpoints: atomic writes, rotation, validation of incomplete or damaged directories, resume resolution."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from rlgen_cli.schema.errors import UserError
from rlgen_cli.training.checkpoint import (
    MANIFEST_FILE,
    Checkpoint,
    engine_staging,
    file_sha256,
    list_checkpoints,
    open_checkpoint,
    resolve_resume,
    save_checkpoint,
)

WEIGHTS = "weights/w.safetensors"


def _weight_writer(value: float) -> Callable[[Path], None]:
    """Writes trained weights as one safetensors file, as a LoRA policy's ``trainable.save`` does."""

    def write(directory: Path) -> None:
        directory.mkdir(parents=True)
        save_file({"w": torch.full((64,), float(value))}, directory / "w.safetensors")

    return write


def _save(run_dir: Path, epoch: int, keep_last: int = 2):
    return save_checkpoint(run_dir, epoch, _weight_writer(epoch), {"counters": {"epoch": epoch}},
                           OmegaConf.create({"seed": 1}), keep_last)  # fmt: skip


def test_save_rotates_and_keeps_the_newest(tmp_path: Path):
    for epoch in (1, 2, 3):
        _save(tmp_path, epoch)
    names = [c.path.name for c in list_checkpoints(tmp_path)]
    assert names == ["epoch_000002", "epoch_000003"]
    latest = open_checkpoint(tmp_path / "checkpoints" / "epoch_000003")
    assert latest.state()["counters"]["epoch"] == 3 and "rng" in latest.state()
    assert latest.config().seed == 1


def test_a_crash_mid_save_leaves_the_last_good_checkpoint(tmp_path: Path):
    _save(tmp_path, 1)

    def crash(directory: Path) -> None:
        directory.mkdir(parents=True)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 2, crash, {}, OmegaConf.create({}), keep_last=3)
    assert [c.path.name for c in list_checkpoints(tmp_path)] == ["epoch_000001"]
    assert resolve_resume("auto", tmp_path).path.name == "epoch_000001"


def test_incomplete_or_corrupt_checkpoints_are_user_errors(tmp_path: Path):
    ckpt = _save(tmp_path, 1)
    (ckpt.path / "trainer_state.pt").write_bytes(b"not a torch file")
    with pytest.raises(UserError, match="unreadable"):
        ckpt.state()
    (ckpt.path / "config.yaml").unlink()
    with pytest.raises(UserError, match="missing config.yaml"):
        open_checkpoint(ckpt.path)


def test_resume_resolution(tmp_path: Path):
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # nothing yet: a fresh start
    _save(tmp_path, 4)
    assert resolve_resume("auto", tmp_path).path.name == "epoch_000004"
    with pytest.raises(UserError, match="not a complete rlgen checkpoint"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_auto_resume_skips_a_truncated_newest_checkpoint(tmp_path: Path):
    _save(tmp_path, 1, keep_last=3)
    newest = _save(tmp_path, 2, keep_last=3)
    state = newest.path / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a disk that filled up mid-write
    assert resolve_resume("auto", tmp_path).path.name == "epoch_000001"
    with pytest.raises(UserError, match=r"trainer_state.pt is truncated \(\d+ of"):
        resolve_resume(str(newest.path), tmp_path)


def _save_with_engine(run_dir: Path, epoch: int) -> Checkpoint:
    """A checkpoint whose optimizer lives in per-rank engine shards (as DeepSpeed ZeRO writes them)."""
    staging = engine_staging(run_dir, epoch)
    (staging / "zero").mkdir(parents=True)
    for rank in (0, 1):
        torch.save({"rank": rank}, staging / "zero" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return save_checkpoint(run_dir, epoch, _weight_writer(epoch), {"counters": {"epoch": epoch}},
                           OmegaConf.create({}), keep_last=3, engine_state=staging)  # fmt: skip


def test_engine_shards_move_into_the_checkpoint_and_its_manifest(tmp_path: Path):
    ckpt = _save_with_engine(tmp_path, 1)
    shard = ckpt.engine / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert shard.is_file() and not engine_staging(tmp_path, 1).exists()
    assert ckpt.manifest()["engine/zero/zero_pp_rank_1_mp_rank_00_optim_states.pt"] == {
        "bytes": shard.stat().st_size, "sha256": hashlib.sha256(shard.read_bytes()).hexdigest()
    }  # fmt: skip
    assert resolve_resume("auto", tmp_path).path == ckpt.path


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_auto_resume_skips_a_checkpoint_with_a_damaged_engine_shard(tmp_path: Path, damage: str):
    _save_with_engine(tmp_path, 1)
    newest = _save_with_engine(tmp_path, 2)
    shard = newest.engine / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:10])
    else:
        shard.unlink()
    assert resolve_resume("auto", tmp_path).path.name == "epoch_000001"
    with pytest.raises(UserError, match="is missing" if damage == "delete" else r"is truncated \(10 of"):
        resolve_resume(str(newest.path), tmp_path)


# -- the manifest: every file's size and SHA-256, checked before resuming -----------------------------
def test_the_manifest_records_every_file_with_its_size_and_sha256(tmp_path: Path):
    ckpt = _save(tmp_path, 1)
    recorded = json.loads((ckpt.path / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(p.relative_to(ckpt.path).as_posix() for p in ckpt.path.rglob("*") if p.is_file())
    expected = ["README.txt", "config.yaml", "trainer_state.pt", WEIGHTS]
    assert sorted(recorded) == sorted(set(on_disk) - {MANIFEST_FILE}) == expected
    for name, entry in recorded.items():
        data = (ckpt.path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_file_sha256_reads_past_its_buffer(tmp_path: Path):
    data = bytes(range(256)) * 12289  # 3 MiB + 256 B: several 1 MiB blocks and a partial one
    (tmp_path / "f").write_bytes(data)
    assert file_sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(path: Path) -> None:  # same size: only the hash can tell
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated weights": (WEIGHTS, _truncate, "is truncated"),
    "truncated config": ("config.yaml", _truncate, "is truncated"),
    "deleted weights": (WEIGHTS, Path.unlink, "is missing"),
    "flipped byte in weights": (WEIGHTS, _flip_last_byte, "is corrupted"),
    "truncated manifest": (MANIFEST_FILE, _truncate, "is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_auto_resume_falls_back_past_a_damaged_file_and_names_it(tmp_path: Path, caplog, damage: str):
    name, spoil, what = DAMAGES[damage]
    _save(tmp_path, 1, keep_last=3)
    newest = _save(tmp_path, 2, keep_last=3)
    spoil(newest.path / name)
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.training.checkpoint"):
        assert resolve_resume("auto", tmp_path).path.name == "epoch_000001"
    assert f"{newest.path / name} {what}" in caplog.text
    with pytest.raises(UserError, match=f"{newest.path / name} {what}"):
        resolve_resume(str(newest.path), tmp_path)


def test_sampling_from_a_checkpoint_checks_sizes(tmp_path: Path):
    ckpt = _save(tmp_path, 1)
    _truncate(ckpt.path / WEIGHTS)
    with pytest.raises(UserError, match="is truncated"):
        open_checkpoint(ckpt.path)


def test_auto_resume_refuses_when_every_checkpoint_is_damaged(tmp_path: Path):
    only = _save(tmp_path, 1)
    _truncate(only.path / WEIGHTS)
    with pytest.raises(UserError, match="no intact checkpoint.*is truncated"):
        resolve_resume("auto", tmp_path)


def test_a_checkpoint_without_a_manifest_resumes_with_a_warning(tmp_path: Path, caplog):
    ckpt = _save(tmp_path, 1)
    (ckpt.path / MANIFEST_FILE).unlink()  # as written before checkpoints carried one
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.training.checkpoint"):
        assert resolve_resume("auto", tmp_path).path == ckpt.path
    assert "not verified" in caplog.text


# -- metrics.jsonl after a resume ------------------------------------------------------------------------
def test_a_resumed_run_logs_each_step_once(tmp_path: Path):
    from rlgen_cli.training.metrics import JsonlLogger, read_metrics

    first = JsonlLogger(tmp_path)
    for step in (0, 1, 2, 3):  # the evaluation before training, then epochs 1–3
        first.log({"x": step}, step)
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "x"')  # killed mid-write
    resumed = JsonlLogger(tmp_path)  # from the checkpoint after epoch 1: epochs 2 and 3 are redone
    resumed.log({"x": 20}, 2)
    resumed.log({"x": 30}, 3)
    resumed.close()
    assert read_metrics(tmp_path) == [
        {"step": 0, "x": 0}, {"step": 1, "x": 1}, {"step": 2, "x": 20}, {"step": 3, "x": 30}
    ]  # fmt: skip
    assert not list(tmp_path.glob(".metrics.jsonl.tmp-*"))
