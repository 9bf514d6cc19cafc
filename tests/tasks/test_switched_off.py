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


R3_ONE_STEP = ["model=tiny_r3", "progress=false", "epochs=1", "eval_every=0"]


@pytest.mark.parametrize(
    "switch_off,override,switch",
    [
        ("r3.tune_text_cot=false", "r3.ce_weight=0.5", "r3.tune_text_cot=false trains no text"),
        ("r3.tune_text_cot=false", "r3.kl_weight_text=0.01", "r3.tune_text_cot=false trains no text"),
        ("r3.tune_text_cot=false", "r3.format_weight=0.5", "r3.tune_text_cot=false trains no text"),
        ("r3.tune_image_cot=false", "r3.mse_weight=1.0", "r3.tune_image_cot=false trains no image"),
        ("r3.tune_image_cot=false", "r3.kl_weight_image=0.01", "r3.tune_image_cot=false trains no image"),
        ("r3.enable_sde_gen=false", "r3.noise_level_gen=0.5", "r3.enable_sde_gen=false draws generated"),
        ("r3.enable_sde_edit=false", "r3.noise_level_edit=0.5", "r3.enable_sde_edit=false draws edited"),
        ("r3.enable_sde_edit=false", "r3.max_sde_timestep_idx_for_edit=1", "r3.enable_sde_edit=false"),
    ],
)
def test_an_r3_setting_its_switch_leaves_unread_exits_2_naming_the_switch(
    cli, tmp_path: Path, switch_off: str, override: str, switch: str
):
    code, out = cli("train", *R3_ONE_STEP, switch_off, override, f"hydra.run.dir={tmp_path}")
    assert code == 2, out
    assert f"{override} does nothing in this run: {switch}" in out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_sde_form_is_refused_only_when_no_stage_takes_an_sde_step(cli, tmp_path: Path):
    ode = ["r3.enable_sde_gen=false", "r3.enable_sde_edit=false", "r3.tune_image_cot=false"]
    code, out = cli("train", *R3_ONE_STEP, *ode, "r3.sde_kind=cps", f"hydra.run.dir={tmp_path}")
    assert code == 2, out
    assert (
        "r3.sde_kind=cps does nothing in this run: r3.enable_sde_gen=false and r3.enable_sde_edit=false"
        in out
    )


def test_the_r3_settings_with_their_switches_on_train(cli, tmp_path: Path):
    on = ["r3.ce_weight=0.5", "r3.kl_weight_text=0.01", "r3.mse_weight=1.0", "r3.noise_level_gen=0.5",
          "r3.sde_kind=dance", "r3.max_sde_timestep_idx_for_edit=1"]  # fmt: skip
    code, out = cli("train", *R3_ONE_STEP, *on, f"hydra.run.dir={tmp_path}")
    assert code == 0, out


def test_sft_refuses_the_rollout_cap_it_never_reads(cli, tmp_path: Path):
    sft = ["model=tiny_qwen2_vl", "algo=vlm_sft", "data=tiny_vlm", "data.train=builtin:tiny_sft.jsonl",
           "reward=length", "progress=false", "epochs=1", "eval_every=0"]  # fmt: skip
    code, out = cli("train", *sft, "model.vlm.completion_cap=1", f"hydra.run.dir={tmp_path}")
    assert code == 2, out
    assert "model.vlm.completion_cap=1 does nothing in this run: recipe=vlm_sft samples no completions" in out
