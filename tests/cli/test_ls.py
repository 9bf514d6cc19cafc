"""``rlgen ls`` lists everything a run can name: every config group's options, every model family
(``model.family``) and every reward a mix can weigh (``reward.weights``), read from the registries."""

from __future__ import annotations

from rlgen_cli._hydra import config_groups
from rlgen_cli.models.registry import FAMILIES
from rlgen_cli.rewards import available
from rlgen_cli.schema.r3 import R3_FAMILIES
from rlgen_cli.schema.vlm import VLM_FAMILIES


def _listed(out: str) -> dict[str, set[str]]:
    """{line label: the comma-separated names after it} of ``rlgen ls`` output."""
    rows = (line.split(": ", 1) for line in out.splitlines() if ": " in line)
    return {label: set(names.split(", ")) for label, names in rows}


def test_ls_lists_every_family_algorithm_and_reward(cli):
    code, out = cli("ls")
    assert code == 0, out
    listed = _listed(out)
    assert set(FAMILIES) | set(VLM_FAMILIES) | set(R3_FAMILIES) == listed["model.family"]
    assert {"qwen_image_2", "z_image", "flux2_klein", "wan2_2", "qwen3_vl"} <= listed["model.family"]
    assert {"qwen_image_2", "tiny_qwen_image_2"} <= listed["model"]
    assert set(available()) == listed["reward.weights"]
    assert {"hpsv2", "hpsv2_1", "hpsv3", "imagereward", "video_ocr", "openai_judge"} <= listed[
        "reward.weights"
    ]
    assert {"hpsv2", "hpsv2_1", "hpsv3", "imagereward"} <= listed["reward"]
    assert set(config_groups()["algo"]) == listed["algo"]
    assert {
        "grpo",
        "grpo_fast",
        "mix_grpo",
        "dance",
        "dpo",
        "sft",
        "nft",
        "awm",
        "token_grpo",
        "step_grpo",
    } <= listed["algo"]


def test_ls_of_one_group_shows_its_registry_line_only(cli):
    code, out = cli("ls", "reward")
    assert code == 0, out
    assert set(_listed(out)) == {"reward", "reward.weights"}
    code, out = cli("ls", "algo")
    assert set(_listed(out)) == {"algo"}
