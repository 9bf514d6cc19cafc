"""Checkpoints: atomic writes, rotation, validation of incomplete directories, resume resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlgen_cli.schema.errors import UserError
from rlgen_cli.training.checkpoint import (
    ENGINE_FILES_KEY,
    Checkpoint,
    engine_staging,
    list_checkpoints,
    open_checkpoint,
    resolve_resume,
    save_checkpoint,
)


class _FakePolicy:
    def __init__(self, value: float) -> None:
        self.value = value

    def save_trainable(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        torch.save(torch.tensor(self.value), directory / "w.pt")


def _save(run_dir: Path, epoch: int, keep_last: int = 2):
    return save_checkpoint(run_dir, epoch, _FakePolicy(epoch), {"counters": {"epoch": epoch}},
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

    class _Crashing(_FakePolicy):
        def save_trainable(self, directory: Path) -> None:
            directory.mkdir(parents=True)
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, 2, _Crashing(2), {}, OmegaConf.create({}), keep_last=3)
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
    with pytest.raises(UserError, match="unreadable"):
        resolve_resume(str(newest.path), tmp_path)


def _save_with_engine(run_dir: Path, epoch: int) -> Checkpoint:
    """A checkpoint whose optimizer lives in per-rank engine shards (as DeepSpeed ZeRO writes them)."""
    staging = engine_staging(run_dir, epoch)
    (staging / "zero").mkdir(parents=True)
    for rank in (0, 1):
        torch.save({"rank": rank}, staging / "zero" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return save_checkpoint(run_dir, epoch, _FakePolicy(epoch), {"counters": {"epoch": epoch}},
                           OmegaConf.create({}), keep_last=3, engine_state=staging)  # fmt: skip


def test_engine_shards_move_into_the_checkpoint_with_their_sizes(tmp_path: Path):
    ckpt = _save_with_engine(tmp_path, 1)
    shard = ckpt.engine / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert shard.is_file() and not engine_staging(tmp_path, 1).exists()
    assert (
        ckpt.state()[ENGINE_FILES_KEY]["zero/zero_pp_rank_1_mp_rank_00_optim_states.pt"]
        == shard.stat().st_size
    )
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
    with pytest.raises(UserError, match="missing" if damage == "delete" else r"truncated \(10 of"):
        resolve_resume(str(newest.path), tmp_path)
