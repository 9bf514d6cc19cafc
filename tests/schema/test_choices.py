"""Choice settings are checked once, at the config boundary: a value outside a field's ``Literal`` stops the
run with exit code 2 naming the key and the valid values; so does a window that does not fit
``model.num_steps`` (``sde/window.py`` only asserts)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlgen_cli.errors import UserError
from rlgen_cli.schema.choices import choices_of
from rlgen_cli.schema.store import all_schemas
from tests.conftest import run_cli, validated_train


def _schemas() -> set[type]:
    found: set[type] = set()
    todo = all_schemas()
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.add(cls)
            for hint in typing.get_type_hints(cls).values():
                todo += [t for t in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(t)]
    return found


CHOICES = {
    (cls, f.name): choices_of(cls, f.name)
    for cls in _schemas()
    for f in dataclasses.fields(cls)
    if choices_of(cls, f.name) is not None
}


def test_the_schemas_have_choice_fields():
    assert len(CHOICES) >= 30  # the walk found them (a broken walk would pass the tests below vacuously)


def test_every_choice_default_is_one_of_its_choices():
    bad = {
        f"{cls.__name__}.{name}": default
        for (cls, name), valid in CHOICES.items()
        for default in [cls.__dataclass_fields__[name].default]
        if default is not dataclasses.MISSING and default not in valid
    }
    assert not bad, bad


def test_no_choice_value_reads_as_a_yaml_boolean_or_null():
    unsafe = {
        f"{cls.__name__}.{name}={value}"
        for (cls, name), valid in CHOICES.items()
        for value in valid
        if not isinstance(yaml.safe_load(f"k: {value}")["k"], str)
        or not isinstance(OmegaConf.create(f"k: {value}").k, str)
    }
    assert not unsafe, unsafe


def _validate(*overrides: str):
    # the tiny SD3 demo; a case naming its model composes that model's own recipe (tiny_cpu picks a flow one)
    names_a_model = any(o.startswith("model=") for o in overrides)
    return validated_train(*overrides, experiment=None if names_a_model else "experiment=tiny_cpu")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampler.kind=sde", "sampler.kind='sde' is not valid; choose one of ode, flow_sde, dance, cps"),
        ("algo.window.kind=fast", "algo.window.kind='fast' is not valid; choose one of all, random_window, "),
        (
            "algo.window.strategy=linear",
            "algo.window.strategy='linear' is not valid; choose one of progressive",
        ),
        ("algo.kl_form=exact", "algo.kl_form='exact' is not valid; choose one of gaussian, upstream"),
        ("model.lora.init=true", "model.lora.init='True' is not valid; choose one of gaussian, kaiming"),
        (
            "launcher.mixed_precision=no",
            "launcher.mixed_precision='no' is not valid; choose one of fp32, fp16, bf16",
        ),
        (
            "model=tiny_qwen2_vl algo.token.loss_type=ppo",
            "algo.token.loss_type='ppo' is not valid; choose one of grpo, bnpo",
        ),
        (
            "model=tiny_r3 r3.sde_kind=ode",
            "r3.sde_kind='ode' is not valid; choose one of flow_sde, dance, cps",
        ),
        (
            "model=tiny_r3 r3.policy.editor.dtype=fp8",
            "r3.policy.editor.dtype='fp8' is not valid; choose one of float32",
        ),
        ("reward.aggregation=mean", "reward.aggregation='mean' is not valid"),
    ],
)
def test_a_bad_choice_is_named_with_the_valid_values(override: str, message: str):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        _validate(*override.split())  # a recipe's own section needs that recipe chosen (model=...)


def test_good_choices_pass():
    typed = _validate(  # accelerate applies the mixed precision (launcher=local refuses it: it starts no workers)
        "sampler=cps", "model.lora.init=kaiming", "launcher=accelerate", "launcher.num_processes=2",
        "launcher.mixed_precision=bf16",
    )  # fmt: skip
    assert (typed.sampler.kind, typed.model.lora.init, typed.launcher.accelerate_mixed_precision) == (
        "cps",
        "kaiming",
        "bf16",
    )
    assert _validate("launcher.mixed_precision=fp32").launcher.accelerate_mixed_precision == "no"


def test_a_bad_choice_exits_2_through_the_cli_before_any_model_loads(tmp_path: Path, capsys):
    code, out = run_cli("train", "algo.objective=ppo", f"hydra.run.dir={tmp_path / 'run'}")
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2 and "algo.objective='ppo' is not valid; choose one of grpo, grpo_guard" in message
    assert not (tmp_path / "run" / "resolved.yaml").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.num_steps=1", "algo.window.timestep_fraction=0.5"], r"int\(1 × timestep_fraction 0.5\) = 0"),
        (["algo.window.kind=random_window", "algo.window.size=5"], "size=5 is longer than the schedule"),
        (
            ["algo.window.kind=random_window", "algo.window.size=3", "algo.window.range=[0,2]"],
            r"\[0, 2\), too short for size=3",
        ),
        (["algo.window.kind=sliding", "algo.window.size=0"], r"size=0 must be in \[1, 4\]"),
        (
            ["algo.window.kind=sliding", "algo.window.size=3", "algo.window.end_offset=2"],
            r"size=3 must be in \[1, 2\]",
        ),
        (
            ["algo.window.kind=sliding", "algo.window.size=1", "algo.window.end_offset=4"],
            "end_offset=4 leaves no step",
        ),
        (
            [
                "algo.window.kind=sliding",
                "algo.window.size=1",
                "algo.window.shift_every=8",
                "algo.window.min_shift_every=9",
            ],
            r"min_shift_every \(9",
        ),
        (
            ["algo.window.kind=random_subset", "algo.window.timestep_fraction=0.2"],
            r"int\(3 candidate steps × timestep_fraction 0.2\) = 0",
        ),
        (["algo.window.kind=single", "algo.window.max_index=5"], "max_index=5 exceeds the 4 steps"),
        (["sampler=cps", "sampler.noise_level=1.2"], r"sampler.kind=cps takes a noise level in \[0, 1\]"),
    ],
)
def test_a_window_that_does_not_fit_the_schedule_is_named(overrides: list[str], message: str):
    with pytest.raises(UserError, match=message):
        _validate("model.num_steps=4", *overrides)


def test_windows_that_fit_pass():
    _validate(
        "model.num_steps=4", "algo.window.kind=sliding", "algo.window.size=4", "algo.window.min_shift_every=1"
    )
    _validate(
        "model.num_steps=4", "algo.window.kind=random_window", "algo.window.size=3", "algo.window.range=[0,3]"
    )
    _validate("model.num_steps=4", "algo.window.kind=random_subset", "algo.window.timestep_fraction=0.34")
