"""The recipe registry: every recipe is a module with the verbs the tasks ask for, and tasks/ never
branches on a recipe's name."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlgen_cli.errors import UserError
from rlgen_cli.recipes.registry import PLANNED_RECIPES, RECIPES, check_of, plan_of, recipe_module
from rlgen_cli.schema.recipes import TRAIN_SCHEMAS

TASKS = Path(__file__).parents[2] / "rlgen_cli" / "tasks"


def test_every_recipe_with_a_schema_is_a_module_that_runs_and_names_its_prompt_files():
    assert set(RECIPES) == set(TRAIN_SCHEMAS)
    for name in RECIPES:
        module = recipe_module(name)
        assert callable(module.run) and callable(module.splits_read), name


def test_an_unknown_recipe_is_refused_naming_the_recipes():
    with pytest.raises(UserError, match="recipe=flow_nope is not a recipe; the recipes are flow_grpo"):
        recipe_module("flow_nope")


def test_the_prompt_files_each_recipe_reads():
    flow = SimpleNamespace(eval_every=5)
    assert recipe_module("flow_grpo").splits_read(flow) == ("train", "test")
    assert recipe_module("vlm_rl").splits_read(SimpleNamespace(eval_every=0)) == ("train",)
    assert recipe_module("vlm_sft").splits_read(SimpleNamespace(eval_every=2)) == ("train", "test")
    assert recipe_module("r3").splits_read(flow) == ()  # r3.* data keys, not data.*


def test_only_recipes_with_rollouts_offer_an_onpolicy_check():
    for name in ("flow_grpo", "vlm_rl", "r3"):
        check, splits = check_of(SimpleNamespace(recipe=name))
        assert callable(check) and isinstance(splits, tuple)
    for name in ("flow_pref", "flow_forward", "flow_pretrain", "vlm_sft"):
        with pytest.raises(UserError, match=f"recipe={name} .* has none"):
            check_of(SimpleNamespace(recipe=name))


def test_the_planner_models_the_flow_recipes_alone():
    assert PLANNED_RECIPES == ("flow_grpo", "flow_pref", "flow_pretrain", "flow_forward")
    for name in RECIPES:
        assert (plan_of(SimpleNamespace(recipe=name)) is not None) == (name in PLANNED_RECIPES), name


def _plan_cfg(recipe: str, **algo) -> SimpleNamespace:
    defaults = dict(prompts_per_epoch=6, group_size=4, train_batch_size=4, timesteps_per_pass=3)
    launcher = SimpleNamespace(world_size=2)
    algo_ns = SimpleNamespace(**(defaults | algo), micro_batches_per_step=lambda world: 8)
    return SimpleNamespace(recipe=recipe, algo=algo_ns, launcher=launcher)


def test_plan_shapes_by_hand(monkeypatch: pytest.MonkeyPatch):
    from rlgen_cli.recipes import flow_grpo

    def window_training(steps: int) -> None:
        window = SimpleNamespace(train_steps=list(range(steps)))
        monkeypatch.setattr(flow_grpo, "planned_window", lambda cfg, batch: window)

    grpo = _plan_cfg("flow_grpo")
    shape = plan_of(grpo)
    assert shape.samples_per_epoch(grpo) == 24  # 6 prompts × 4
    assert shape.micro_batches_per_process(grpo) == 4  # 8 over 2 processes
    window_training(2)
    assert shape.folded_steps(grpo) == 2  # at most the window's trained steps
    window_training(5)
    assert shape.folded_steps(grpo) == 3  # at most timesteps_per_pass
    forward = _plan_cfg("flow_forward")
    assert plan_of(forward).weight_copies(forward) == ("old policy",)
    assert plan_of(forward).folded_steps(forward) == 1
    # DPO: a pair per group (6), micro-batches of min(4, 6) pairs, ⌈⌈6 / 4⌉ / 2⌉ = 1 per process, 2 rows a pair
    dpo = _plan_cfg("flow_pref", pref=SimpleNamespace(loss="dpo", ref_update_step=10, top_k=2))
    pref = plan_of(dpo)
    assert pref.micro_batch(dpo) == (4, "algo.train_batch_size")
    assert pref.micro_batches_per_process(dpo) == 1 and pref.rows_per_unit(dpo) == 2
    assert pref.weight_copies(dpo) == ("online DPO reference",) and pref.accumulation_setting is None
    # SFT: top_k 2 of each of 6 groups = 12 kept samples, ⌈⌈12 / 4⌉ / 2⌉ = 2 micro-batches per process
    sft = _plan_cfg("flow_pref", pref=SimpleNamespace(loss="sft", ref_update_step=0, top_k=2))
    assert pref.micro_batches_per_process(sft) == 2 and pref.micro_batch_unit(sft) == "kept samples"
    pretrain = _plan_cfg("flow_pretrain", pretrain=SimpleNamespace(batch_size=10))
    assert plan_of(pretrain).samples_per_epoch(pretrain) == 0
    assert plan_of(pretrain).micro_batch(pretrain) == (5, None)  # 10 over 2 processes


def test_tasks_never_branch_on_a_recipe_name():
    branch = re.compile(r"\brecipe\s*(==|!=|in\s*\(|not\s+in\s*\()")
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(TASKS.glob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if branch.search(line)
    ]
    assert not found, found
