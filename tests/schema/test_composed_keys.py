"""Each recipe composes only the keys it reads, and each model only the keys its family reads.

Two directions: (1) every experiment and canonical command composes, under the schema its ``recipe``
selects, no leaf key that schema lacks (Hydra's typed composition already refuses unknown keys; this
pins that the selected schema is the recipe's own, not a union of every recipe's); (2) every field of a
recipe's schema is read somewhere in that recipe's code path, found by name in the recipe module and the
modules it uses (other recipes' modules excluded). Model sections (``model``, R3's ``r3.policy.*``) are
checked per family: every key a model option composes is read by name in that family's code path.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from rlgen_cli._hydra import compose_verb, config_groups
from rlgen_cli.schema.families import FAMILY_TABLE
from rlgen_cli.schema.model import model_schema
from rlgen_cli.schema.recipes import FREE_FORM, TRAIN_SCHEMAS, declared_paths
from tests.schema.test_canonical import CASES

PACKAGE = Path(__file__).resolve().parents[2] / "rlgen_cli"
RECIPE_MODULES = set(TRAIN_SCHEMAS)

READ_GENERICALLY = {
    # run-wide keys every recipe hands to shared code: the CLI task, the launcher, the loggers
    "recipe", "run_dir", "launcher", "logging", "fidelity", "reward.weights", "reward.kwargs", "data.train",
    "data.test",
    # the window kind's options reach sde/window.plan_window by name (WindowConfig.options, WINDOW_OPTIONS)
    "algo.window",
}  # fmt: skip
"""Schema fields read by shared code whatever the recipe (prefix match); everything else must appear by
name in the recipe's own code path."""
MODEL_SECTIONS = ("model", "r3.policy")
"""The sections whose keys are those of a family: each family's read by that family's code path
(:func:`test_every_model_key_a_model_option_composes_is_read_by_its_family`), not the recipe's."""


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
    # R3: r3.steps_gen / steps_edit (schema/r3.py) read these for the recipe (r3.val_data_path, which
    # r3.data_paths() reads, is named by eval's refusal of data.test: tasks/evaluate.py R3_DATA)
    "r3": {"r3.num_timesteps_gen", "r3.num_timesteps_edit"},
}
"""Declared keys a recipe's code does not name, listed exactly: a new unread key fails, and so does an
entry that became read (remove it)."""


@pytest.mark.parametrize("recipe", sorted(TRAIN_SCHEMAS))
def test_every_schema_field_is_read_by_its_recipe(recipe: str):
    code = _code_path(recipe)
    generic = (*READ_GENERICALLY, *MODEL_SECTIONS)
    unread = {
        path
        for path in declared_paths(TRAIN_SCHEMAS[recipe])
        if not path.startswith(generic) and not _is_read(code, path.rsplit(".", 1)[-1])
    }
    assert unread == NOT_READ_BY_NAME.get(recipe, set()), f"recipe={recipe}: keys no code of its path reads"


@functools.cache
def _family_code_path(family: str) -> str:
    """The source a family's model can execute: every module but the other families' own modules, the
    packages of the other kinds of model (vlm/ for a VLM, r3/ for a unified family) and the schema."""
    row = FAMILY_TABLE[family]
    others = {r.module for r in FAMILY_TABLE.values() if r.module != row.module}
    texts = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        module = "rlgen_cli." + rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if any(module == o or module.startswith(o + ".") for o in others):
            continue
        if rel.startswith("vlm/") and row.kind != "vlm" or rel.startswith("r3/") and row.kind != "unified":
            continue
        if rel.startswith(("schema/", "server/")):
            continue
        texts.append(path.read_text())
    return "\n".join(texts)


def _model_sections(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """(key, section) of every model a composed run holds: ``model``, and R3's networks."""
    out = [("model", cfg.model)]
    policy = OmegaConf.select(cfg, "r3.policy")
    if policy is not None:
        out += [
            (f"r3.policy.{role}", policy[role]) for role in policy if isinstance(policy[role], DictConfig)
        ]
    return out


@pytest.mark.parametrize("option", config_groups()["model"])
def test_every_model_key_a_model_option_composes_is_read_by_its_family(option: str):
    cfg = compose_verb("train", [f"model={option}"])
    unread = []
    for key, section in _model_sections(cfg):
        assert OmegaConf.get_type(section) is model_schema(section.family), key  # its family's own keys
        code = _family_code_path(section.family)
        unread += [
            f"{key}.{leaf}" for leaf in _leaves(section) if not _is_read(code, leaf.rsplit(".", 1)[-1])
        ]
    assert not unread, f"model={option} composes model keys its family's code never reads: {unread}"


def test_a_family_composes_only_the_keys_its_row_calls_for():
    def model_keys(option: str) -> set[str]:
        return set(_leaves(compose_verb("train", [f"model={option}"]).model))

    image, video, two_experts = model_keys("tiny_sd3"), model_keys("tiny_wan2_1"), model_keys("tiny_wan2_2")
    assert "num_frames" in video and "num_frames" not in image
    assert {"experts.train", "experts.guidance_scale_2"} <= two_experts and not any(
        "experts" in k for k in video
    )
    assert "image_guidance_scale" in model_keys("tiny_bagel_edit") and "image_guidance_scale" not in image
    assert not any(k.startswith("vlm.") for k in image) and "vlm.max_pixels" in model_keys("tiny_qwen2_vl")
    assert "vae_dtype" in image and "vae_dtype" not in model_keys("shapes_base")
    assert {"weights", "variant", "text_encoders"} <= image and "weights" not in model_keys("tiny_flux2")


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
