"""Tab completion through the shells' own protocol (``_RLGEN_COMPLETE`` with bash's COMP_WORDS/COMP_CWORD,
zsh's and fish's command line): verbs, config groups, their options from conf/, Hydra's flags; Hydra's
``-sc`` is refused with a pointer to ``rlgen --install-completion``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rlgen_cli.cli import app
from rlgen_cli.completion import complete_overrides


def _complete_raw(shell: str, **env: str) -> str:
    result = CliRunner().invoke(
        app, [], prog_name="rlgen", env={"_RLGEN_COMPLETE": f"complete_{shell}", **env}
    )
    assert result.exit_code == 0, result.output
    return result.output


def _complete(shell: str, **env: str) -> list[str]:
    return _complete_raw(shell, **env).split()


def _bash(line: str) -> list[str]:
    """What bash asks for with the cursor at the end of ``line`` (bash splits words at ``=`` too)."""
    words = line.replace("=", " = ").split()
    current = len(words) if line.endswith(" ") else len(words) - 1
    return _complete("bash", COMP_WORDS=" ".join(words), COMP_CWORD=str(current))


def test_bash_completes_a_verb():
    assert _bash("rlgen tr") == ["train"]
    assert {"train", "sample", "eval", "check-onpolicy", "plot", "serve-reward", "ls"} <= set(_bash("rlgen "))


def test_bash_completes_a_group_to_its_options():
    found = _bash("rlgen train mod")
    assert "model=tiny_sd3" in found and "model=sd3" in found
    assert all(item.startswith("model=") for item in found)  # bash inserts the common prefix "model="


@pytest.mark.parametrize(
    "line", ["rlgen train model=ti", "rlgen sample model=ti", "rlgen train sampler=flow"]
)
def test_bash_completes_a_group_option_after_its_equals_sign(line: str):
    found = _bash(line)
    partial = line.rsplit("=", 1)[1]
    assert found and all(item.startswith(partial) and "=" not in item for item in found), found
    assert ("tiny_sd3" in found) if partial == "ti" else found == ["flow_sde"]


def test_bash_lists_a_groups_options_right_after_the_equals_sign():
    found = _bash("rlgen train algo=")
    assert {"grpo", "grpo_fast", "dpo", "grpo_tiny"} <= set(found)


def test_bash_leaves_other_keys_values_to_its_file_completion():
    assert _bash("rlgen sample checkpoint=") == []  # bash's `-o default` then completes file names
    assert _bash("rlgen sample checkpoint=outputs/tr") == []
    assert "model=" in _bash("rlgen train algo.lr=1e-4 ")  # after a whole key=value: the groups again


def test_zsh_and_fish_keep_the_override_whole():
    zsh = _complete_raw("zsh", _TYPER_COMPLETE_ARGS="rlgen train model=tiny_s")
    assert zsh.strip() == """_arguments '*: :(("model=tiny_sd3"))'""", zsh
    fish = _complete(
        "fish", _TYPER_COMPLETE_FISH_ACTION="get-args", _TYPER_COMPLETE_ARGS="rlgen train algo=grpo_t"
    )
    assert fish == ["algo=grpo_tiny"]


def test_options_and_their_values_complete():
    assert _bash("rlgen train --cf") == ["--cfg"]
    assert _bash("rlgen train --cfg ") == ["job", "hydra", "all"]
    assert "--install-completion" in _bash("rlgen --inst")


def test_an_unknown_group_completes_to_nothing():
    assert complete_overrides([], "nosuchgroup=") == []
    assert complete_overrides(["nosuchgroup", "="], "x") == []


def test_added_group_choices_keep_their_plus():
    found = complete_overrides([], "+experiment=tiny_c")
    assert found == ["+experiment=tiny_cpu"]


def test_install_completion_is_offered_and_shows_a_script(monkeypatch):
    # the shell named, not detected: detection reads the parent processes, which a detached run lacks
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    result = CliRunner().invoke(app, ["--show-completion", "bash"], prog_name="rlgen")
    assert result.exit_code == 0 and "_RLGEN_COMPLETE=complete_bash" in result.output, result.output


def test_hydras_shell_completion_is_refused_with_the_way_to_install_rlgens():
    result = CliRunner().invoke(app, ["train", "-sc", "install=bash"], prog_name="rlgen")
    assert result.exit_code == 2
    assert "rlgen --install-completion" in result.output, result.output
