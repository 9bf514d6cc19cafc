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


@pytest.fixture
def checked(cli, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """``rlgen train`` up to its refusals: exit 0 once they pass, before the run directory or a model."""

    def stop(_cfg):
        raise SystemExit(0)

    monkeypatch.setattr("rlgen_cli.tasks.train.run_dir_of", stop)
    return lambda *overrides: cli("train", *TINY_RUN, *overrides, f"hydra.run.dir={tmp_path}")


ONE_STEP = "algo.gradient_accumulation_steps=1"  # the forward presets' 2 need more micro-batches
NFT = ["algo=nft", ONE_STEP]
AWM = ["algo=awm", ONE_STEP, "algo.forward.num_timesteps=2"]  # its 6 strata assume 14 rollout steps
DGPO = ["algo=dgpo", ONE_STEP, "algo.forward.num_timesteps=2"]
SLIDING = ["algo.window.kind=sliding", "algo.window.size=1"]
NFT_SDE = [*NFT, "algo.forward.solver=sde", "sampler=cps"]


@pytest.mark.parametrize(
    "given,override,why",
    [
        # 1. another loss's option, the σ sampling's, the old policy where nothing reads it
        (AWM, "algo.forward.nft_beta=0.5",
         "algo.forward.loss=awm reads weighting, ghuber_power, advantage_max, old_weight, timestep_draw; "
         "nft_beta is read by the losses nft"),
        (NFT, "algo.forward.old_weight=1.0", "old_weight is read by the losses awm"),
        (NFT, "algo.forward.dgpo_beta=50", "dgpo_beta is read by the losses dgpo"),
        (DGPO, "algo.forward.adaptive_weight=false", "algo.forward.loss=dgpo reads dgpo_beta"),
        (DGPO, "algo.forward.weighting=t", "weighting is read by the losses awm"),
        (NFT, "algo.forward.num_timesteps=3",
         "algo.forward.timestep_sampling=subset reads timestep_fraction; num_timesteps is read by the "
         "samplings stratified, truncated"),
        ([*AWM, "algo.forward.weighting=t"], "algo.forward.ghuber_power=0.5",
         "algo.forward.weighting=t reads none of the weightings' options; ghuber_power is read by the "
         "weightings ghuber"),
        ([*AWM, "algo.forward.old_weight=0"], "algo.forward.old.rate=0.01",
         "nothing reads the old policy: algo.forward.loss=awm reads it only with algo.forward.old_weight > 0"),
        ([*DGPO, "algo.forward.dgpo_clip_range=0"], "algo.forward.old.max_decay=0.1",
         "nothing reads the old policy: algo.forward.loss=dgpo reads it only with"),
        # 2. a sliding option the strategy does not read
        ([*SLIDING, "algo.window.strategy=random"], "algo.window.stride=2",
         "algo.window.strategy=random reads none of the strategies' options; stride is read by the "
         "strategies progressive, decay, exp_decay"),
        (SLIDING, "algo.window.min_shift_every=2", "min_shift_every is read by the strategies decay"),
        ([*SLIDING, "algo.window.strategy=decay"], "algo.window.exp_decay_rate=0.2",
         "exp_decay_rate is read by the strategies exp_decay"),
        ([*SLIDING, "algo.window.stride=0"], "algo.window.shift_every=5",
         "algo.window.stride=0 never moves the window"),
        ([*SLIDING, "algo.window.stride=0"], "algo.window.roll_back=true",
         "algo.window.stride=0 never moves the window"),
        ([*SLIDING, "algo.window.strategy=decay", "algo.window.min_shift_every=1", "algo.window.max_shift_every=9"],
         "algo.window.shift_every=5", "shift_every only fills a null one"),
        # 4. the CFG gradient without a CFG branch
        ([], "algo.cfg_grad=conditional", "model.guidance_scale=1.0 runs no unconditional CFG branch"),
        (["model=tiny_flux"], "algo.cfg_grad=conditional", "model.family=flux is guidance-distilled"),
        # 5. log-probability settings of a recipe that uses none
        (["algo=dpo"], "sampler.logprob_reduce=sum", "recipe=flow_pref uses no SDE log-probability"),
        (NFT_SDE, "sampler.logprob_form=gaussian", "recipe=flow_forward uses no SDE log-probability"),
        # 6. the shared noise of a shared prefix; a window range without a window
        (["algo=grpo_fast", "algo.branch=shared_prefix"], "algo.shared_initial_noise=true",
         "algo.branch=shared_prefix already starts every sample of a group from the same noise"),
        (["algo.window.kind=random_window", "algo.window.size=0"], "algo.window.range=[0,2]",
         "algo.window.size=0 makes every step stochastic"),
    ],
)  # fmt: skip
def test_a_setting_another_choice_leaves_unread_exits_2_naming_the_choice(
    checked, given: list[str], override: str, why: str
):
    code, out = checked(*given, override)
    out = " ".join(out.split())
    assert code == 2, out
    assert f"{override} does nothing in this run: " in out and why in out, out


@pytest.mark.parametrize(
    "overrides,why",
    [
        # 3. MixGRPO-Flash's tail where every step is stochastic
        (["algo.flash.enabled=true"], "algo.flash.enabled=true does nothing with algo.window.kind=all"),
        (["algo.window.kind=random_subset", "algo.flash.enabled=true"],
         "algo.flash.enabled=true does nothing with algo.window.kind=random_subset"),
        (["algo.window.kind=random_window", "algo.window.size=0", "algo.flash.enabled=true"],
         "algo.window.kind=random_window and algo.window.size=0"),
        # 6. best-of-N that keeps every sample of a group
        (["algo.best_of_n=1"], "algo.best_of_n=1 keeps the 1 best and 1 worst samples of each group of "
         "algo.group_size=2: all of them, so it does nothing"),
    ],
)  # fmt: skip
def test_a_combination_that_does_nothing_exits_2(checked, overrides: list[str], why: str):
    code, out = checked(*overrides)
    assert code == 2, out
    assert why in " ".join(out.split())


@pytest.mark.parametrize(
    "overrides",
    [
        [*NFT, "algo.forward.nft_beta=0.5", "algo.forward.adaptive_weight=false", "algo.forward.old.rate=0.01"],
        [*AWM, "algo.forward.weighting=t", "algo.forward.old_weight=0.5", "algo.forward.old.rate=0.01"],
        [*AWM, "algo.forward.weighting=ghuber", "algo.forward.ghuber_power=0.5"],
        [*AWM, "algo.forward.old_weight=0", "algo.forward.sample_with_old=true", "algo.forward.old.rate=0.01"],
        [*DGPO, "algo.forward.dgpo_beta=50", "algo.forward.dgpo_reference=old", "algo.forward.old.rate=0.01"],
        [*NFT, "algo.forward.timestep_sampling=stratified", "algo.forward.num_timesteps=2"],
        [*SLIDING, "algo.window.strategy=decay", "algo.window.min_shift_every=1", "algo.window.stride=2"],
        [*SLIDING, "algo.window.strategy=exp_decay", "algo.window.exp_decay_rate=0.2"],
        [*SLIDING, "algo.window.strategy=decay", "algo.window.min_shift_every=1", "algo.window.shift_every=8"],
        [*SLIDING, "algo.flash.enabled=true", "algo.flash.ratio=0.5"],
        ["model.guidance_scale=4.5", "algo.cfg_grad=conditional"],
        ["sampler.logprob_reduce=sum"],
        ["algo=grpo_fast", "algo.shared_initial_noise=true"],
        ["algo.window.kind=random_window", "algo.window.size=1", "algo.window.range=[0,2]"],
        ["algo.group_size=4", "algo.best_of_n=1"],
    ],
)  # fmt: skip
def test_what_the_run_reads_is_still_accepted(checked, overrides: list[str]):
    code, out = checked(*overrides)
    assert code == 0, out
