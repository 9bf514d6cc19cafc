"""GARDO's switches through the flow recipes (tiny SD3 on CPU): what they need of the config, and the
diversity shaping with a tiny CLIP as the feature encoder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import run_cli

TINY = [
    "experiment=tiny_cpu", "model.num_steps=3", "algo.prompts_per_epoch=2", "algo.group_size=4", "epochs=1",
    "eval_every=0", "images_every=0", "progress=false",
]  # fmt: skip


def test_the_kl_gate_names_rewards_the_mix_lacks_with_exit_2(tmp_path: Path) -> None:
    code, out = run_cli(
        "train",
        *TINY,
        "algo.kl_weight=0.04",
        "algo.gardo.kl_gate=true",
        "algo.gardo.proxy_reward=jpeg_compressibility",
        "algo.gardo.auxiliary_rewards=[brightness]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert code == 2 and "algo.gardo names rewards not in reward.weights: ['brightness']" in " ".join(
        out.split()
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.gardo.kl_gate=true", "algo.gardo.proxy_reward=jpeg_compressibility",
          "algo.gardo.auxiliary_rewards=[brightness]"], "algo.gardo names rewards not in reward.weights"),
        (["algo=dgpo", "algo.gradient_accumulation_steps=1", "algo.gardo.kl_gate=true", "algo.gardo.proxy_reward=jpeg_compressibility",
          "+reward.weights.brightness=0", "algo.gardo.auxiliary_rewards=[brightness]"], "not wired into DGPO"),
    ],
)  # fmt: skip
def test_the_config_checks_run_when_the_run_is_composed(overrides: list[str], message: str) -> None:
    """Refused by the typed config itself, so before any model loads (and for every verb that types it)."""
    from rlgen_cli.errors import UserError
    from tests.vlm.conftest import compose_config

    with pytest.raises(UserError, match=message):
        compose_config("train", [*TINY, "algo.kl_weight=0.04", *overrides])


def test_a_refresh_without_a_kl_is_refused(tmp_path: Path) -> None:
    code, out = run_cli(
        "train", *TINY, "algo.kl_weight=0", "algo.gardo.refresh_every=2", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert code == 2 and "algo.kl_weight=0 turns off" in " ".join(out.split()), out


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    """A tiny random CLIP with its processor, saved in one directory."""
    from rlgen_cli.models.tiny.clip import save_tiny_clip

    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.mark.slow  # about 30 s: two tiny runs
def test_diversity_shaping_changes_the_update_and_logs_its_largest_multiplier(
    tmp_path: Path, tiny_clip: Path
):
    def train(name: str, *extra: str) -> dict:
        run = tmp_path / name
        code, out = run_cli("train", *TINY, "algo.drop_zero_advantage=false", *extra, f"hydra.run.dir={run}")
        assert code == 0, out
        return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])

    plain = train("plain")
    shaped = train("shaped", "algo.gardo.diversity=true", f"algo.gardo.feature_model={tiny_clip}")
    scale = shaped["gardo/diversity_scale_max"]
    assert math.isfinite(scale) and scale > 1  # the most distinct sample above its group's mean is amplified
    assert shaped["reward/mean"] == plain["reward/mean"]  # the same rollouts
    assert shaped["policy_loss"] != plain["policy_loss"]  # trained on other advantages


@pytest.mark.slow  # about 2 min: a one- and a two-process run of each recipe
@pytest.mark.parametrize("algo", ["grpo", "nft"])
def test_diversity_shaping_is_the_same_run_on_two_processes(tmp_path: Path, tiny_clip: Path, algo: str):
    """Features come rollout batch by rollout batch and the shaping runs on the gathered batch in global
    order, so the multipliers — and the whole run — do not depend on the process count."""
    from tests.distributed.test_recipe_matrix import FLOW, FLOW_STEPS, LORA, PAIR, _train, assert_same_run

    overrides = (
        *FLOW, f"algo={algo}", "algo.drop_zero_advantage=false" if algo == "grpo" else "algo.kl_weight=0",
        *FLOW_STEPS["several"], "algo.gardo.diversity=true", f"algo.gardo.feature_model={tiny_clip}",
    )  # fmt: skip
    one = _train(tmp_path / "one", *overrides)
    two = _train(tmp_path / "two", *overrides, *PAIR)
    assert_same_run(one, two, LORA)
    rows = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["gardo/diversity_scale_max"] > 1
