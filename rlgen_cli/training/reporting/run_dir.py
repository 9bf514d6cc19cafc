"""The run directory: resolved config, provenance (git SHA, package versions, config hash), logging set-up.

``provenance.json`` holds:

* ``git_sha`` / ``git_dirty``: the commit of the rlgen checkout the code was imported from (``git rev-parse
  HEAD``) and whether tracked files differ from it; both null when rlgen is not imported from a git checkout
  (an installed wheel);
* ``versions``: the versions of rlgen and the libraries that decide its numbers (torch, diffusers,
  transformers, accelerate, peft, hydra-core) as imported, plus ``python``;
* ``resolved_config_sha256``: the SHA-256 of ``resolved.yaml``'s bytes, so a run's config can be matched
  (or found edited) later: ``sha256sum RUN_DIR/resolved.yaml``;
* ``argv``: the command line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import rlgen_cli

RESOLVED_FILE = "resolved.yaml"
PROVENANCE_FILE = "provenance.json"
# distribution → the module it imports as
_PACKAGES = {
    "rlgen": "rlgen_cli", "torch": "torch", "diffusers": "diffusers", "transformers": "transformers",
    "accelerate": "accelerate", "peft": "peft", "hydra-core": "hydra",
}  # fmt: skip
_PACKAGE_DIR = (
    Path(rlgen_cli.__file__).resolve().parent
)  # the imported package, wherever this module sits in it


def _git(*args: str) -> str | None:
    """``git ARGS`` run beside the package; its stdout, or None when git or the repository is missing."""
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=_PACKAGE_DIR, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_state() -> tuple[str | None, bool | None]:
    """(HEAD's SHA, tracked files modified) of the checkout rlgen is imported from, else (None, None).

    Only a checkout whose top level holds this very package counts: a wheel installed inside some other
    repository (a virtual environment in a project's tree) must not report that project's commit.
    """
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != _PACKAGE_DIR.parent:
        return None, None
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return sha or None, None if status is None else bool(status)


def _versions() -> dict[str, str]:
    """Versions of the libraries as imported (``torch.__version__`` keeps its build tag, e.g. ``+cu124``,
    which the installed metadata may lack); the installed metadata for those not imported yet."""
    found = {"python": platform.python_version()}
    for name, module in _PACKAGES.items():
        version = getattr(sys.modules.get(module), "__version__", None)
        if version is None:
            try:
                version = metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        found[name] = str(version)
    return found


def config_sha256(text: str) -> str:
    """The hash recorded for a resolved config: SHA-256 of its UTF-8 bytes as written to ``resolved.yaml``."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a temporary sibling and a rename: a reader (a launched worker, another node
    preparing the same shared run directory) never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp-{platform.node()}-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def prepare_run_dir(run_dir: Path, cfg: DictConfig) -> Path:
    """Create ``run_dir`` and write ``resolved.yaml`` and ``provenance.json`` into it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    _write_atomic(run_dir / RESOLVED_FILE, resolved)
    sha, dirty = _git_state()
    provenance = {
        "argv": sys.argv,
        "git_sha": sha,
        "git_dirty": dirty,
        "versions": _versions(),
        "resolved_config_sha256": config_sha256(resolved),
    }
    _write_atomic(run_dir / PROVENANCE_FILE, json.dumps(provenance, indent=2))
    return run_dir


def setup_logging(run_dir: Path | None = None, level: int = logging.INFO) -> None:
    """Rich handler on the shared console (+ ``run_dir/run.log``) on the ``rlgen_cli`` logger; idempotent."""
    from rich.logging import RichHandler

    from rlgen_cli.training.reporting.console import new_console

    logger = logging.getLogger("rlgen_cli")
    logger.setLevel(level)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    # the progress bars draw on this same console, so log lines land above them (training/reporting/console.py)
    handler = RichHandler(console=new_console(), show_path=False, rich_tracebacks=False, markup=False)
    logger.addHandler(handler)
    if run_dir is not None:
        file_handler = logging.FileHandler(run_dir / "run.log", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(file_handler)
    logger.propagate = False
