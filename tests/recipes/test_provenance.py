"""``provenance.json`` of a run: the checkout's git SHA (and whether it was modified), the versions of
the libraries that decide the numbers, and the SHA-256 of the ``resolved.yaml`` written beside it."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import diffusers
import pytest
import torch
import transformers
from omegaconf import OmegaConf

import rlgen_cli
from rlgen_cli.training import run as run_module
from tests.conftest import TINY_RUN

CHECKOUT = Path(rlgen_cli.__file__).resolve().parent.parent


def _git(*args: str, cwd: Path = CHECKOUT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def _in_checkout() -> bool:
    try:
        return Path(_git("rev-parse", "--show-toplevel")).resolve() == CHECKOUT
    except (OSError, subprocess.CalledProcessError):
        return False


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from tests.conftest import run_cli

    run = tmp_path_factory.mktemp("provenance") / "run"
    code, out = run_cli(
        "train", *TINY_RUN, "epochs=1", "eval_every=0", "images_every=0", f"hydra.run.dir={run}"
    )
    assert code == 0, out
    return run


def _provenance(run: Path) -> dict:
    return json.loads((run / "provenance.json").read_text())


def test_config_hash_is_the_sha256_of_resolved_yaml(trained: Path):
    resolved = trained / "resolved.yaml"
    recorded = _provenance(trained)["resolved_config_sha256"]
    assert recorded == hashlib.sha256(resolved.read_bytes()).hexdigest()
    assert OmegaConf.load(resolved).epochs == 1  # the file is the config the run used
    edited = resolved.read_bytes().replace(b"epochs: 1\n", b"epochs: 2\n", 1)
    assert edited != resolved.read_bytes() and hashlib.sha256(edited).hexdigest() != recorded


def test_versions_are_the_imported_libraries(trained: Path):
    versions = _provenance(trained)["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["diffusers"] == diffusers.__version__
    assert versions["transformers"] == transformers.__version__
    assert versions["rlgen"] == rlgen_cli.__version__
    assert {"accelerate", "peft", "hydra-core", "python"} <= versions.keys()


@pytest.mark.skipif(not _in_checkout(), reason="rlgen is not imported from a git checkout")
def test_git_sha_is_the_checkouts_head(trained: Path):
    provenance = _provenance(trained)
    assert provenance["git_sha"] == _git("rev-parse", "HEAD")
    assert len(provenance["git_sha"]) == 40
    modified = bool(_git("status", "--porcelain", "--untracked-files=no"))
    assert provenance["git_dirty"] is modified
    assert provenance["argv"][0] == "rlgen train" and f"hydra.run.dir={trained}" in provenance["argv"]


def test_no_git_state_outside_rlgens_own_checkout(tmp_path: Path, monkeypatch):
    """A package imported from outside a repository, or from inside SOME OTHER repository (a virtual
    environment in a project's tree), records no SHA rather than a wrong one."""
    package = tmp_path / "site-packages" / "rlgen_cli"
    package.mkdir(parents=True)
    monkeypatch.setattr(run_module, "_PACKAGE_DIR", package)
    assert run_module._git_state() == (None, None)
    _git("init", "-q", cwd=tmp_path)
    assert run_module._git_state() == (None, None)
