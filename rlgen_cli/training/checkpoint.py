"""Full-state checkpoints that rebuild themselves.

Layout of ``run_dir/checkpoints/epoch_000012/``::

    weights/            what the policy's ``save_trainable`` writes (LoRA safetensors in diffusers format)
    trainer_state.pt    optimizer, counters, RNG states, sampler state
    config.yaml         the resolved config that made the run (``rlgen sample checkpoint=…`` rebuilds from it)
    engine/             DeepSpeed ZeRO only: the engine's own ``save_checkpoint`` output (one optimizer-state
                        shard per rank), restored by its ``load_checkpoint``; listed, with byte sizes, in
                        trainer_state.pt so a missing or truncated shard is caught before resuming

Writes are atomic: everything goes to a temporary sibling directory that is renamed into place, so a
crash mid-save never corrupts the last good checkpoint. Older checkpoints beyond ``keep_last`` are deleted.
An engine's shards are written by every rank into :func:`engine_staging` first (a path all ranks know
without talking) and moved into the temporary directory by rank 0 before the rename.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlgen_cli.schema.errors import UserError

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_DIR = "weights"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
ENGINE_DIR = "engine"
OPTIMIZER_KEY, COUNTERS_KEY, RNG_KEY, SAMPLER_KEY = "optimizer", "counters", "rng", "sampler"
ENGINE_FILES_KEY = "engine_files"  # {path relative to engine/: bytes}
_NAME = re.compile(r"^epoch_(\d+)$")


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
    policy: Any,
    trainer_state: dict[str, Any],
    config: DictConfig,
    keep_last: int,
    engine_state: Path | None = None,
) -> Checkpoint:
    """Write ``checkpoints/epoch_{epoch:06d}`` atomically, then delete all but the newest ``keep_last``.

    Args:
        run_dir: The run directory.
        epoch: Epochs done; names the checkpoint.
        policy: Anything with ``save_trainable(directory)``.
        trainer_state: Optimizer, counters, sampler, … (RNG states are added here).
        config: The resolved config.
        keep_last: Checkpoints to keep, newest first.
        engine_state: A complete directory of an engine's sharded state (:func:`engine_staging`), moved
            into the checkpoint as ``engine/`` with its file sizes recorded for :func:`resolve_resume`.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / f"epoch_{epoch:06d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_trainable(tmp / WEIGHTS_DIR)
    if engine_state is not None:
        trainer_state = {**trainer_state, ENGINE_FILES_KEY: _manifest(engine_state)}
        os.replace(engine_state, tmp / ENGINE_DIR)
    torch.save({**trainer_state, RNG_KEY: rng_state()}, tmp / STATE_FILE)
    OmegaConf.save(config, tmp / CONFIG_FILE, resolve=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final)


def _manifest(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (relative path → bytes)."""
    return {
        str(f.relative_to(directory)): f.stat().st_size for f in sorted(directory.rglob("*")) if f.is_file()
    }


def check_engine_files(ckpt: Checkpoint, state: dict[str, Any]) -> None:
    """Raise a :class:`UserError` when an engine shard recorded in ``state`` is missing or truncated."""
    expected: dict[str, int] = state.get(ENGINE_FILES_KEY) or {}
    for name, size in expected.items():
        path = ckpt.engine / name
        found = path.stat().st_size if path.is_file() else None
        if found != size:
            raise UserError(
                f"{path} is {'missing' if found is None else f'truncated ({found} of {size} bytes)'}; "
                "resume from an older checkpoint"
            )


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [Checkpoint(p) for _, p in sorted(found)]


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint directory, validated: it must hold weights, trainer state and config."""
    ckpt = Checkpoint(Path(path))
    missing = [name for name in (WEIGHTS_DIR, STATE_FILE, CONFIG_FILE) if not (ckpt.path / name).exists()]
    if missing:
        raise UserError(
            f"{ckpt.path} is not a complete rlgen checkpoint (missing {', '.join(missing)}); "
            "pass a directory like RUN_DIR/checkpoints/epoch_000010"
        )
    return ckpt


def resolve_resume(resume: str | None, run_dir: Path) -> Checkpoint | None:
    """``None`` → fresh start; ``auto`` → the newest *readable* checkpoint in ``run_dir`` (or fresh);
    else that path, which must be readable.

    With ``auto`` a damaged newest checkpoint (e.g. a file truncated by a full disk, or a missing engine
    shard) is reported and skipped for the one before it, so a crash never strands a run.
    """
    if resume is None:
        return None
    if resume != "auto":
        ckpt = open_checkpoint(resume)
        check_engine_files(ckpt, ckpt.state())  # fail now, with the path, rather than halfway through loading
        return ckpt
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            check_engine_files(ckpt, open_checkpoint(ckpt.path).state())
        except UserError as err:
            log.warning("skipping damaged checkpoint %s: %s", ckpt.path, err)
            continue
        return ckpt
    return None
