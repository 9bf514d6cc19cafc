"""The ShapesQA experiments compose to what their files say, and the shipped bases load as Qwen2-VL."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlgen_cli._hydra import compose_verb
from rlgen_cli.vlm.assets import MODEL_ASSETS, model_source


def _train(args: str):
    cfg = compose_verb("train", args.split())
    return OmegaConf.to_container(cfg, resolve=False)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {name: _train(f"experiment=shapesqa_{name}") for name in ("sft", "stepgrpo", "grpo")}


def test_stepgrpo_trains_on_r1vls_reward_and_grpo_on_the_outcome_alone(runs) -> None:
    step, grpo = runs["stepgrpo"], runs["grpo"]
    assert step["reward"]["weights"] == {"answer_accuracy": 1.0, "step_rar": 1.0, "step_rvr": 1.0}
    assert grpo["reward"]["weights"] == {"answer_accuracy": 1.0, "step_rar": 0.0, "step_rvr": 0.0}
    assert step["reward"]["kwargs"]["step_rar"]["scale"] == 0.1
    # everything but the reward weights is the same run
    assert {k: v for k, v in step.items() if k != "reward"} == {
        k: v for k, v in grpo.items() if k != "reward"
    }
    assert step["reward"]["kwargs"] == grpo["reward"]["kwargs"]
    assert step["algo"]["name"] == "step_grpo" and step["model"]["path"] == "builtin:shapesqa_sft"


def test_sft_warms_the_pretrained_base_up_on_the_chains(runs) -> None:
    sft = runs["sft"]
    assert sft["algo"]["name"] == "vlm_sft"
    assert sft["model"]["path"] == "builtin:shapesqa_base"
    assert sft["data"]["train"] == "builtin:shapesqa/sft.jsonl"


def test_builtin_names_a_shipped_model_and_other_paths_stay() -> None:
    assert model_source("builtin:shapesqa_base") == str(MODEL_ASSETS / "shapesqa_base")
    assert model_source("Qwen/Qwen2-VL-2B-Instruct") == "Qwen/Qwen2-VL-2B-Instruct"
    for name in ("shapesqa_base", "shapesqa_sft"):
        assert (MODEL_ASSETS / name / "config.json").is_file()
        assert (MODEL_ASSETS / name / "chat_template.jinja").is_file() or (
            MODEL_ASSETS / name / "processor_config.json"
        ).is_file()
