"""A mistyped config-group option (``model=flux_dve``) stops with exit 2 and the closest names, before
Hydra composes anything (its own message lists every option of the group)."""

from __future__ import annotations

from typer.testing import CliRunner

from rlgen_cli._hydra import config_groups
from rlgen_cli.cli import app


def _rlgen(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_a_mistyped_model_names_the_closest_options():
    code, out = _rlgen("train", "model=flux_dve")
    assert code == 2, out
    assert "model=flux_dve: config group model has no option 'flux_dve'" in out
    assert "Did you mean flux, flux2_klein or flux2?" in out
    assert f"rlgen ls model lists all {len(config_groups()['model'])}" in out
    assert "Available options" not in out and len(out.strip().splitlines()) == 1


def test_every_verb_and_a_sweep_value_are_checked():
    code, out = _rlgen("plan", "experiment=tiny_cpus")
    assert code == 2 and "Did you mean tiny_cpu or tiny_nocfg?" in out, out
    code, out = _rlgen("train", "-m", "reward=jpeg_compressibility,pickscroe", "--cfg", "job")
    assert code == 2 and "reward=pickscroe: config group reward has no option 'pickscroe'" in out, out
    assert "Did you mean pickscore or geneval_pickscore?" in out


def test_an_option_like_no_other_gets_no_guess():
    code, out = _rlgen("train", "algo=zzz")
    assert code == 2 and "config group algo has no option 'zzz'. (rlgen ls algo lists all" in out, out


def test_existing_options_compose():
    code, out = _rlgen("train", "experiment=tiny_cpu", "model=tiny_sd3", "launcher=local", "--cfg", "job")
    assert code == 0, out
