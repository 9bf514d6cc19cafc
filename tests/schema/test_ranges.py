"""Bad settings stop at the config boundary with exit code 2 naming the key, before any model loads:
every numeric setting has a range in its annotation (``schema/ranges.py``), unknown ``+`` keys are named with the closest
real key, unknown rewards list the known ones, an unreachable reward server and a non-UTF-8 prompt file
are named."""

from __future__ import annotations

import dataclasses
import math
import socket
import typing
from pathlib import Path

import pytest

from rlgen_cli.errors import UserError
from rlgen_cli.schema.ranges import Pattern, Range, range_of
from rlgen_cli.schema.store import all_schemas
from tests.conftest import run_cli, validated_train


def _schemas() -> set[type]:
    """Every dataclass reachable from the primary schemas."""
    found: set[type] = set()
    todo = all_schemas()
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.add(cls)
        for hint in typing.get_type_hints(cls).values():
            todo += [t for t in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(t)]
    return found


def _is_numeric(hint: typing.Any) -> bool:
    """int / float, optional, or a list / dict of them (bool is not a number here)."""
    args = [a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)]
    if any(typing.get_origin(a) in (list, dict) for a in args):
        return any(_is_numeric(inner) for a in args for inner in typing.get_args(a)[-1:])
    return any(a in (int, float) for a in args)


def test_every_numeric_setting_has_a_range():
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in _schemas()
        for f in dataclasses.fields(cls)
        if _is_numeric(typing.get_type_hints(cls)[f.name]) and range_of(cls, f.name) is None
    ]
    assert not missing, (
        f"give these fields a range in their annotation (Annotated[int, COUNT]): {sorted(missing)}"
    )


def test_a_range_is_read_from_the_annotation_where_the_field_is_declared():
    from rlgen_cli.schema.model import model_schema
    from rlgen_cli.schema.recipes import FlowGrpoTrainConfig

    assert range_of(FlowGrpoTrainConfig, "epochs") == Range(low=1)  # declared on RunConfig, inherited
    assert range_of(model_schema("wan2_1"), "num_frames") == Range(low=1)  # a facet's field
    assert isinstance(range_of(FlowGrpoTrainConfig, "device"), Pattern)
    assert range_of(FlowGrpoTrainConfig, "recipe") is None  # not a number


@pytest.mark.parametrize(
    ("rule", "inside", "outside", "words"),
    [
        (Range(low=1), [1, 7], [0, -2, math.nan, math.inf], "≥ 1"),
        (Range(low=0, low_open=True), [1e-12, 3.0], [0, -1.0, math.nan, math.inf], "> 0"),
        (Range(0, 1), [0, 0.5, 1], [-0.01, 1.01, math.nan], "in [0, 1]"),
        (Range(0, 1, low_open=True), [1e-9, 1], [0, 1.5], "in (0, 1]"),
        (Range(0, 1, high_open=True), [0, 0.999], [1, -1e-9], "in [0, 1)"),
        (Range(), [-1e9, 0, 2.5], [math.nan, -math.inf, True], "a finite number"),
    ],
)
def test_range_admits_and_describes(rule: Range, inside: list, outside: list, words: str):
    assert all(rule.admits(v) for v in inside)
    assert not any(rule.admits(v) for v in outside)
    assert rule.describe() == words


def _validate(*overrides: str):
    # the tiny SD3 demo; a case naming its model composes that model's own recipe (tiny_cpu picks a flow one)
    names_a_model = any(o.startswith("model=") for o in overrides)
    return validated_train(*overrides, experiment=None if names_a_model else "experiment=tiny_cpu")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.gradient_accumulation_steps=0", "algo.gradient_accumulation_steps must be ≥ 1, got 0"),
        ("algo.prompts_per_epoch=-2", "algo.prompts_per_epoch must be ≥ 1, got -2"),
        ("algo.lr=-1", "algo.lr must be > 0, got -1.0"),
        ("algo.lr=nan", "algo.lr must be > 0, got nan"),
        ("algo.adam_beta2=1.0", r"algo.adam_beta2 must be in \[0, 1\), got 1.0"),
        ("algo.window.timestep_fraction=0", r"algo.window.timestep_fraction must be in \(0, 1\], got 0"),
        ("device=tpu:7", "device must be one of auto, cpu, cuda, cuda:N .*got 'tpu:7'"),
        ("data.eval_num_prompts=-3", "data.eval_num_prompts must be ≥ 0, got -3"),
        ("model.lora.rank=0", "model.lora.rank must be ≥ 1, got 0"),
        ("model=tiny_r3 r3.top_p=1.5", r"r3.top_p must be in \(0, 1\], got 1.5"),
        ("model=tiny_r3 r3.policy.editor.num_steps=0", "r3.policy.editor.num_steps must be ≥ 1, got 0"),
        (
            "reward.weights.jpeg_compressibility=inf",
            "reward.weights.jpeg_compressibility must be a finite number",
        ),
        ("+algo.lrr=1e-3", r"algo.lrr is not a setting of algo; did you mean algo.lr\?"),
        (
            "+model.lora.rnk=4",
            r"model.lora.rnk is not a setting of model.lora; did you mean model.lora.rank\?",
        ),
        (
            "+bogus_key=1",
            "bogus_key is not a setting of the top level; the top level has: recipe, seed, epochs",
        ),
        (
            "+reward.weights.bogus_reward=1.0",
            "reward.weights names unknown reward 'bogus_reward'; known rewards: .*jpeg_compressibility",
        ),
    ],
)
def test_a_bad_setting_is_named_at_the_config_boundary(override: str, message: str):
    with pytest.raises(UserError, match=message):
        _validate(*override.split())  # a recipe's own section needs that recipe chosen (model=...)


def test_good_settings_at_the_edges_of_their_ranges_pass():
    typed = _validate("algo.adam_beta2=0", "device=cuda:3", "data.eval_num_prompts=0", "model.shift=-1")
    assert (typed.algo.adam_beta2, typed.device, typed.data.eval_num_prompts) == (0.0, "cuda:3", 0)


def _train_cli(tmp_path: Path, *overrides: str) -> tuple[int, str]:
    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("rlgen_cli.recipes.flow_run.build_policy", no_model)
        code, out = run_cli("train", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    return code, " ".join(out.split())  # rich wraps long lines


def test_bad_settings_exit_2_through_the_cli_before_any_model_loads(tmp_path: Path, capsys):
    code, out = _train_cli(tmp_path, "algo.gradient_accumulation_steps=0")
    assert (
        code == 2 and "algo.gradient_accumulation_steps must be ≥ 1, got 0" in out + capsys.readouterr().err
    )
    code, out = _train_cli(tmp_path, "+algo.lrr=1e-3")
    assert code == 2 and "did you mean algo.lr?" in out + capsys.readouterr().err
    assert not (tmp_path / "run" / "resolved.yaml").exists()  # the typo never reaches a run directory


def test_an_unreachable_reward_server_is_named_before_any_model_loads(tmp_path: Path, capsys):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    code, out = _train_cli(
        tmp_path,
        "reward=geneval_remote",
        f"reward.kwargs.remote.endpoints=[{url}]",
        "reward.kwargs.remote.ports=null",
        "data.train=builtin:tiny_train.txt",
        "data.test=builtin:tiny_test.txt",
    )
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2, message
    assert f"reward 'remote': no server answers ({url}:" in message
    assert "point reward.kwargs.remote.endpoints (or .hosts and .ports) at a running one" in message


def test_one_answering_endpoint_is_enough_and_the_silent_one_is_reported(caplog):
    from rlgen_cli.tasks.common import require_reward_servers

    with socket.socket() as up, socket.socket() as down:
        up.bind(("127.0.0.1", 0))
        up.listen()
        down.bind(("127.0.0.1", 0))  # bound, not listening: refuses connections
        live, dead = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in (up, down))
        typed = _validate(
            "reward=geneval_remote",
            f"reward.kwargs.remote.endpoints=[{live},{dead}]",
            "reward.kwargs.remote.ports=null",
        )
        require_reward_servers(typed)
    assert f"reward 'remote': {dead} does not answer" in caplog.text and live not in caplog.text


def test_a_non_utf8_prompt_file_is_named(tmp_path: Path, capsys):
    prompts = tmp_path / "latin1.txt"
    prompts.write_bytes("a red cube\ncaf\u00e9 on a table\n".encode("latin-1"))
    code, out = _train_cli(tmp_path, f"data.train={prompts}")
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2, message
    assert f"data.train: {prompts} is not UTF-8 text (byte 0xe9 at offset 14)" in message


@pytest.mark.parametrize("verb", ["train", "sample", "eval", "check-onpolicy"])
def test_cfg_job_resolve_prints_the_resolved_config(verb: str, capsys):
    code, out = run_cli(verb, "--cfg", "job", "--resolve")
    printed = out + capsys.readouterr().out
    assert code == 0, printed
    assert "run_dir: null" in printed and "${" not in printed  # no run, so no run directory
