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

Writes are atomic: everything goes to a temporary sibling directory that is renamed into place, so a
crash mid-save never corrupts the last good checkpoint. Older checkpoints beyond ``keep_last`` are deleted.
A file damaged later (a full disk, a copy cut short, a bad sector) no longer matches the manifest:
``resume=auto`` then skips that checkpoint for the one before it, naming the file, and an explicit
``resume=PATH`` stops with exit code 2. Hashing reads the files back right after writing them, from the
page cache, one thread per file: SHA-256 runs at about 0.9 GB/s per core (x86 SHA extensions), so a
700 MB checkpoint costs under a second more to save and to check at resume.
An engine's shards are written by every rank into :func:`engine_staging` first (a path all ranks know
without talking) and moved into the temporary directory by rank 0 before the rename.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlgen_cli.schema.errors import UserError
from rlgen_cli.training.checkpoint_readme import write_checkpoint_readme

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_DIR = "weights"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
ENGINE_DIR = "engine"
MANIFEST_FILE = "manifest.json"
OPTIMIZER_KEY, COUNTERS_KEY, RNG_KEY, SAMPLER_KEY = "optimizer", "counters", "rng", "sampler"
_NAME = re.compile(r"^epoch_(\d+)$")
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

    def verify(self, hashes: bool = True) -> None:
        """Every file of the manifest is there with its saved size (and, with ``hashes``, its SHA-256).

        A checkpoint without ``manifest.json`` (written by an rlgen before manifests) is accepted with a
        warning: its files cannot be checked.

        Raises:
            UserError: Naming the first damaged file.
        """
        if not (self.path / MANIFEST_FILE).exists():
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
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_weights(tmp / WEIGHTS_DIR)
    if engine_state is not None:
        os.replace(engine_state, tmp / ENGINE_DIR)
    torch.save({**trainer_state, RNG_KEY: rng_state()}, tmp / STATE_FILE)
    OmegaConf.save(config, tmp / CONFIG_FILE, resolve=True)
    write_checkpoint_readme(tmp, final.name, OmegaConf.select(config, "model.family"), epochs=epoch)
    write_manifest(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final)


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


def open_checkpoint(path: str | Path, hashes: bool = False) -> Checkpoint:
    """A checkpoint directory, validated: it holds weights, trainer state and config, and every file has
    the size its manifest recorded (and, with ``hashes``, its SHA-256).

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
    ckpt.verify(hashes)
    return ckpt


def _intact(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` after checking every file against its manifest (one without a manifest:
    after loading its trainer state, the one file whose damage shows when read)."""
    ckpt = open_checkpoint(path, hashes=True)
    if not (ckpt.path / MANIFEST_FILE).exists():
        ckpt.state()
    return ckpt


def resolve_resume(resume: str | None, run_dir: Path) -> Checkpoint | None:
    """``None`` → fresh start; ``auto`` → the newest *intact* checkpoint in ``run_dir`` (a fresh start when
    there is none yet); else that path, which must be intact.

    Intact: every file matches the size and SHA-256 in the checkpoint's manifest. With ``auto`` a damaged
    checkpoint (a weights file truncated by a full disk, a missing engine shard) is reported, naming the
    file, and skipped for the one before it, so a crash never strands a run.

    Raises:
        UserError: An explicit checkpoint is damaged, or ``auto`` found checkpoints but none intact.
    """
    if resume is None:
        return None
    if resume != "auto":
        return _intact(Path(resume))
    checkpoints = list_checkpoints(run_dir)
    damaged = []
    for ckpt in reversed(checkpoints):
        try:
            return _intact(ckpt.path)
        except UserError as err:
            log.warning("resume=auto skips a damaged checkpoint: %s", err)
            damaged.append(str(err))
    if checkpoints:
        raise UserError(
            f"resume=auto found no intact checkpoint in {Path(run_dir) / CHECKPOINTS_DIR}: "
            f"{'; '.join(damaged)}. Delete the damaged ones to start afresh, or resume=PATH from a copy"
        )
    return None
