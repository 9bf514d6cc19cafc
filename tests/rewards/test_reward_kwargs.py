"""``reward.kwargs`` are typed per reward: every registered reward declares the dataclass of its kwargs,
the dataclass matches the factory's keyword arguments, and a typo or a wrong type stops the run at the
config boundary (exit code 2) naming the reward, the key and the valid keys, before any model loads."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

import rlgen_cli.rewards  # noqa: F401  (registers every reward)
from rlgen_cli.errors import UserError
from rlgen_cli.rewards.registry import REWARD_KWARGS, REWARDS, check_kwargs
from tests.conftest import run_cli, validated_train


def _keyword_params(factory) -> dict[str, inspect.Parameter]:
    """The factory's named keyword arguments (a class: its constructor's); none behind ``**kwargs``."""
    params = inspect.signature(factory).parameters.values()
    return {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def test_every_registered_reward_declares_its_kwargs():
    assert sorted(set(REWARDS) - set(REWARD_KWARGS)) == []


@pytest.mark.parametrize("name", sorted(REWARD_KWARGS))
def test_the_kwargs_dataclass_matches_the_factory(name: str):
    fields = {f.name: f for f in dataclasses.fields(REWARD_KWARGS[name])}
    params = _keyword_params(REWARDS[name])
    takes_more = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(REWARDS[name]).parameters.values())
    if not takes_more:  # a **kwargs factory builds the dataclass itself; else the names must agree
        assert set(fields) == set(params), name
    for key, param in params.items():
        assert key in fields, f"{name}: {key} is not in {REWARD_KWARGS[name].__name__}"
        if param.default is not inspect.Parameter.empty and key != "name":
            assert fields[key].default == param.default, f"{name}.{key}"
    check_kwargs(name, {})  # OmegaConf can type the dataclass


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        (
            "pickscore",
            {"modle_path": "x"},
            "reward.kwargs.pickscore.modle_path: reward 'pickscore' takes no "
            "'modle_path'; did you mean model_path\\? its kwargs are model_path, device",
        ),
        ("brightness", {"gain": 2}, "reward 'brightness' takes no 'gain'; its kwargs are none"),
        (
            "jpeg_compressibility",
            {"quality": "high"},
            "reward.kwargs.jpeg_compressibility.quality: Value 'high'",
        ),
        ("remote", {"endpoint": "http://h:1"}, "did you mean endpoints\\?"),
        (
            "geneval",
            {"colour_crop": "circle"},
            "reward.kwargs.geneval.colour_crop='circle' is not valid; choose one of mask, box",
        ),
    ],
)
def test_a_bad_kwarg_is_named_with_the_valid_ones(name: str, kwargs: dict, message: str):
    with pytest.raises(UserError, match=message):
        check_kwargs(name, kwargs)


def test_good_kwargs_pass():
    check_kwargs("pickscore", {"model_path": "x", "device": "cpu", "local_files_only": True})
    check_kwargs("remote", {"endpoints": ["http://a:1", "http://b:2"], "batch_size": 8})
    check_kwargs("ocr", {"engine_kwargs": {"lang": "en"}, "det_limit_side_len": None})


def _validate(*overrides: str):
    return validated_train(*overrides)


def test_each_component_of_a_mix_is_checked():
    mix = ["reward=pickscore_clip_mix"]
    _validate(*mix, "+reward.kwargs.clipscore.device=cpu")
    with pytest.raises(UserError, match="reward 'clipscore' takes no 'devise'; did you mean device"):
        _validate(*mix, "+reward.kwargs.clipscore.devise=cpu")


def test_a_kwargs_typo_exits_2_through_the_cli_before_any_model_loads(tmp_path: Path, capsys):
    code, out = run_cli(
        "train",
        "reward=jpeg_compressibility",
        "+reward.kwargs.jpeg_compressibility.qualty=80",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2, message
    assert "reward 'jpeg_compressibility' takes no 'qualty'; did you mean quality?" in message
    assert not (tmp_path / "run" / "resolved.yaml").exists()
