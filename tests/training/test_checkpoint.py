"""Checkpoints: atomic writes, rotation, validation of incomplete or damaged directories, resume resolution."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from rlgen_cli.errors import UserError
from rlgen_cli.training.checkpoints.checkpoint import (
    MANIFEST_FILE,
    Checkpoint,
    NonFiniteRewards,
    engine_staging,
    file_sha256,
    list_checkpoints,
    open_checkpoint,
    resolve_resume,
    save_checkpoint,
    stop_cleanly,
    sweep_stale_temporaries,
)

WEIGHTS = "weights/w.safetensors"


def _weight_writer(value: float) -> Callable[[Path], None]:
    """Writes trained weights as one safetensors file, as a LoRA policy's ``trainable.save`` does."""

    def write(directory: Path) -> None:
        directory.mkdir(parents=True)
        save_file({"w": torch.full((64,), float(value))}, directory / "w.safetensors")

    return write


def _save(run_dir: Path, epoch: int, keep_last: int = 2):
    return save_checkpoint(
        run_dir,
        epoch,
        _weight_writer(epoch),
        {"counters": {"epoch": epoch}},
        OmegaConf.create({"seed": 1}),
        keep_last,
    )


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
    return save_checkpoint(
        run_dir,
        epoch,
        _weight_writer(epoch),
        {"counters": {"epoch": epoch}},
        OmegaConf.create({}),
        keep_last=3,
        engine_state=staging,
    )


def test_engine_shards_move_into_the_checkpoint_and_its_manifest(tmp_path: Path):
    ckpt = _save_with_engine(tmp_path, 1)
    shard = ckpt.engine / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert shard.is_file() and not engine_staging(tmp_path, 1).exists()
    assert ckpt.manifest()["engine/zero/zero_pp_rank_1_mp_rank_00_optim_states.pt"] == {
        "bytes": shard.stat().st_size,
        "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
    }
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
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.training.checkpoints.checkpoint"):
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


def _without_manifest(ckpt: Checkpoint) -> None:
    """A manifest deleted, and a byte of the weights flipped: nothing can tell the damage any more."""
    (ckpt.path / MANIFEST_FILE).unlink()
    _flip_last_byte(ckpt.path / WEIGHTS)


def test_auto_resume_skips_a_checkpoint_without_a_manifest_and_names_it(tmp_path: Path, caplog):
    _save(tmp_path, 1, keep_last=3)
    newest = _save(tmp_path, 2, keep_last=3)
    _without_manifest(newest)
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.training.checkpoints.checkpoint"):
        assert resolve_resume("auto", tmp_path).path.name == "epoch_000001"
    assert f"skips a damaged checkpoint: {newest.path} has no {MANIFEST_FILE}" in caplog.text


def test_auto_resume_refuses_when_the_only_checkpoint_has_no_manifest(tmp_path: Path):
    _without_manifest(_save(tmp_path, 1))
    with pytest.raises(
        UserError, match=f"no intact checkpoint.*has no {MANIFEST_FILE}.*resume_unverified=true"
    ):
        resolve_resume("auto", tmp_path)


def test_an_explicit_checkpoint_without_a_manifest_needs_resume_unverified(tmp_path: Path, caplog):
    ckpt = _save(tmp_path, 1)
    _without_manifest(ckpt)
    with pytest.raises(UserError, match=f"{ckpt.path} has no {MANIFEST_FILE}.*add resume_unverified=true"):
        resolve_resume(str(ckpt.path), tmp_path)
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.training.checkpoints.checkpoint"):
        assert resolve_resume(str(ckpt.path), tmp_path, unverified=True).path == ckpt.path
    assert f"{ckpt.path} has no {MANIFEST_FILE}: its files are not verified" in caplog.text
    assert resolve_resume("auto", tmp_path, unverified=True).path == ckpt.path  # opted in for auto too


def test_the_resume_prerequisite_refuses_a_checkpoint_without_a_manifest(tmp_path: Path):
    from types import SimpleNamespace

    from rlgen_cli.tasks.prerequisites import resume_problems

    ckpt = _save(tmp_path, 1)
    assert resume_problems(SimpleNamespace(resume=str(ckpt.path), resume_unverified=False)) == []
    _without_manifest(ckpt)
    (problem,) = resume_problems(SimpleNamespace(resume=str(ckpt.path), resume_unverified=False))
    assert problem.startswith(f"resume={ckpt.path}: {ckpt.path} has no {MANIFEST_FILE}")
    assert resume_problems(SimpleNamespace(resume=str(ckpt.path), resume_unverified=True)) == []


# -- durability: fsync before and after the rename, and the temporaries a killed save leaves ----------
def test_every_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path: Path, monkeypatch):
    import rlgen_cli.training.checkpoints.checkpoint as module

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst) -> None:
        events.append(("rename", str(src)))
        replace(src, dst)

    monkeypatch.setattr(module.os, "fsync", recording_fsync)
    monkeypatch.setattr(module.os, "replace", recording_replace)
    ckpt = _save(tmp_path, 1)
    (rename,) = [i for i, (what, _) in enumerate(events) if what == "rename"]
    tmp = Path(events[rename][1])
    synced_before = {Path(path).relative_to(tmp).as_posix() for _, path in events[:rename]}
    on_disk = {p.relative_to(ckpt.path).as_posix() for p in ckpt.path.rglob("*")}
    assert synced_before == on_disk | {"."}  # every file and folder, and the folder itself
    assert events[rename + 1 :] == [("fsync", str(tmp_path / "checkpoints"))]  # the rename, made durable


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_startup_sweep_removes_only_temporaries_of_dead_processes(tmp_path: Path):
    _save(tmp_path, 1)
    root, host = tmp_path / "checkpoints", platform.node()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_pid = _dead_pid()
        folders = {
            "dead": root / f".epoch_000002.tmp-{host}-{dead_pid}",
            "dead, older name": root / f".epoch_000003.tmp-{dead_pid}",
            "alive": root / f".epoch_000004.tmp-{host}-{alive.pid}",
            "this process": root / f".epoch_000005.tmp-{host}-{os.getpid()}",
            "another host": root / f".epoch_000006.tmp-elsewhere.example-{dead_pid}",
            "engine staging": engine_staging(tmp_path, 7),
        }
        for folder in folders.values():
            (folder / "weights").mkdir(parents=True)
        removed = sweep_stale_temporaries(tmp_path)
        assert sorted(removed) == sorted([folders["dead"], folders["dead, older name"]])
        assert {name for name, folder in folders.items() if folder.exists()} == {
            "alive",
            "this process",
            "another host",
            "engine staging",
        }
        assert [c.path.name for c in list_checkpoints(tmp_path)] == ["epoch_000001"]
    finally:
        alive.kill()
        alive.wait()


def test_a_failed_save_removes_its_temporary_folder(tmp_path: Path):
    def crash(directory: Path) -> None:
        _weight_writer(2)(directory)
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError, match="killed mid-save"):
        save_checkpoint(tmp_path, 2, crash, {}, OmegaConf.create({}), keep_last=3)
    assert list((tmp_path / "checkpoints").iterdir()) == []


# -- a full disk: one line naming the last good checkpoint ------------------------------------------
FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_disk_writer(directory: Path) -> None:
    directory.mkdir(parents=True)
    raise FULL


def _safetensors_full_disk(directory: Path) -> None:  # what safetensors raises: its own type, errno in text
    directory.mkdir(parents=True)
    raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize(
    "writer", [_full_disk_writer, _safetensors_full_disk], ids=["OSError", "safetensors"]
)
def test_a_full_disk_mid_save_is_one_line_naming_the_last_good_checkpoint(tmp_path: Path, writer):
    good = _save(tmp_path, 1, keep_last=3)
    with pytest.raises(UserError) as caught, stop_cleanly(tmp_path):
        save_checkpoint(tmp_path, 2, writer, {}, OmegaConf.create({}), keep_last=3)
    message = str(caught.value)
    assert message == (
        f"the disk is full writing {tmp_path / 'checkpoints' / 'epoch_000002'}; the last good checkpoint is "
        f"{good.path} (resume=auto continues from it); free space and run it again"
    )
    assert "\n" not in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch_000001"]  # no temporary


def test_a_full_disk_before_any_checkpoint_says_none_was_saved(tmp_path: Path):
    none_yet = r"the disk is full; no checkpoint was saved in .*checkpoints yet"
    with pytest.raises(UserError, match=none_yet), stop_cleanly(tmp_path):
        raise FULL


def test_stop_cleanly_names_the_last_good_checkpoint_after_non_finite_rewards(tmp_path: Path):
    _save(tmp_path, 1, keep_last=3)
    damaged = _save(tmp_path, 2, keep_last=3)
    _truncate(damaged.path / WEIGHTS)  # not good: the line names the one before it
    with pytest.raises(UserError) as caught, stop_cleanly(tmp_path):
        raise NonFiniteRewards("non-finite rewards {'r': '4 NaN, 0 inf'} out of 4 samples")
    last_good = tmp_path / "checkpoints" / "epoch_000001"
    assert str(caught.value) == (
        "non-finite rewards {'r': '4 NaN, 0 inf'} out of 4 samples; "
        f"the last good checkpoint is {last_good} (resume=auto continues from it)"
    )


def test_stop_cleanly_lets_other_errors_through(tmp_path: Path):
    with pytest.raises(PermissionError), stop_cleanly(tmp_path):
        raise PermissionError(errno.EACCES, "denied")


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return mounted.returncode == 0


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="mounting a tmpfs needs root on Linux"
)
def test_a_really_full_disk_mid_save_is_caught_and_cleaned_up(tmp_path: Path):
    """A 1 MiB tmpfs: the first checkpoint (256 KiB of trainer state) fits, the second (1 MiB) does not;
    torch.save reports that as a RuntimeError raised while handling the ENOSPC."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("tmpfs could not be mounted here")
    try:
        small, large = {"optimizer": torch.zeros(1 << 16)}, {"optimizer": torch.zeros(1 << 18)}
        first = save_checkpoint(disk, 1, _weight_writer(1), small, OmegaConf.create({}), keep_last=3)
        expected = (
            f"the disk is full writing {disk / 'checkpoints' / 'epoch_000002'}; the last good checkpoint is "
            f"{first.path} (resume=auto continues from it); free space and run it again"
        )
        with pytest.raises(UserError) as caught, stop_cleanly(disk):
            save_checkpoint(disk, 2, _weight_writer(2), large, OmegaConf.create({}), keep_last=3)
        assert str(caught.value) == expected
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["epoch_000001"]
        assert resolve_resume("auto", disk).path == first.path
    finally:
        subprocess.run(["umount", str(disk)], check=False)
