"""Full-state checkpoints that rebuild themselves.

Layout of ``run_dir/checkpoints/epoch_000012/``::

    weights/            what the recipe's weight writer writes (``policy.trainable.save``: LoRA safetensors
                        in diffusers format)
    trainer_state.pt    optimizer, counters (epochs done, optimizer steps, seconds of training and on the
                        time limit's clock), RNG states, sampler state
    config.yaml         the resolved config that made the run (``rlgen sample checkpoint=…`` rebuilds from it)
    engine/             DeepSpeed ZeRO only: the engine's own ``save_checkpoint`` output (one optimizer-state
                        shard per rank), restored by its ``load_checkpoint``
    README.txt          which folder holds the weights (weights/) and how to load it outside rlgen
    manifest.json       every other file's size and SHA-256, written last

Writes are atomic: everything goes to a temporary sibling directory (``.epoch_000012.tmp-HOST-PID``)
that is renamed into place, so a crash mid-save never corrupts the last good checkpoint. Every file and
folder of it is fsynced before the rename and the ``checkpoints/`` folder after it, so a power loss
leaves either the old state or the whole new checkpoint, never a renamed folder of empty files. A save
that fails removes its temporary directory; one left by a killed process is removed by
:func:`sweep_stale_temporaries` when the next run starts (never one whose process is still alive).
Older checkpoints beyond ``keep_last`` are deleted.

A file damaged later (a full disk, a copy cut short, a bad sector) no longer matches the manifest:
``resume=auto`` then skips that checkpoint for the one before it, naming the file, and an explicit
``resume=PATH`` stops with exit code 2. The manifest is written before the rename, so a checkpoint
without one is damaged (or was saved by an rlgen before manifests): ``resume=auto`` skips it too, naming
it, and ``resume=PATH`` to it needs ``resume_unverified=true``. Hashing reads the files back right after
writing them, from the page cache, one thread per file: SHA-256 runs at about 0.9 GB/s per core (x86 SHA
extensions), so a 700 MB checkpoint costs under a second more to save and to check at resume.

A full disk while the run saves its config or a checkpoint, and a non-finite reward
(:class:`NonFiniteRewards`), stop the run with one line naming the last good checkpoint
(:func:`stop_cleanly`).
An engine's shards are written by every rank into :func:`engine_staging` first (a path all ranks know
without talking) and moved into the temporary directory by rank 0 before the rename.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import platform
import re
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlgen_cli.errors import UserError
from rlgen_cli.training.checkpoints.checkpoint_readme import write_checkpoint_readme

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_DIR = "weights"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
ENGINE_DIR = "engine"
MANIFEST_FILE = "manifest.json"
OPTIMIZER_KEY, COUNTERS_KEY, RNG_KEY, SAMPLER_KEY = "optimizer", "counters", "rng", "sampler"
_NAME = re.compile(r"^epoch_(\d+)$")
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-(?:(?P<host>.+)-)?(?P<pid>\d+)$")  # no host: older rlgen
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = (os.strerror(errno.ENOSPC), f"os error {errno.ENOSPC}")  # writers that wrap the OSError
_OLDER = "use an older checkpoint"
_HASH_BUFFER = 1 << 20  # bytes read per hashing call: large enough that SHA-256 itself is the cost


@dataclass(frozen=True)
class Checkpoint:
    path: Path

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_DIR

    @property
    def engine(self) -> Path:
        """The engine's sharded state (DeepSpeed ZeRO), absent for the other launchers."""
        return self.path / ENGINE_DIR

    def config(self) -> DictConfig:
        """The resolved config saved with the checkpoint."""
        return OmegaConf.load(self.path / CONFIG_FILE)

    def manifest(self) -> dict[str, dict[str, Any]]:
        """``{path relative to the checkpoint: {"bytes": size, "sha256": hex digest}}`` of every file saved.

        Raises:
            UserError: When ``manifest.json`` is missing or unreadable.
        """
        path = self.path / MANIFEST_FILE
        if not path.exists():
            raise UserError(f"{path} is missing; {_OLDER}")
        try:
            return json.loads(path.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"{path} is unreadable ({err}); {_OLDER}") from err

    def verify(self, hashes: bool = True, require_manifest: bool = False) -> None:
        """Every file of the manifest is there with its saved size (and, with ``hashes``, its SHA-256).

        A checkpoint without ``manifest.json`` cannot be checked: with ``require_manifest`` (what a resume
        asks unless ``resume_unverified=true``) that is an error, else it is accepted with a warning.

        Raises:
            UserError: Naming the first damaged file, or the missing manifest.
        """
        if not (self.path / MANIFEST_FILE).exists():
            if require_manifest:
                raise UserError(
                    f"{self.path} has no {MANIFEST_FILE}, so its files cannot be checked: every checkpoint "
                    "this rlgen saves has one (written before the folder is renamed into place), so this one "
                    "is damaged or was saved by an older rlgen; use an older checkpoint, or add "
                    "resume_unverified=true to resume from it unchecked"
                )
            log.warning("%s has no %s: its files are not verified", self.path, MANIFEST_FILE)
            return
        saved = self.manifest()
        for name, entry in saved.items():  # sizes first: a truncated file is named without hashing anything
            path = self.path / name
            size = path.stat().st_size if path.is_file() else None
            if size != entry["bytes"]:
                damage = "missing" if size is None else f"truncated ({size} of {entry['bytes']} bytes)"
                raise UserError(f"{path} is {damage}; {_OLDER}")
        if not hashes:
            return
        for name, digest in zip(saved, sha256_all([self.path / name for name in saved]), strict=True):
            if digest != saved[name]["sha256"]:
                raise UserError(
                    f"{self.path / name} is corrupted (its SHA-256 differs from the saved one); {_OLDER}"
                )

    def state(self) -> dict[str, Any]:
        try:  # weights_only: a checkpoint from elsewhere cannot run code when loaded
            return torch.load(self.path / STATE_FILE, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
            raise UserError(
                f"{self.path / STATE_FILE} is unreadable ({err}); resume from an older checkpoint"
            ) from err


def rng_state() -> dict[str, Any]:
    """Torch RNG states (rlgen draws randomness only from torch)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def engine_staging(run_dir: Path, epoch: int) -> Path:
    """Where every rank writes an engine's sharded state for checkpoint ``epoch`` (on storage all ranks
    share) before :func:`save_checkpoint` moves it into the checkpoint."""
    return Path(run_dir) / CHECKPOINTS_DIR / f".epoch_{epoch:06d}.engine"


def save_checkpoint(
    run_dir: Path,
    epoch: int,
    save_weights: Callable[[Path], None],
    trainer_state: dict[str, Any],
    config: DictConfig,
    keep_last: int,
    engine_state: Path | None = None,
    name: str | None = None,
) -> Checkpoint:
    """Write ``checkpoints/epoch_{epoch:06d}`` (or ``checkpoints/{name}``) atomically, then delete all but
    the newest ``keep_last`` epoch checkpoints.

    Args:
        run_dir: The run directory.
        epoch: Epochs done; names the checkpoint.
        save_weights: Writes the trained weights into the directory it is given (a flow policy's
            ``policy.trainable.save``, a VLM / R3 policy's ``save_trainable``).
        trainer_state: Optimizer, counters, sampler, … (RNG states are added here).
        config: The resolved config.
        keep_last: Checkpoints to keep, newest first.
        engine_state: A complete directory of an engine's sharded state (:func:`engine_staging`), moved
            into the checkpoint as ``engine/`` (the manifest covers its shards like every other file).
        name: A fixed folder name instead of the epoch's (e.g. the guard's ``best_heldout``): replaced by
            each save, never deleted by ``keep_last`` and never picked by ``resume=auto``.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / (name or f"epoch_{epoch:06d}")
    tmp = root / f".{final.name}.tmp-{platform.node()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_weights(tmp / WEIGHTS_DIR)
        if engine_state is not None:
            os.replace(engine_state, tmp / ENGINE_DIR)
        with (tmp / STATE_FILE).open("wb") as f:  # through Python's file: a full disk raises ENOSPC
            torch.save({**trainer_state, RNG_KEY: rng_state()}, f)
        OmegaConf.save(config, tmp / CONFIG_FILE, resolve=True)
        write_checkpoint_readme(tmp, final.name, OmegaConf.select(config, "model.family"), epochs=epoch)
        write_manifest(tmp)
        fsync_tree(tmp)  # the data on disk before the rename can make the folder visible
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # on a full disk, the space it held
        if isinstance(err, Exception) and is_disk_full(err):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(final)) from err
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_directory(root)  # the rename itself on disk
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final)


def fsync_directory(path: Path) -> None:
    """Flush a directory's entries (names created, renamed or removed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory`` to disk, then every folder's entries, deepest first."""
    paths = sorted(directory.rglob("*"))
    for path in paths:
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for folder in sorted((p for p in paths if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        fsync_directory(folder)
    fsync_directory(directory)


def sweep_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove the temporary checkpoint folders (``checkpoints/.NAME.tmp-HOST-PID``) that a killed process
    left behind — each held a checkpoint's worth of disk. One whose process is alive on this host, or
    that another host wrote, is left alone (it may still be renamed into place). Returns those removed."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        match = _TEMPORARY.match(path.name)
        if match is None or not path.is_dir():
            continue
        host, pid = match["host"], int(match["pid"])
        if (host is not None and host != platform.node()) or _process_alive(pid):
            log.info("left %s in place: its process %s is alive or on another host", path, pid)
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, left by process %d, which is gone", path, pid)
        removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: existence and permission only, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


class NonFiniteRewards(UserError):
    """A reward returned NaN or infinity: the run stops rather than train on it; :func:`stop_cleanly`
    adds which checkpoint is the last good one."""


def last_good_line(run_dir: Path) -> str:
    """Which checkpoint a resume continues from (the newest whose files have their saved sizes), or that
    none was saved yet, and how to continue."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            open_checkpoint(ckpt.path, require_manifest=True)
        except UserError:
            continue
        return f"the last good checkpoint is {ckpt.path} (resume=auto continues from it)"
    return f"no checkpoint was saved in {Path(run_dir) / CHECKPOINTS_DIR} yet"


def is_disk_full(err: BaseException) -> bool:
    """``err``, or an error it was raised from or while handling, is a full disk or quota: an ``OSError``
    ENOSPC / EDQUOT, or a writer's own error that says so (safetensors: "os error 28")."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DISK_FULL:
            return True
        if any(text in str(current) for text in _DISK_FULL_TEXT):
            return True
        current = current.__cause__ or current.__context__
    return False


@contextmanager
def stop_cleanly(run_dir: Path) -> Iterator[None]:
    """Turn a full disk (:func:`is_disk_full`: saving the config, a checkpoint, a log) and a non-finite
    reward into one :class:`UserError` line (exit code 2) that names the last good checkpoint. A failed
    checkpoint save has already removed its temporary folder, so the checkpoints on disk are complete."""
    try:
        yield
    except NonFiniteRewards as err:
        raise UserError(f"{err}; {last_good_line(run_dir)}") from err
    except Exception as err:
        if not is_disk_full(err):
            raise
        where = f" writing {err.filename}" if isinstance(err, OSError) and err.filename else ""
        raise UserError(
            f"the disk is full{where}; {last_good_line(run_dir)}; free space and run it again"
        ) from err


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks into one reused buffer."""
    digest, buffer = hashlib.sha256(), bytearray(_HASH_BUFFER)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def sha256_all(paths: list[Path]) -> list[str]:
    """:func:`file_sha256` of each path, several files at once (hashlib releases the GIL while hashing),
    so a checkpoint's weights, trainer state and engine shards take as long as the largest of them."""
    if len(paths) <= 1:
        return [file_sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(file_sha256, paths))


def write_manifest(directory: Path) -> None:
    """Record the size and SHA-256 of every file under ``directory`` in its ``manifest.json``."""
    paths = [f for f in sorted(directory.rglob("*")) if f.is_file() and f.name != MANIFEST_FILE]
    files = {
        path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "sha256": digest}
        for path, digest in zip(paths, sha256_all(paths), strict=True)
    }
    (directory / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1), encoding="utf-8")


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [Checkpoint(p) for _, p in sorted(found)]


def open_checkpoint(path: str | Path, hashes: bool = False, require_manifest: bool = False) -> Checkpoint:
    """A checkpoint directory, validated: it holds weights, trainer state and config, and every file has
    the size its manifest recorded (and, with ``hashes``, its SHA-256); with ``require_manifest`` one
    without a manifest is refused (:meth:`Checkpoint.verify`).

    Raises:
        UserError: Naming what is missing or damaged.
    """
    ckpt = Checkpoint(Path(path))
    missing = [name for name in (WEIGHTS_DIR, STATE_FILE, CONFIG_FILE) if not (ckpt.path / name).exists()]
    if missing:
        raise UserError(
            f"{ckpt.path} is not a complete rlgen checkpoint (missing {', '.join(missing)}); "
            "pass a directory like RUN_DIR/checkpoints/epoch_000010"
        )
    ckpt.verify(hashes, require_manifest)
    return ckpt


def _intact(path: Path, unverified: bool) -> Checkpoint:
    """The checkpoint at ``path`` after checking every file against its manifest (one without a manifest,
    accepted only when ``unverified``: after loading its trainer state, the one file whose damage shows
    when read)."""
    ckpt = open_checkpoint(path, hashes=True, require_manifest=not unverified)
    if not (ckpt.path / MANIFEST_FILE).exists():
        ckpt.state()
    return ckpt


def resolve_resume(resume: str | None, run_dir: Path, unverified: bool = False) -> Checkpoint | None:
    """``None`` → fresh start; ``auto`` → the newest *intact* checkpoint in ``run_dir`` (a fresh start when
    there is none yet); else that path, which must be intact.

    Intact: a manifest, and every file matches the size and SHA-256 it records. With ``auto`` a damaged
    checkpoint (a weights file truncated by a full disk, a missing engine shard, no manifest) is
    reported, naming the file, and skipped for the one before it, so a crash never strands a run.
    ``unverified`` (``resume_unverified=true``) accepts a checkpoint without a manifest, with a warning.

    Raises:
        UserError: An explicit checkpoint is damaged, or ``auto`` found checkpoints but none intact.
    """
    if resume is None:
        return None
    if resume != "auto":
        return _intact(Path(resume), unverified)
    checkpoints = list_checkpoints(run_dir)
    damaged = []
    for ckpt in reversed(checkpoints):
        try:
            return _intact(ckpt.path, unverified)
        except UserError as err:
            log.warning("resume=auto skips a damaged checkpoint: %s", err)
            damaged.append(str(err))
    if checkpoints:
        raise UserError(
            f"resume=auto found no intact checkpoint in {Path(run_dir) / CHECKPOINTS_DIR}: "
            f"{'; '.join(damaged)}. Delete the damaged ones to start afresh, or resume=PATH from a copy"
        )
    return None
