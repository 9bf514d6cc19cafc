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
from rlgen_cli.training.reporting import run_dir as run_module
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


# -- sample / eval of a checkpoint: the run directory names the model that drew the images -------------------
@pytest.fixture(scope="module")
def flux_checkpoint(tmp_path_factory) -> Path:
    """A one-epoch tiny FLUX checkpoint (FLUX: not the tiny SD3 that sample and eval default to)."""
    from tests.conftest import run_cli

    run = tmp_path_factory.mktemp("flux") / "run"
    code, out = run_cli(
        "train",
        *TINY_RUN,
        "model=tiny_flux",
        "epochs=1",
        "save_every=1",
        "eval_every=0",
        "images_every=0",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    (checkpoint,) = (run / "checkpoints").iterdir()
    return checkpoint


def _model_written(run: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(run / "resolved.yaml").model)


@pytest.mark.parametrize("verb", ["sample", "eval"])
def test_a_checkpoints_sample_and_eval_record_the_checkpoints_model(flux_checkpoint: Path, verb, tmp_path):
    """The verbs default to the tiny SD3 (guidance 1.0); the checkpoint is a FLUX (guidance 3.5), and
    that FLUX draws the images, so resolved.yaml must hold its model section and run.log must name it."""
    from tests.conftest import run_cli

    run = tmp_path / verb
    pick = ["prompts=[a red cube]"] if verb == "sample" else ["max_prompts=1"]
    code, out = run_cli(
        verb, f"checkpoint={flux_checkpoint}", *pick, "num_steps=2", "progress=false", f"hydra.run.dir={run}"
    )
    assert code == 0, out
    trained = OmegaConf.to_container(OmegaConf.load(flux_checkpoint / "config.yaml").model)
    assert trained["family"] == "flux" and trained["guidance_scale"] == 3.5
    assert _model_written(run) == trained
    log = (run / "run.log").read_text()
    assert "model.family=flux tiny" in log and "guidance_scale=3.5" in log
    assert f"trained weights of {flux_checkpoint}" in log and "model.family=sd3" not in log
    provenance = json.loads((run / "provenance.json").read_text())  # the hash covers the recorded model
    assert (
        provenance["resolved_config_sha256"]
        == hashlib.sha256((run / "resolved.yaml").read_bytes()).hexdigest()
    )
    if verb == "eval":
        assert json.loads((run / "results.json").read_text())["model"].startswith("model.family=flux tiny")


def test_a_model_override_on_a_checkpoint_is_recorded_on_top_of_its_model(flux_checkpoint: Path, tmp_path):
    from tests.conftest import run_cli

    run = tmp_path / "sample"
    code, out = run_cli(
        "sample",
        f"checkpoint={flux_checkpoint}",
        "model.guidance_scale=2.0",
        "prompts=[a red cube]",
        "num_steps=2",
        "progress=false",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    trained = OmegaConf.to_container(OmegaConf.load(flux_checkpoint / "config.yaml").model)
    assert _model_written(run) == trained | {"guidance_scale": 2.0}
    assert "guidance_scale=2.0" in (run / "run.log").read_text()


def test_sampling_the_base_model_records_it_and_names_it(tmp_path):
    from tests.conftest import run_cli

    run = tmp_path / "sample"
    code, out = run_cli(
        "sample",
        "model=tiny_flux",
        "prompts=[a red cube]",
        "num_steps=2",
        "progress=false",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    assert _model_written(run)["family"] == "flux"
    assert "model.family=flux tiny (random weights, tiny_seed=0)" in (run / "run.log").read_text()
    assert "base weights" in (run / "run.log").read_text()
