"""Which module runs a recipe, and what every recipe module offers the verbs: the one place that turns the
composed ``recipe`` key (set by the algo or model option) into code.

A recipe module (``rlgen_cli/recipes/<recipe>.py``) is a :class:`RecipeModule`: ``run`` trains,
``splits_read`` names the prompt files the run reads (checked before any model loads); a recipe with
rollouts to check offers ``check_onpolicy`` and the prompt files it reads (``ONPOLICY_SPLITS``); a flow
recipe offers the planner its training shape (``PLAN``, ``recipes/plan_shape.py``). The verbs in
``tasks/`` ask the module, never the recipe's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Protocol

from omegaconf import DictConfig

from rlgen_cli.errors import UserError
from rlgen_cli.schema.recipes import TRAIN_SCHEMAS, FlowRunConfig

RECIPES = tuple(TRAIN_SCHEMAS)
"""Every recipe (each with its schema), each the module of its name in this package."""
PLANNED_RECIPES = tuple(name for name, schema in TRAIN_SCHEMAS.items() if issubclass(schema, FlowRunConfig))
"""The recipes ``rlgen plan`` models: the flow recipes, each offering its ``PLAN``."""

Perturb = Callable[[Sequence[Any]], None]
"""``check.perturb_weights``' noise, applied to the trainable tensors after the rollout."""


class RecipeModule(Protocol):
    """What ``tasks/`` reads of a recipe module (``check_onpolicy``, ``ONPOLICY_SPLITS`` and ``PLAN`` only
    where the recipe has them: :func:`check_of`, :func:`plan_of`)."""

    def run(self, cfg: Any, raw_cfg: DictConfig) -> dict[str, Any]:
        """Train; the last epoch's metrics."""

    def splits_read(self, cfg: Any) -> tuple[str, ...]:
        """The prompt files (``data.train``, ``data.test``) ``rlgen train`` reads with this config."""


def recipe_module(name: str) -> RecipeModule:
    """The module of recipe ``name`` (the schema has checked it is one of :data:`RECIPES`)."""
    if name not in RECIPES:
        raise UserError(f"recipe={name} is not a recipe; the recipes are {', '.join(RECIPES)}")
    module: ModuleType = importlib.import_module(f"rlgen_cli.recipes.{name}")
    return module  # type: ignore[return-value]


def recipe_of(cfg: Any) -> RecipeModule:
    """The module of the run's recipe."""
    return recipe_module(cfg.recipe)


def check_of(cfg: Any) -> tuple[Callable[[Any, DictConfig, Perturb], tuple[float, bool]], tuple[str, ...]]:
    """``rlgen check-onpolicy``'s check of the run's recipe and the prompt files it reads.

    Raises:
        UserError: When the recipe has no rollouts to check.
    """
    module = recipe_of(cfg)
    check = getattr(module, "check_onpolicy", None)
    if check is None:
        raise UserError(
            f"check-onpolicy checks the RL recipes' rollouts; recipe={cfg.recipe} (from the algo option) has "
            "none: use algo=grpo (flow models), algo=token_grpo or algo=step_grpo (VLMs)"
        )
    return check, module.ONPOLICY_SPLITS  # type: ignore[attr-defined]


def plan_of(cfg: Any) -> Any | None:
    """The run's recipe's training shape for ``rlgen plan`` (``recipes/plan_shape.py``); None when the
    planner does not model it."""
    return getattr(recipe_of(cfg), "PLAN", None)
