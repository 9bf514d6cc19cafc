"""Settings that validated but did nothing on the VLM, R3 and ShapesEval paths are refused, each with what
it is, why it does nothing there and what to set instead; the shipped configs still run.

* ``recipe=vlm_rl``: ``algo.global_std`` / ``algo.std_estimator`` (its advantages follow ``algo.token.*``),
  ``data.eval_images_per_prompt`` (one answer per test question);
* ``recipe=vlm_sft``: ``algo.group_size`` / ``prompts_per_epoch`` / ``sample_batch_size`` (an epoch is one
  pass over ``data.train``), ``data.eval_images_per_prompt``; these two are refused when the recipe sets
  up, before any model loads (``schema/vlm.py: refuse_unread_settings``), so through ``rlgen train``;
* ``recipe=r3``: ``data.*`` (R3 reads ``r3.train_data_path``, ``val_data_path``, ``eval_max_prompts``),
  refused when the config is validated;
* ``model.family=shapes``: ``model.negative_prompt`` and ``model.max_sequence_length`` (its unguided
  prompt and its tokenizer's length are its own), refused when the config is validated.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlgen_cli._hydra import compose_verb, conf_dir, config_groups
from rlgen_cli.errors import UserError
from rlgen_cli.schema.run import DataConfig
from rlgen_cli.schema.vlm import UNREAD_SETTINGS, refuse_unread_settings
from tests.conftest import run_cli, validated_train
from tests.vlm.conftest import TINY_VLM

VLM_RL = [*TINY_VLM, "algo=step_grpo", "reward=length"]
VLM_SFT = [
    "model=tiny_qwen2_vl", "data=tiny_vlm", "progress=false", "eval_every=0", "algo=vlm_sft", "reward=length",
    "data.train=builtin:tiny_sft.jsonl",
]  # fmt: skip
R3 = ["model=tiny_r3", "progress=false", "eval_every=0"]


def _validate(*overrides: str):
    return validated_train(*overrides, experiment=None)


VLM_REFUSALS = [
    (
        [*VLM_RL, "algo.global_std=false"],
        "algo.global_std=false does nothing with recipe=vlm_rl",
        "algo.token.scale_rewards=group",
    ),
    (
        [*VLM_RL, "algo.std_estimator=unbiased"],
        "algo.std_estimator=unbiased does nothing with recipe=vlm_rl",
        "algo.token.std_estimator=unbiased",
    ),
    (
        [*VLM_RL, "data.eval_images_per_prompt=4"],
        "data.eval_images_per_prompt=4 does nothing with recipe=vlm_rl",
        "data.eval_num_prompts",
    ),
    ([*VLM_SFT, "algo.group_size=4"], "algo.group_size=4 does nothing with recipe=vlm_sft", "data.train"),
    (
        [*VLM_SFT, "algo.prompts_per_epoch=16"],
        "algo.prompts_per_epoch=16 does nothing with recipe=vlm_sft",
        "a shorter data.train",
    ),
    (
        [*VLM_SFT, "algo.sample_batch_size=2"],
        "algo.sample_batch_size=2 does nothing with recipe=vlm_sft",
        "algo.train_batch_size",
    ),
    (
        [*VLM_SFT, "data.eval_images_per_prompt=2"],
        "data.eval_images_per_prompt=2 does nothing with recipe=vlm_sft",
        "data.eval_num_prompts",
    ),
]


@pytest.mark.parametrize(("overrides", "what", "instead"), VLM_REFUSALS)
def test_vlm_settings_the_recipe_does_not_read_are_refused(overrides, what, instead):
    with pytest.raises(UserError, match=re.escape(what)) as err:
        _validate(*overrides)  # the recipe schema's validation refuses them
    assert instead in str(err.value) and "Drop " in str(err.value)


@pytest.mark.parametrize(("overrides", "what", "instead"), VLM_REFUSALS)
def test_rlgen_train_exits_2_before_any_model_loads(tmp_path: Path, overrides, what, instead):
    code, out = run_cli("train", *overrides, f"hydra.run.dir={tmp_path}")
    assert code == 2, out
    assert what in " ".join(out.split()), out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_check_onpolicy_refuses_them_too(tmp_path: Path):
    code, out = run_cli("check-onpolicy", *VLM_RL, "algo.global_std=false", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "algo.global_std=false does nothing with recipe=vlm_rl" in " ".join(out.split()), out


def test_their_defaults_given_explicitly_pass():
    rl = _validate(
        *VLM_RL, "algo.global_std=true", "algo.std_estimator=population", "data.eval_images_per_prompt=1"
    )
    refuse_unread_settings(rl)
    sft = _validate(*VLM_SFT, "algo.group_size=8", "algo.prompts_per_epoch=2", "algo.sample_batch_size=8")
    refuse_unread_settings(sft)


def test_the_vlm_sft_option_leaves_the_rl_geometry_at_its_defaults():
    algo = _validate(*VLM_SFT).algo
    defaults = {
        key: getattr(type(algo)(), key) for key in ("group_size", "prompts_per_epoch", "sample_batch_size")
    }
    assert {key: getattr(algo, key) for key in defaults} == defaults


def _shipped_vlm_runs() -> list[list[str]]:
    """Every shipped experiment and VLM model option (with each VLM algorithm) whose recipe is vlm_rl or
    vlm_sft."""
    groups, vlm = config_groups(), re.compile(r"token_grpo|step_grpo|vlm_sft|qwen\d(_5)?_vl|shapesqa")
    experiments = [
        e for e in groups["experiment"] if vlm.search((conf_dir() / "experiment" / f"{e}.yaml").read_text())
    ]
    runs = [[f"experiment={e}"] for e in experiments if not e.endswith("_eval")]
    models = [m for m in groups["model"] if vlm.search(m)]
    runs += [[f"model={m}", f"algo={a}"] for m in models for a in ("token_grpo", "step_grpo", "vlm_sft")]
    return [run for run in runs if compose_verb("train", run).recipe in UNREAD_SETTINGS]


@pytest.mark.parametrize("run", _shipped_vlm_runs(), ids=" ".join)
def test_every_shipped_vlm_config_passes(run: list[str]):
    refuse_unread_settings(_validate(*run))


# -- R3 ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "instead"),
    [
        ("data.train=prompts.jsonl", "r3.train_data_path"),
        ("data.test=prompts.jsonl", "r3.val_data_path"),
        ("data.eval_num_prompts=3", "r3.eval_max_prompts"),
        ("data.eval_images_per_prompt=2", "r3.eval_rounds"),
        ("data=geneval", "r3.train_data_path"),
    ],
)
def test_r3_refuses_data_settings(override: str, instead: str):
    key = override.split("=")[0] if override.startswith("data.") else "data.train"
    with pytest.raises(UserError, match=rf"{re.escape(key)}=\S+ does nothing with recipe=r3") as err:
        _validate(*R3, override)
    assert instead in str(err.value)


def test_r3_cli_exits_2_naming_the_r3_key(tmp_path: Path):
    code, out = run_cli("train", *R3, "data.train=prompts.jsonl", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "r3.train_data_path" in " ".join(out.split()), out


@pytest.mark.parametrize(
    "run",
    [
        ["model=tiny_r3"],
        ["model=tiny_r3_bagel"],
        ["experiment=r3_geneval", "model=tiny_r3"],  # reward=geneval_remote's natural data stays out
        ["experiment=r3_geneval_bagel", "model=tiny_r3_bagel"],
        ["model=tiny_r3", "reward=geneval_remote"],
    ],
    ids=" ".join,
)
def test_r3_runs_compose_no_data_of_their_own(run: list[str]):
    assert _validate(*run).data == DataConfig()


# -- ShapesEval ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "what"),
    [
        (
            "model.negative_prompt=blurry",
            "model.negative_prompt='blurry' does nothing for model.family=shapes",
        ),
        ("model.max_sequence_length=32", "model.max_sequence_length=32 does nothing for model.family=shapes"),
        (
            "model.max_sequence_length=256",
            "model.max_sequence_length=256 does nothing for model.family=shapes",
        ),
    ],
)
@pytest.mark.parametrize(
    "base", [[], ["model=shapes_unet", "algo=grpo_tiny"]], ids=["shapes_nft", "shapes_unet"]
)
def test_shapes_refuses_prompt_settings_it_does_not_read(base: list[str], override: str, what: str):
    with pytest.raises(UserError, match=re.escape(what)) as err:
        _validate(*base, override)
    assert "Drop model." in str(err.value)


def test_shapes_refusal_exits_2_from_the_cli(tmp_path: Path):
    run = ["experiment=shapes_nft", "model.negative_prompt=blurry"]  # `rlgen train`'s default run
    code, out = run_cli("train", *run, f"hydra.run.dir={tmp_path}")
    assert code == 2 and "does nothing for model.family=shapes" in " ".join(out.split()), out


def test_shapes_own_values_pass_and_are_its_schema_defaults():
    model = _validate("model.negative_prompt=", "model.max_sequence_length=16").model
    assert (model.negative_prompt, model.max_sequence_length) == ("", 16)
    from rlgen_cli.schema.model import model_config

    shapes = model_config("shapes", tiny=True)
    assert (shapes.negative_prompt, shapes.max_sequence_length) == ("", 16)
    sd3 = _validate(
        "experiment=tiny_cpu",
        "model.guidance_scale=4.5",
        "model.negative_prompt=blurry",
        "model.max_sequence_length=32",
    ).model
    assert (sd3.negative_prompt, sd3.max_sequence_length) == (
        "blurry",
        32,
    )  # families that read them (with CFG)


def test_greedy_rollouts_are_refused_for_grpo():
    """Temperature 0 makes a group's completions identical: every advantage 0, nothing trains."""
    with pytest.raises(UserError, match=r"algo.token.temperature=0 samples greedily: .* nothing trains"):
        _validate(*VLM_RL, "algo.token.temperature=0")
    _validate(*VLM_RL, "algo.token.temperature=0.1")
