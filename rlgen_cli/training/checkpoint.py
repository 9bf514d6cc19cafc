"""Full-state checkpoints that rebuild themselves.

Layout of ``run_dir/checkpoints/epoch_000012/``::

    weights/            what the policy's ``save_trainable`` writes (LoRA safetensors in diffusers format)
    trainer_state.pt    optimizer, counters, RNG states, sampler state
    config.yaml         the resolved config that made the run (``rlgen sample checkpoint=…`` rebuilds from it)

Writes are atomic: everything goes to a temporary sibling directory that is renamed into place, so a
crash mid-save never corrupts the last good checkpoint. Older checkpoints beyond ``keep_last`` are deleted.
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
OPTIMIZER_KEY, COUNTERS_KEY, RNG_KEY, SAMPLER_KEY = "optimizer", "counters", "rng", "sampler"
_NAME = re.compile(r"^epoch_(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    path: Path

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_DIR

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


def save_checkpoint(
    run_dir: Path, epoch: int, policy: Any, trainer_state: dict[str, Any], config: DictConfig, keep_last: int
) -> Checkpoint:
    """Write ``checkpoints/epoch_{epoch:06d}`` atomically, then delete all but the newest ``keep_last``."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / f"epoch_{epoch:06d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy.save_trainable(tmp / WEIGHTS_DIR)
    torch.save({**trainer_state, RNG_KEY: rng_state()}, tmp / STATE_FILE)
    OmegaConf.save(config, tmp / CONFIG_FILE, resolve=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old.path, ignore_errors=True)
    return Checkpoint(final)


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

    With ``auto`` a damaged newest checkpoint (e.g. a file truncated by a full disk) is reported and
    skipped for the one before it, so a crash never strands a run.
    """
    if resume is None:
        return None
    if resume != "auto":
        ckpt = open_checkpoint(resume)
        ckpt.state()  # fail now, with the path, rather than halfway through loading
        return ckpt
    for ckpt in reversed(list_checkpoints(run_dir)):
        try:
            open_checkpoint(ckpt.path).state()
        except UserError as err:
            log.warning("skipping damaged checkpoint %s: %s", ckpt.path, err)
            continue
        return ckpt
    return None
