"""Registers the typed schemas in Hydra's ConfigStore.

Each primary config in ``conf/`` lists its schema first in its defaults (``_schema_<verb>``), so every
group option merges into a typed node and a misspelt key fails with its full name. ``train``,
``check_onpolicy`` and ``eval`` carry the ``r3`` section (``schema/r3.py``) next to the shared ones, as
``model.vlm`` and ``algo.token`` sit next to the flow keys.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from rlgen_cli.schema.flow import SampleConfig
from rlgen_cli.schema.r3 import R3CheckOnPolicyConfig, R3EvalConfig, R3TrainConfig
from rlgen_cli.schema.serve import ServeRewardConfig

PRIMARY_SCHEMAS = {
    "_schema_train": R3TrainConfig,
    "_schema_check_onpolicy": R3CheckOnPolicyConfig,
    "_schema_sample": SampleConfig,
    "_schema_eval": R3EvalConfig,
    "_schema_serve_reward": ServeRewardConfig,
}


def register_schemas() -> None:
    """Store every primary schema (idempotent: re-storing replaces the node)."""
    store = ConfigStore.instance()
    for name, node in PRIMARY_SCHEMAS.items():
        store.store(name=name, node=node)
