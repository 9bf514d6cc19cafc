"""Registers the typed schemas in Hydra's ConfigStore.

Each primary config in ``conf/`` lists its schema first in its defaults, so every group option merges
into a typed node and a misspelt key fails with its full name. ``sample`` and ``serve_reward`` have one
schema (``_schema_<verb>``). ``train``, ``check_onpolicy``, ``eval`` and ``plan`` start from the ``recipe`` group
(``- recipe@_global_: flow_grpo``), whose options are that verb's schema per recipe
(``schema/recipes.py``): an ``algo`` or ``model`` option that trains with another recipe overrides it, so a
run composes only the keys its recipe reads. A model YAML picks its family's schema the same way
(``- /model_schema@_here_: sd3``: ``schema/model.py``; R3's policy ``- /r3_policy@r3.policy: r3_composite``),
so it composes only the keys its family reads. One process composes one verb, so the ``recipe`` group holds
the nodes of the verb being composed (:func:`register_schemas`).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from rlgen_cli.schema.model import FAMILY_SCHEMAS
from rlgen_cli.schema.plan import PLAN_SCHEMAS
from rlgen_cli.schema.r3 import R3_POLICY_SCHEMAS
from rlgen_cli.schema.recipes import CHECK_SCHEMAS, EVAL_SCHEMAS, TRAIN_SCHEMAS
from rlgen_cli.schema.run import SampleConfig
from rlgen_cli.schema.serve import ServeRewardConfig

PRIMARY_SCHEMAS = {
    "_schema_sample": SampleConfig,
    "_schema_serve_reward": ServeRewardConfig,
}
RECIPE_SCHEMAS = {
    "train": TRAIN_SCHEMAS, "check_onpolicy": CHECK_SCHEMAS, "eval": EVAL_SCHEMAS, "plan": PLAN_SCHEMAS,
}  # fmt: skip
"""verb → {recipe: the schema that verb composes for it}."""


def register_schemas(verb: str = "train") -> None:
    """Store the primary schemas and ``verb``'s recipe schemas (idempotent: re-storing replaces a node)."""
    store = ConfigStore.instance()
    for name, node in PRIMARY_SCHEMAS.items():
        store.store(name=name, node=node)
    for recipe, node in RECIPE_SCHEMAS.get(verb, TRAIN_SCHEMAS).items():
        store.store(group="recipe", name=recipe, node=node)
    for family, node in FAMILY_SCHEMAS.items():
        store.store(group="model_schema", name=family, node=node)
    for family, node in R3_POLICY_SCHEMAS.items():
        store.store(group="r3_policy", name=family, node=node)


def all_schemas() -> list[type]:
    """Every primary schema of every verb (what the range checks walk)."""
    return [
        *PRIMARY_SCHEMAS.values(),
        *(node for nodes in RECIPE_SCHEMAS.values() for node in nodes.values()),
    ]
