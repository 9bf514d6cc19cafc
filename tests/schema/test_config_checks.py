"""Config-only checks run when the config is typed, before any model loads (``__post_init__``)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlgen_cli._hydra import compose_verb
from rlgen_cli.errors import UserError
from rlgen_cli.tasks.common import validated


def _typed(*overrides: str):
    cfg = compose_verb("train", ["experiment=tiny_cpu", *overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = "/tmp/unused"
    return validated(cfg)


@pytest.mark.parametrize(
    "launcher", ["launcher=accelerate launcher.num_processes=2", "launcher=fsdp launcher.num_processes=1"]
)
@pytest.mark.parametrize("option", ["algo.window.kind=random_subset", "algo.best_of_n=1"])
def test_per_sample_step_counts_are_refused_where_ranks_must_agree(launcher: str, option: str):
    with pytest.raises(UserError, match="single-process for now"):
        _typed(*launcher.split(), option)


@pytest.mark.parametrize("launcher", ["launcher=local", "launcher=deepspeed_zero2 launcher.num_processes=1"])
def test_one_process_holding_whole_weights_may_train_per_sample_steps(launcher: str):
    typed = _typed(*launcher.split(), "algo.best_of_n=1")
    assert typed.algo.best_of_n == 1


def test_a_family_override_that_would_change_the_keys_is_refused():
    with pytest.raises(UserError, match="model.family=wan2_1 has keys of its own .Wan21ModelConfig."):
        _typed("model.family=wan2_1")  # tiny_cpu composes the tiny SD3: no num_frames to read


@pytest.mark.parametrize(
    ("overrides", "dtype"),
    [
        (["model=tiny_qwen2_vl", "model.dtype=bfloat16"], "bfloat16"),
        (["model=tiny_r3", "r3.policy.text.dtype=bfloat16"], "bfloat16"),  # R3: its text policy's dtype
        (["model=tiny_r3"], "float32"),
    ],
)
def test_the_text_tolerance_defaults_from_the_text_policys_dtype(overrides: list[str], dtype: str):
    from rlgen_cli.schema.check import TEXT_TOLERANCES

    cfg = compose_verb("check_onpolicy", overrides)
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = "/tmp/unused"
    assert validated(cfg).check.text_tolerance == TEXT_TOLERANCES[dtype]


def test_a_family_override_that_keeps_the_keys_is_taken():
    assert _typed("model.family=flux").model.family == "flux"  # FLUX.1 reads the keys SD3 does
