"""Every primary config, every group option and every experiment composes and validates."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlgen_cli._hydra import compose_verb, conf_dir, config_groups, verb_overrides
from rlgen_cli.errors import UserError
from rlgen_cli.schema.model import family_kind, option_family
from rlgen_cli.schema.r3 import R3_FAMILIES
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.tasks.common import validated

register_schemas()
PRIMARY = ("train", "check_onpolicy", "sample", "eval", "serve_reward")
GROUPS = config_groups()


def _compose(name: str, overrides: list[str]):
    cfg = compose_verb(name, overrides)  # what `rlgen <verb> OVERRIDES` composes
    OmegaConf.set_struct(cfg, False)
    if "run_dir" in cfg:  # serve-reward has none
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
    geometry = (
        [
            "algo.prompts_per_epoch=16",
            "algo.sample_batch_size=8",
            "algo.train_batch_size=8",
            "algo.gradient_accumulation_steps=null",  # one micro-batch per process, on any process count
        ]
        if group == "launcher"
        else []
    )
    vlm_model = ["model=tiny_qwen2_vl"] if group == "algo" and option not in FLOW_ALGOS else []  # its kind
    validated(_compose("train", [f"{group}={option}", *geometry, *vlm_model]))


def test_an_algorithm_of_another_kind_of_model_stops_at_compose_time():
    with pytest.raises(Exception, match="Sd3ModelConfig is not a subclass of VlmModelConfig"):
        _compose("train", ["algo=step_grpo"])  # a VLM recipe on the default SD3


@pytest.mark.parametrize("experiment", GROUPS["experiment"])
def test_every_experiment_validates(experiment):
    primary = "eval" if experiment.endswith("_eval") else "train"  # shapes_eval is an `rlgen eval` one
    validated(_compose(primary, [f"experiment={experiment}"]))


def test_window_longer_than_steps_is_rejected():
    with pytest.raises(UserError, match="timestep_fraction"):
        validated(_compose("train", ["algo=grpo", "model.num_steps=1", "algo.window.timestep_fraction=0.5"]))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("algo.lr_schedule=step", "algo.lr_schedule"),
        ("algo.lr_decay_start=1.0", "lr_decay_start must be in"),
        ("algo.lr_min_ratio=-0.1", r"algo.lr_min_ratio must be in \[0, 1\], got -0.1"),
    ],
)
def test_bad_lr_schedules_are_rejected(override, match):
    with pytest.raises(UserError, match=match):
        validated(_compose("train", [override]))


@pytest.mark.parametrize(
    ("recipe", "override", "own"),
    [
        ("model=tiny_qwen2_vl", "algo.lr_warmup_epochs=3", "algo.token.lr_schedule"),
        ("model=tiny_qwen2_vl algo=vlm_sft", "algo.lr_min_ratio=0.1", "algo.token.lr_schedule"),
        ("experiment=shapes_pretrain", "algo.lr_schedule=cosine", "algo.pretrain.warmup_steps"),
    ],
)
def test_recipes_with_their_own_schedule_refuse_the_per_epoch_one(recipe, override, own):
    """The VLM and pretraining recipes schedule per step; the flow RL loop's per-epoch keys would be
    silently ignored there, so they are refused with the recipe's own keys named."""
    validated(_compose("train", recipe.split()))
    with pytest.raises(UserError, match=rf"{override.split('=')[0]}=.* does not read; its schedule is {own}"):
        validated(_compose("train", [*recipe.split(), override]))
    validated(_compose("train", ["algo=grpo", override]))  # the flow RL loop reads it


def test_upstream_logprob_form_needs_cps():
    with pytest.raises(UserError, match="only exists for sampler.kind=cps"):
        validated(_compose("train", ["sampler.logprob_form=upstream"]))
    validated(_compose("train", ["sampler=cps", "sampler.logprob_form=upstream"]))


def _family(model: str) -> str | None:
    """``model.family`` of a model option (a ``_global_`` package nests it under ``model``)."""
    return option_family(OmegaConf.load(conf_dir() / "model" / f"{model}.yaml"))


R3_MODELS = tuple(m for m in GROUPS["model"] if _family(m) in R3_FAMILIES)  # own r3.* keys: no algo
FLOW_MODELS = [m for m in GROUPS["model"] if family_kind(_family(m)) == "flow"]  # the flow recipes' models
FLOW_ALGOS = [a for a in GROUPS["algo"] if a not in ("token_grpo", "step_grpo", "vlm_sft")]


def _geometry(overrides: list[str]) -> list[str]:
    """The common batch geometry, as far as the chosen algorithm's recipe reads it: DPO / SFT take no
    accumulation setting (one optimizer step over the epoch), pretraining none of the RL loop's."""
    algo = next((o.removeprefix("algo=") for o in overrides if o.startswith("algo=")), None)
    if algo == "flow_pretrain":
        return []
    accumulation = [] if algo in ("dpo", "sft") else ["algo.gradient_accumulation_steps=1"]
    return ["algo.prompts_per_epoch=8", *accumulation]


def _compose_all(combos: list[list[str]]) -> None:
    """Compose and validate every override list (one Hydra context); fail naming every one that fails."""
    failures = []
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        for overrides in combos:
            cfg = compose(
                config_name="train", overrides=verb_overrides("train", [*overrides, *_geometry(overrides)])
            )
            OmegaConf.set_struct(cfg, False)
            cfg.run_dir = "/tmp/unused"
            try:
                validated(cfg)
            except UserError as err:
                failures.append(f"{overrides}: {err}")
    assert not failures, "\n".join(failures)


def test_every_flow_model_and_every_algorithm_and_reward_with_two_models():
    """Every model with GRPO; every algorithm and every reward with a real and a tiny model (the full
    model × algorithm product is the slow test below)."""
    combos = [[f"model={m}", "algo=grpo"] for m in FLOW_MODELS]
    combos += [[f"model={m}", f"algo={a}"] for m in ("flux", "tiny_sd3") for a in FLOW_ALGOS]
    combos += [[f"model={m}", f"reward={r}"] for m in ("flux", "tiny_sd3") for r in GROUPS["reward"]]
    _compose_all(combos)


@pytest.mark.slow
def test_every_flow_model_with_every_flow_algorithm_composes():
    _compose_all([[f"model={m}", f"algo={a}"] for m in FLOW_MODELS for a in FLOW_ALGOS])


def test_the_issue_command_composes():
    validated(_compose("train", ["model=flux", "algo=grpo_fast", "reward=geneval"]))
