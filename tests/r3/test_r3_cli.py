"""The R3 experiments and ``rlgen eval`` through the CLI, and the config errors users meet first."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from rlgen_cli.errors import UserError
from tests.conftest import run_cli
from tests.r3.conftest import TINY_R3, compose_r3

EXPERIMENTS = ("r3_geneval", "r3_geneval_plus", "r3_tiif")


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiments_compose_with_real_and_tiny_models(experiment):
    typed, _ = compose_r3("train", [f"experiment={experiment}"])
    name = experiment.removeprefix("r3_")
    assert (typed.r3.dataset_name, typed.r3.reward_fn, typed.model.family) == (name, name, "r3_composite")
    assert typed.r3.policy.generator.path == "Qwen/Qwen-Image" and not typed.r3.offline.enabled
    tiny, _ = compose_r3("train", [f"experiment={experiment}", "model=tiny_r3"])
    assert tiny.r3.offline.enabled and tiny.r3.data_paths()[0] == f"builtin:r3_{name}_tiny.jsonl"


def test_seed_keys_reach_the_reward_client():
    from rlgen_cli.r3.scoring import reward_spec

    typed, _ = compose_r3(
        "train",
        [
            "experiment=r3_geneval",
            "r3.reward_server_urls=[10.0.0.1,10.0.0.2]",
            "r3.reward_server_port=[1001,1002]",
        ],
    )
    weights, kwargs = reward_spec(typed.r3, typed.reward)
    assert weights == {"remote": 1.0}
    assert kwargs["remote"]["hosts"] == ["10.0.0.1", "10.0.0.2"] and kwargs["remote"]["ports"] == [1001, 1002]
    assert (
        kwargs["remote"]["reward"] == "geneval" and kwargs["remote"]["timeout_s"] == 120.0
    )  # from reward.kwargs


SERVED_CONFLICTS = {  # override: what the refusal names
    "reward.kwargs.remote.reward=shapes_geneval": "r3.reward_fn=geneval calls the server's 'geneval' reward, "
    "but reward.kwargs.remote.reward=shapes_geneval names another",
    "reward.kwargs.remote.endpoints=[http://10.0.0.9:9000]": "reward.kwargs.remote.endpoints=['http://10.0.0.9:9000'] "
    "and r3.reward_server_urls=['127.0.0.1'] r3.reward_server_port=[8765] both name R3's reward servers",
    "reward.kwargs.remote.hosts=[gpu1]": "reward.kwargs.remote.hosts=['gpu1'] differs from "
    "r3.reward_server_urls=['127.0.0.1']",
}


@pytest.mark.parametrize("override", list(SERVED_CONFLICTS))
def test_served_geneval_refuses_client_keys_it_would_override_or_merge(override):
    with pytest.raises(UserError, match=re.escape(SERVED_CONFLICTS[override])):
        compose_r3("train", ["experiment=r3_geneval", override])


def test_reward_spec_refuses_the_conflicts_too_and_takes_endpoints_given_alone():
    from rlgen_cli.r3.scoring import reward_spec
    from rlgen_cli.schema.r3 import R3Config
    from rlgen_cli.schema.run import RewardConfig

    r3 = R3Config(reward_server_urls=["10.0.0.2"], reward_server_port=[8765])
    tiif = RewardConfig(weights={"tiif": 1.0}, kwargs={"tiif": {"endpoints": ["http://judge:8000/v1"]}})
    with pytest.raises(UserError, match=r"reward.kwargs.tiif.endpoints=\['http://judge:8000/v1'\] and r3"):
        reward_spec(dataclasses.replace(r3, reward_fn="tiif"), tiif)
    alone = RewardConfig(weights={"remote": 1.0}, kwargs={"remote": {"endpoints": ["http://10.0.0.9:9000"]}})
    _, kwargs = reward_spec(R3Config(), alone)
    assert kwargs == {"remote": {"endpoints": ["http://10.0.0.9:9000"], "reward": "geneval"}}


@pytest.mark.slow  # ≈ 40 s on 2 cores; tests/r3/test_r3_recipe.py runs the same path with model=tiny_r3
def test_the_issue_command_runs_both_stages_offline(tmp_path: Path):
    code, out = run_cli(
        "train",
        "experiment=r3_geneval",
        "model=tiny_r3",
        "epochs=2",
        "eval_every=0",
        "progress=false",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 0, out
    stages = [json.loads(line)["stage"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert stages == [0.0, 1.0]
    assert (tmp_path / "checkpoints" / "epoch_000002" / "weights" / "editor").is_dir()


def test_eval_runs_rounds_and_saves_strips(tmp_path: Path):
    code, out = run_cli(
        "eval", "model=tiny_r3", "max_prompts=3", "progress=false", f"hydra.run.dir={tmp_path}"
    )
    assert code == 0, out
    results = json.loads((tmp_path / "results.json").read_text())
    assert {"round_0/overall", "round_2/overall", "improved", "worse", "unchanged", "finish_rate"} <= set(
        results
    )
    assert results["num_samples"] == 3 and "round 2" in out
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["scores"]) == 3 for r in rows)
    assert (tmp_path / "round_strips.png").is_file()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["r3.group_size=4", "r3.micro_batch_size=3"], r"r3.micro_batch_size \(3\) must divide the 4"),
        (["r3.tune_text_cot=false", "r3.tune_image_cot=false"], "both false"),
        (
            ["r3.offline.enabled=false", "r3.train_data_path=null", "r3.val_data_path=null"],
            "train_data_path is not",
        ),
        (["r3.max_sde_timestep_idx_for_edit=9"], "max_sde_timestep_idx_for_edit"),
        (["launcher=accelerate", "launcher.num_processes=3"], "cannot be split over 3 processes"),
    ],
)
def test_bad_settings_are_user_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        compose_r3("train", ["model=tiny_r3", *overrides])


def test_unknown_reward_fn_exits_2(tmp_path: Path):
    overrides = [
        "experiment=r3_geneval",
        *TINY_R3,
        "r3.offline.enabled=false",
        "r3.train_data_path=builtin:r3_geneval_tiny.jsonl",
    ]
    code, out = run_cli("train", *overrides, "r3.reward_fn=no_such_reward", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "r3.reward_fn='no_such_reward'" in out
