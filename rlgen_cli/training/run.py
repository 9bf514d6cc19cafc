"""The run directory: resolved config, provenance (git SHA, package versions), logging set-up."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

RESOLVED_FILE = "resolved.yaml"
PROVENANCE_FILE = "provenance.json"
_PACKAGES = ("rlgen", "torch", "diffusers", "transformers", "accelerate", "peft", "hydra-core")


def _git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _versions() -> dict[str, str]:
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def prepare_run_dir(run_dir: Path, cfg: DictConfig) -> Path:
    """Create ``run_dir`` and write ``resolved.yaml`` and ``provenance.json`` into it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / RESOLVED_FILE, resolve=True)
    provenance = {"argv": sys.argv, "git_sha": _git_sha(), "versions": _versions()}
    (run_dir / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2), encoding="utf-8")
    return run_dir


def setup_logging(run_dir: Path | None = None, level: int = logging.INFO) -> None:
    """Rich console handler (+ ``run_dir/run.log``) on the ``rlgen_cli`` logger; idempotent."""
    from rich.console import Console
    from rich.logging import RichHandler

    logger = logging.getLogger("rlgen_cli")
    logger.setLevel(level)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    # piped or redirected output has no width: 120 columns keep tables (the before/after one) unwrapped
    console = Console(width=None if sys.stdout.isatty() else 120)
    logger.addHandler(RichHandler(console=console, show_path=False, rich_tracebacks=False, markup=False))
    if run_dir is not None:
        file_handler = logging.FileHandler(run_dir / "run.log", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(file_handler)
    logger.propagate = False
