"""Settings a recipe would validate and then ignore are refused at the config boundary instead.

Each case composes ``rlgen train`` through the real config path (Hydra, the recipe's schema, the one
validation pass) with a setting the chosen recipe does not read, and expects a ``UserError`` naming the
setting, why it does nothing and the fix; the same recipe without it (or with the value it does read)
passes. The shipped configs themselves keep composing: ``tests/schema/test_compose.py`` validates every
experiment and algorithm option, and :func:`test_what_the_refusals_leave_alone_still_composes` pins the
neighbours of each refusal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlgen_cli.errors import UserError
from tests.conftest import run_cli, validated_train


def _validate(*overrides: str):
    return validated_train(*overrides)


PRETRAIN = "experiment=shapes_pretrain"
PRETRAIN_FIX = "size the training with algo.pretrain.batch_size and algo.pretrain.steps_per_epoch"
PREF_ACCUMULATION = (
    r"algo.gradient_accumulation_steps=2 is not read by recipe=flow_pref: DPO / SFT take one optimizer step "
    r"per training σ over all of an epoch's pairs \(kept samples\).*Set algo.gradient_accumulation_steps=null"
)
ODE_SAMPLER = (
    r"algo.forward.solver=dpm2 rolls out the deterministic ODE and never takes the sampler's SDE step, so "
    r"these settings do nothing\. Pass algo.forward.solver=sde"
)

REFUSED = {
    # 1. flow_pref never enters cfg_gradient: both CFG branches are always differentiated
    "pref_cfg_grad_conditional": (
        ["algo=dpo", "algo.cfg_grad=conditional"],
        r"algo.cfg_grad=conditional is not read by recipe=flow_pref: DPO's and SFT's training forwards always "
        r"back-propagate through both classifier-free-guidance branches\. Drop the override \(algo.cfg_grad=both\)",
    ),
    "sft_cfg_grad_conditional": (["algo=sft", "algo.cfg_grad=conditional"], "algo.cfg_grad=conditional"),
    # 2. DPO / SFT train no KL term
    "dpo_kl_weight": (
        ["algo=dpo", "algo.kl_weight=0.04"],
        r"algo.kl_weight=0.04 is not read by recipe=flow_pref: DPO and SFT train no KL term\. Set "
        r"algo.kl_weight=0; .*algo.pref.anchor_weight",
    ),
    "sft_kl_weight": (
        ["algo=sft", "algo.kl_weight=1e-3"],
        "algo.kl_weight=0.001 is not read by recipe=flow_pref",
    ),
    # 3. one optimizer step per training σ over all units: no accumulation setting
    "dpo_accumulation": (["algo=dpo", "algo.gradient_accumulation_steps=2"], PREF_ACCUMULATION),
    "sft_accumulation": (["algo=sft", "algo.gradient_accumulation_steps=2"], PREF_ACCUMULATION),
    # 4. the advantage normalisation is SFT's alone
    "dpo_global_std": (
        ["algo=dpo", "algo.global_std=false"],
        r"algo.global_std=False normalises SFT's advantages, and algo.pref.loss=dpo computes none.*drop the "
        r"override \(back to True\), or train algo.pref.loss=sft",
    ),
    "dpo_std_estimator": (
        ["algo=dpo", "algo.std_estimator=unbiased"],
        r"algo.std_estimator='unbiased' normalises SFT's advantages, and algo.pref.loss=dpo computes none",
    ),
    "dpo_adv_eps": (
        ["algo=dpo", "algo.adv_eps=1e-8"],
        r"algo.adv_eps=1e-08 normalises SFT's advantages, and algo.pref.loss=dpo computes none",
    ),
    # (and the algo.pref options of the other loss)
    "sft_dpo_beta": (
        ["algo=sft", "algo.pref.dpo_beta=50"],
        r"algo.pref.dpo_beta=50.0 is read by algo.pref.loss=dpo alone, and this run trains algo.pref.loss=sft, "
        r"which ignores it: drop the override \(back to 100.0\), or set algo.pref.loss=dpo",
    ),
    "sft_ref_update_step": (
        ["algo=sft", "algo.pref.ref_update_step=5"],
        "algo.pref.ref_update_step=5 is read by",
    ),
    "dpo_anchor_weight": (
        ["algo=dpo", "algo.pref.anchor_weight=0.1"],
        "algo.pref.anchor_weight=0.1 is read by algo.pref.loss=sft alone",
    ),
    "dpo_top_k": (["algo=dpo", "algo.pref.top_k=2"], "algo.pref.top_k=2 is read by algo.pref.loss=sft alone"),
    # 5. pretraining's lr follows the step, never the time limit
    "pretrain_time_clock": (
        [PRETRAIN, "lr_schedule_clock=time_or_epochs", "time_limit_minutes=10"],
        r"lr_schedule_clock=time_or_epochs is not read by recipe=flow_pretrain: its learning rate follows the "
        r"optimizer step.*Drop the override \(lr_schedule_clock=epochs\)",
    ),
    # 6. pretraining trains algo.pretrain.batch_size images per step, one backward
    "pretrain_group_size": (
        [PRETRAIN, "algo.group_size=4"],
        rf"algo.group_size=4 has no effect with recipe=flow_pretrain.*Leave algo.group_size at 2 and {PRETRAIN_FIX}",
    ),
    "pretrain_prompts_per_epoch": (
        [PRETRAIN, "algo.prompts_per_epoch=64"],
        rf"algo.prompts_per_epoch=64 has no effect.*Leave algo.prompts_per_epoch at 32 and {PRETRAIN_FIX}",
    ),
    "pretrain_train_batch_size": (
        [PRETRAIN, "algo.train_batch_size=8"],
        rf"algo.train_batch_size=8 has no effect.*Leave algo.train_batch_size at 16 and {PRETRAIN_FIX}",
    ),
    "pretrain_accumulation": (
        [PRETRAIN, "algo.gradient_accumulation_steps=2"],
        rf"algo.gradient_accumulation_steps=2 has no effect.*Leave algo.gradient_accumulation_steps at null "
        rf"and {PRETRAIN_FIX}",
    ),
    "pretrain_batch_over_processes": (
        [PRETRAIN, "launcher=accelerate", "launcher.num_processes=2", "algo.pretrain.batch_size=7"],
        r"algo.pretrain.batch_size=7 must be divisible by the 2 processes",
    ),
    # 7. DGPO shares each group's σ: the draw option is not read
    "dgpo_timestep_draw": (
        ["algo=dgpo", "algo.forward.timestep_draw=per_microbatch"],
        r"algo.forward.timestep_draw=per_microbatch is not read by algo.forward.loss=dgpo.*Drop the override "
        r"\(algo.forward.timestep_draw=per_sample\)",
    ),
    # 8. the ODE solvers never take the sampler's step
    "nft_noise_level": (["algo=nft", "sampler.noise_level=0.5"], rf"sampler.noise_level=0.5: {ODE_SAMPLER}"),
    "awm_sampler_option": (
        ["algo=awm", "sampler=dance"],
        rf"sampler.kind=dance, sampler.noise_level=0.3: {ODE_SAMPLER}",
    ),
    "dgpo_euler_noise_level": (
        ["algo=dgpo", "algo.forward.solver=euler", "sampler.noise_level=0.5"],
        "algo.forward.solver=euler rolls out the deterministic ODE",
    ),
    "forward_logprob_reduce": (
        ["algo=nft", "algo.forward.solver=sde", "sampler.logprob_reduce=sum"],
        r"sampler.logprob_reduce=sum reduces SDE log-probabilities, which recipe=flow_forward never computes",
    ),
    "forward_sde_cps_noise": (
        ["algo=awm", "algo.forward.solver=sde", "sampler=cps", "sampler.noise_level=1.5"],
        r"sampler.kind=cps takes a noise level in \[0, 1\]",
    ),
    # 9. launcher=local starts no accelerate workers
    "local_mixed_precision": (
        ["launcher.mixed_precision=bf16"],
        r"launcher.mixed_precision=bf16 is accelerate's autocast of the workers it launches, and launcher=local "
        r"trains in this process without accelerate launch, so it would do nothing\. .*model.dtype",
    ),
}


@pytest.mark.parametrize(("overrides", "message"), list(REFUSED.values()), ids=list(REFUSED))
def test_a_setting_its_recipe_ignores_is_refused_at_the_boundary(overrides: list[str], message: str):
    with pytest.raises(UserError, match=message):
        _validate(*overrides)


ACCEPTED = {
    "dpo": ["algo=dpo"],
    "sft": ["algo=sft"],
    "sft_reads_the_advantage_keys": [
        "algo=sft", "algo.global_std=false", "algo.std_estimator=unbiased", "algo.adv_eps=1e-8",
    ],
    "sft_reads_its_own_pref_keys": ["algo=sft", "algo.pref.anchor_weight=0.1", "algo.pref.top_k=2"],
    "online_dpo": ["algo=dpo", "algo.pref.ref_update_step=2", "algo.pref.dpo_beta=50"],
    "pretrain": [PRETRAIN],
    "pretrain_sizes_its_own_batch": [
        PRETRAIN, "algo.pretrain.batch_size=32", "algo.pretrain.steps_per_epoch=10", "algo.sample_batch_size=12",
    ],
    # its sizes no longer tie the process count to the RL loop's unread batch geometry
    "pretrain_on_eight_processes": [PRETRAIN, "launcher=accelerate", "launcher.num_processes=8"],
    "pretrain_with_a_time_limit": [PRETRAIN, "time_limit_minutes=10"],
    "grpo_keeps_the_time_clock": ["lr_schedule_clock=time_or_epochs", "time_limit_minutes=10"],
    "grpo_keeps_cfg_grad": ["algo.cfg_grad=conditional"],
    "nft_keeps_cfg_grad": ["algo=nft", "algo.cfg_grad=conditional"],
    "awm_draws_per_microbatch": ["algo=awm"],
    "dgpo": ["algo=dgpo"],
    "nft_sde_reads_the_sampler": ["algo=nft", "algo.forward.solver=sde", "sampler=dance"],
    "awm_sde_cps": ["algo=awm", "algo.forward.solver=sde", "sampler=cps"],
    "accelerate_mixed_precision": ["launcher=accelerate", "launcher.num_processes=2", "launcher.mixed_precision=bf16"],
}  # fmt: skip


@pytest.mark.parametrize("overrides", list(ACCEPTED.values()), ids=list(ACCEPTED))
def test_what_the_refusals_leave_alone_still_composes(overrides: list[str]):
    _validate(*overrides)


def test_the_shipped_preference_and_pretraining_configs_keep_their_values():
    """DPO / SFT and pretraining compose the values the refusals hold them to (nothing shipped changed)."""
    for algo in ("dpo", "sft"):
        typed = _validate(f"algo={algo}")
        assert (typed.algo.cfg_grad, typed.algo.kl_weight, typed.algo.gradient_accumulation_steps) == (
            "both",
            0.0,
            None,
        )
    typed = _validate(PRETRAIN)
    algo = typed.algo
    assert (algo.group_size, algo.prompts_per_epoch, algo.sample_batch_size, algo.train_batch_size) == (
        2,
        32,
        16,
        16,
    )
    assert algo.gradient_accumulation_steps is None and typed.lr_schedule_clock == "epochs"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo=dpo", "algo.kl_weight=0.04"], "algo.kl_weight=0.04 is not read by recipe=flow_pref"),
        (["launcher.mixed_precision=fp16"], "launcher.mixed_precision=fp16 is accelerate's autocast"),
    ],
)
def test_a_refused_setting_exits_2_through_the_cli(tmp_path: Path, overrides: list[str], message: str):
    code, out = run_cli("train", "experiment=tiny_cpu", *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2, out
    assert message in " ".join(out.split()), out
