"""Each recipe composes only the keys it reads.

Two directions: (1) every experiment and canonical command composes, under the schema its ``recipe``
selects, no leaf key that schema lacks (Hydra's typed composition already refuses unknown keys; this
pins that the selected schema is the recipe's own, not a union of every recipe's); (2) every field of a
recipe's schema is read somewhere in that recipe's code path, found by name in the recipe module and the
modules it uses (other recipes' modules excluded).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from rlgen_cli._hydra import compose_verb, config_groups
from rlgen_cli.schema.recipes import FREE_FORM, TRAIN_SCHEMAS, declared_paths
from tests.schema.test_canonical import CASES

PACKAGE = Path(__file__).resolve().parents[2] / "rlgen_cli"
RECIPE_MODULES = set(TRAIN_SCHEMAS)

READ_GENERICALLY = {
    # run-wide keys every recipe hands to shared code: the CLI task, the launcher, the loggers
    "recipe", "run_dir", "launcher", "logging", "fidelity", "model.family", "model.path", "model.tiny",
    "model.tiny_seed", "model.local_files_only", "model.revision", "model.lora", "reward.weights",
    "reward.kwargs", "data.train", "data.test",
    # model.* is one schema for every family; the flow keys below are read by models/, the VLM keys by vlm/
    "model",
    # the window kind's options reach sde/window.plan_window by name (WindowConfig.options, WINDOW_OPTIONS)
    "algo.window",
    # the text policy of R3 is an ordinary model section (its flow keys unread there, as for any VLM)
    "r3.policy",
}  # fmt: skip
"""Schema fields read by shared code whatever the recipe (prefix match); everything else must appear by
name in the recipe's own code path."""


def _runs() -> list[str]:
    experiments = [f"experiment={e}" for e in config_groups()["experiment"] if not e.endswith("_eval")]
    return experiments + [case.args for case in CASES]


def _leaves(cfg: DictConfig, prefix: str = "") -> list[str]:
    out = []
    for key in cfg:
        path = f"{prefix}{key}"
        if path in FREE_FORM:
            continue
        value = cfg._get_node(key)
        if isinstance(value, DictConfig) and not value._is_none():
            out += _leaves(value, path + ".")
        else:
            out.append(path)
    return out


def unread_keys(args: str) -> tuple[str, list[str]]:
    """(recipe, composed leaf keys its schema does not declare) of ``rlgen train ARGS``."""
    cfg = compose_verb("train", args.split())
    recipe = cfg.recipe
    declared = declared_paths(TRAIN_SCHEMAS[recipe])
    assert OmegaConf.get_type(cfg) is TRAIN_SCHEMAS[recipe]
    return recipe, [key for key in _leaves(cfg) if key not in declared]


@pytest.mark.parametrize("args", _runs())
def test_every_composed_key_is_one_its_recipe_declares(args: str):
    recipe, extra = unread_keys(args)
    assert not extra, f"rlgen train {args} (recipe={recipe}) composes keys its recipe never reads: {extra}"


@pytest.mark.parametrize(
    ("args", "recipe", "absent"),
    [
        ("algo=dpo", "flow_pref", ["algo.window", "algo.kl_form", "algo.clip_range"]),
        ("algo=sft", "flow_pref", ["algo.window", "algo.objective"]),
        ("model=tiny_qwen2_vl", "vlm_rl", ["sampler", "algo.window", "algo.ema", "time_limit_minutes"]),
        ("model=tiny_r3", "r3", ["algo", "sampler", "eval_before"]),
        ("experiment=shapes_pretrain", "flow_pretrain", ["sampler", "algo.window", "images_every"]),
        ("algo=nft", "flow_forward", ["algo.window", "algo.pref"]),
    ],
)
def test_a_recipe_composes_no_section_of_another(args: str, recipe: str, absent: list[str]):
    cfg = compose_verb("train", args.split())
    assert cfg.recipe == recipe
    for key in absent:
        assert OmegaConf.select(cfg, key, default="<absent>") == "<absent>", key


@functools.cache
def _code_path(recipe: str) -> str:
    """The source a recipe's run can execute: every module but the other recipes and the other model
    kinds' packages (R3's under r3/, the VLM's under vlm/), and the schema that declares the keys."""
    texts = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("recipes/") and path.stem in RECIPE_MODULES and path.stem != recipe:
            continue
        if rel.startswith("r3/") and recipe != "r3":
            continue
        if rel.startswith("vlm/") and not recipe.startswith("vlm"):
            continue
        if rel.startswith(("schema/", "server/", "tasks/sample", "tasks/serve")):
            continue
        texts.append(path.read_text())
    return "\n".join(texts)


def _is_read(code: str, name: str) -> bool:
    return re.search(rf"\.{name}\b|[\"']{name}[\"']|\b{name}=", code) is not None


NOT_READ_BY_NAME = {
    # R3: r3.steps_gen / steps_edit and r3.data_paths() (schema/r3.py) read these for the recipe
    "r3": {"r3.num_timesteps_gen", "r3.num_timesteps_edit", "r3.val_data_path"},
}
"""Declared keys a recipe's code does not name, listed exactly: a new unread key fails, and so does an
entry that became read (remove it)."""


@pytest.mark.parametrize("recipe", sorted(TRAIN_SCHEMAS))
def test_every_schema_field_is_read_by_its_recipe(recipe: str):
    code = _code_path(recipe)
    generic = tuple(READ_GENERICALLY)
    unread = {
        path
        for path in declared_paths(TRAIN_SCHEMAS[recipe])
        if not path.startswith(generic) and not _is_read(code, path.rsplit(".", 1)[-1])
    }
    assert unread == NOT_READ_BY_NAME.get(recipe, set()), f"recipe={recipe}: keys no code of its path reads"


def test_an_override_of_a_key_the_recipe_does_not_read_fails(tmp_path: Path, capsys):
    from tests.conftest import run_cli

    code, out = run_cli("train", "algo=dpo", "algo.window.size=3", f"hydra.run.dir={tmp_path}")
    err = out + capsys.readouterr().err
    assert code == 2
    assert "algo.window.size" in err and "FlowPrefAlgoConfig" in err, err
    assert "not a setting of this run's recipe (flow_pref" in err and "flow_grpo" in err, err


def test_the_hint_names_only_recipes_that_have_the_key():
    from rlgen_cli._hydra import other_recipes_hint

    assert other_recipes_hint("train", ["algo=dpo", "algo.window.size=3"]).startswith("algo.window.size")
    assert other_recipes_hint("train", ["algo=grpo", "algo.window.size=3"]) is None  # flow_grpo has it
    assert other_recipes_hint("train", ["algo=dpo", "algo.no_such_key=3"]) is None  # nobody has it
