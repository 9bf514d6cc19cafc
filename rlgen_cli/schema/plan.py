"""Schema of ``rlgen plan``: a recipe's training config plus the ``plan`` section.

``rlgen plan`` composes exactly what ``rlgen train`` composes (the same groups, overrides and recipe
schema, ``schema/recipes.py``) and adds ``plan``: the device to fit and how to print the result
(``tasks/plan.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Literal

from rlgen_cli.schema.ranges import BELOW_ONE, POSITIVE
from rlgen_cli.schema.recipes import TRAIN_SCHEMAS

__all__ = ["PLAN_SCHEMAS", "PlanFormat", "PlanOptions", "PlanSection"]

PlanFormat = Literal["table", "json"]
"""``plan.format``: a rich table per component, or one JSON object (for scripts)."""


@dataclass
class PlanOptions:
    device_memory_gb: Annotated[float, POSITIVE] = 80.0
    """Memory of one device in GiB (2³⁰ bytes), e.g. 80 for an 80 GB A100 / H100, 141 for an H200."""
    headroom: Annotated[float, BELOW_ONE] = 0.1
    """Share of the device kept free for what the plan does not count: the CUDA context and the
    allocator's fragmentation."""
    format: Annotated[str, PlanFormat] = "table"
    """``table`` (rich, per component) or ``json`` (one object on stdout)."""
    reward_memory_gb: Annotated[dict[str, float], POSITIVE] = field(default_factory=dict)
    """{reward name: GiB it keeps on the device}: the size of a reward model the plan cannot build to
    count (one that loads on its first score), declared so the plan counts it instead of refusing."""


@dataclass
class PlanSection:
    """Mixed into a recipe's training schema: ``rlgen plan``'s config."""

    plan: PlanOptions = field(default_factory=PlanOptions)


def _plan_schema(train: type) -> type:
    name = f"{train.__name__.removesuffix('TrainConfig')}PlanConfig"
    cls = dataclasses.make_dataclass(name, [], bases=(PlanSection, train))
    cls.__module__ = __name__  # found where it is built (type hints, error messages)
    return cls


PLAN_SCHEMAS: dict[str, type] = {recipe: _plan_schema(cls) for recipe, cls in TRAIN_SCHEMAS.items()}
"""``recipe`` → the schema of ``rlgen plan`` with that recipe."""
