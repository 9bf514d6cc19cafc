"""``rlgen plan`` never says "fits" for a run that cannot run: it counts every model the training process
loads besides the policy (trained rewards, the guard's monitors, GARDO's feature encoder) or refuses to
guess, and it stops where ``rlgen train`` stops at startup, with the run's own message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import open_dict

from rlgen_cli._hydra import compose_verb
from rlgen_cli.errors import UserError
from rlgen_cli.tasks.common import validated
from rlgen_cli.tasks.plan_rewards import GARDO_LABEL, reward_rows

TINY = ["model=tiny_sd3", "data=tiny"]
GIB = 2**30


def _typed(*args: str) -> Any:
    cfg = compose_verb("plan", [*TINY, *args])
    with open_dict(cfg):
        cfg.run_dir = "/tmp/unused"
    return validated(cfg)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    from rlgen_cli.models.tiny.clip import save_tiny_clip

    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


def _saved_bytes(clip: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for t in load_file(clip / "model.safetensors").values())


# -- models loaded besides the policy ----------------------------------------------------------------


def test_a_guard_monitor_is_counted_like_a_trained_reward_or_refused_by_name(tiny_clip: Path):
    with pytest.raises(
        UserError, match="cannot count the memory of:\n  guard monitor pickscore loads its model"
    ):
        reward_rows(_typed("+guard.monitors.pickscore=1.0"))
    rows, _ = reward_rows(_typed("+guard.monitors.pickscore=1.0", "+plan.reward_memory_gb.pickscore=1.5"))
    assert [(r.what, r.nbytes) for r in rows] == [("guard monitor pickscore", int(1.5 * GIB))]
    local = f"{{model_path: {tiny_clip}}}"
    rows, _ = reward_rows(_typed("+guard.monitors.clipscore=1.0", f"+guard.kwargs.clipscore={local}"))
    assert [(r.what, r.nbytes) for r in rows] == [
        ("guard monitor clipscore weights", _saved_bytes(tiny_clip))
    ]


def test_gardos_feature_model_is_counted_or_refused_with_how_to_count_it(tiny_clip: Path):
    with pytest.raises(
        UserError, match=r"GARDO feature model \(algo.gardo.feature_model\) \(/nowhere/clip\)"
    ):
        reward_rows(_typed("algo.gardo.diversity=true", "algo.gardo.feature_model=/nowhere/clip"))
    rows, _ = reward_rows(_typed("algo.gardo.diversity=true", f"algo.gardo.feature_model={tiny_clip}"))
    assert [(r.what, r.nbytes) for r in rows] == [(f"{GARDO_LABEL} weights", _saved_bytes(tiny_clip))]
    rows, _ = reward_rows(_typed(f"algo.gardo.feature_model={tiny_clip}"))  # diversity off: never loaded
    assert rows == []


def test_rewards_on_one_clip_checkpoint_count_its_model_once(tiny_clip: Path):
    """``rewards/clip.py`` caches a loaded CLIP by checkpoint and dtype: a trained clipscore, a monitor and
    GARDO's encoder on the same checkpoint hold one model."""
    local = f"{{model_path: {tiny_clip}}}"
    rows, notes = reward_rows(
        _typed(
            "reward=clipscore", f"+reward.kwargs.clipscore={local}", "+guard.monitors.clipscore=1.0",
            f"+guard.kwargs.clipscore={local}", "algo.gardo.diversity=true", f"algo.gardo.feature_model={tiny_clip}",
        )
    )  # fmt: skip
    assert [(r.what, r.nbytes) for r in rows] == [("reward clipscore weights", _saved_bytes(tiny_clip))]
    assert len(notes) == 2 and all("shares the CLIP model of reward clipscore" in n for n in notes), notes


def test_the_plan_total_holds_gardos_feature_model(cli, tmp_path: Path, tiny_clip: Path):
    code, out = cli(
        "plan", *TINY, "algo.gardo.diversity=true", f"algo.gardo.feature_model={tiny_clip}",
        "plan.format=json", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert code == 0, out
    plan = json.loads((tmp_path / "plan.json").read_text())
    rows = {row["what"]: row["bytes"] for row in plan["rows"]}
    assert rows[f"{GARDO_LABEL} weights"] == _saved_bytes(tiny_clip)
    assert plan["state_bytes"] == sum(rows.values())


# -- what rlgen train refuses at startup ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launcher=fsdp", "algo.ema.enabled=true"], "algo.ema is not supported with launcher=fsdp"),
        (["launcher=deepspeed_zero2", "model.dtype=float16"], "model.dtype=float16 under DeepSpeed trains without"),
        (
            ["launcher=fsdp", "algo.kl_weight=0.04", "algo.gardo.refresh_every=2"],
            "algo.gardo.refresh_every copies whole weights into the reference",
        ),
        (["launcher=accelerate", "algo.ema.decay=0.5"], "algo.ema.decay=0.5 does nothing in this run: algo.ema.enabled=false"),
    ],
    ids=["ema_fsdp", "fp16_deepspeed", "gardo_refresh_fsdp", "switched_off"],
)  # fmt: skip
def test_the_plan_refuses_what_train_refuses_at_startup(
    cli, tmp_path: Path, overrides: list[str], message: str
):
    code, out = cli("plan", *TINY, "launcher.num_processes=2", *overrides, f"hydra.run.dir={tmp_path}")
    assert code == 2 and message in " ".join(out.split()), out
    assert "fits" not in out and not (tmp_path / "plan.json").exists()
