"""Every primary config, every group option and every experiment composes and validates."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlgen_cli._hydra import conf_dir, config_groups
from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.tasks.common import validated

register_schemas()
PRIMARY = ("train", "check_onpolicy", "sample", "eval")
GROUPS = config_groups()


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name=name, overrides=overrides, return_hydra_config=False)
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = "/tmp/unused"
    return cfg


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_configs_validate(name):
    overrides = ["prompts=[a cat]"] if name == "sample" else []
    validated(_compose(name, overrides))


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in ("model", "algo", "reward", "sampler", "data", "launcher") for o in GROUPS[g]],
)
def test_every_group_option_validates_for_train(group, option):
    # multi-process launchers need a global batch that splits into whole per-process batches
    geometry = ["algo.prompts_per_epoch=16"] if group == "launcher" else []
    validated(_compose("train", [f"{group}={option}", *geometry]))


@pytest.mark.parametrize("experiment", GROUPS["experiment"])
def test_every_experiment_validates(experiment):
    validated(_compose("train", [f"experiment={experiment}"]))


def test_window_longer_than_steps_is_rejected():
    with pytest.raises(UserError, match="timestep_fraction"):
        validated(_compose("train", ["model.num_steps=1", "algo.window.timestep_fraction=0.5"]))


def test_upstream_logprob_form_needs_cps():
    with pytest.raises(UserError, match="only exists for sampler.kind=cps"):
        validated(_compose("train", ["sampler.logprob_form=upstream"]))
    validated(_compose("train", ["sampler=cps", "sampler.logprob_form=upstream"]))
