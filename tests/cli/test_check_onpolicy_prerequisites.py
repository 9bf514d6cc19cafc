"""``rlgen check-onpolicy`` checks what it will need before it builds a model, as the other verbs do:
every missing prompt file and model weights reported together, exit code 2."""

from __future__ import annotations

import pytest

from tests.cli.test_prerequisites import _message, _rlgen


@pytest.fixture
def no_model(monkeypatch):
    """Any model build fails the test: the checks must all come first."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a model was built before the prerequisites were checked")

    for where in ("rlgen_cli.recipes.flow_run.build_policy", "rlgen_cli.models.build_policy"):
        monkeypatch.setattr(where, refuse)


def test_check_onpolicy_lists_every_missing_prerequisite_before_building(
    tmp_path, monkeypatch, capsys, no_model
):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))  # nothing cached
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out = _rlgen(
        "check-onpolicy",
        "model=sd3",
        "algo=grpo",
        f"data.train={tmp_path / 'train.txt'}",
        f"data.test={tmp_path / 'test.txt'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = _message(out, capsys)
    assert code == 2, message
    assert "3 prerequisites are missing (no model was loaded)" in message
    assert f"1. data.train: prompt file {tmp_path / 'train.txt'} does not exist" in message
    assert f"2. data.test: prompt file {tmp_path / 'test.txt'} does not exist" in message
    assert "3. model.path=stabilityai/stable-diffusion-3.5-medium: not in the local hub cache" in message
