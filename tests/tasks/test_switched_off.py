"""``rlgen train`` refuses a command-line setting of a feature whose switch is off in the run (it would do
nothing), naming the switch, before any model loads; the same setting with its switch on, and an option's
preset values for a feature it leaves off, are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_RUN

ONE_EPOCH = [*TINY_RUN, "epochs=1", "eval_every=0", "images_every=0"]


@pytest.mark.parametrize(
    "override,switch",
    [
        ("algo.ema.decay=0.5", "algo.ema.enabled=false (add algo.ema.enabled=true)"),
        ("algo.flash.ratio=0.5", "algo.flash.enabled=false"),
        ("logging.wandb.project=mine", "logging.wandb.enabled=false"),
        ("guard.action=rollback", "the guard is off: guard.monitors is empty"),
        ("algo.gardo.gate_fraction=0.15", "algo.gardo.kl_gate=false"),
        ("algo.gardo.feature_model=dino", "algo.gardo.diversity=false"),
        ("launcher.main_process_port=29500", "launcher=local runs one process here"),
        (
            "algo.window.stride=2",
            "algo.window.kind=all reads timestep_fraction; stride is read by the kinds sliding",
        ),
    ],
)
def test_a_setting_of_a_switched_off_feature_exits_2_naming_the_switch(
    cli, tmp_path: Path, override: str, switch: str
):
    code, out = cli("train", *ONE_EPOCH, override, f"hydra.run.dir={tmp_path}")
    assert code == 2, out
    assert f"{override} does nothing in this run: {switch}" in out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_same_settings_with_their_switch_on_train(cli, tmp_path: Path):
    on = ["algo.ema.enabled=true", "algo.ema.decay=0.5", "+guard.monitors.jpeg_compressibility=1.0",
          "guard.action=stop", "eval_every=1", "algo.window.kind=sliding", "algo.window.size=1",
          "algo.window.stride=2"]  # fmt: skip
    code, out = cli("train", *ONE_EPOCH, *on, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
