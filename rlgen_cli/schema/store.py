"""Registers the typed schemas in Hydra's ConfigStore.

Each primary config in ``conf/`` lists its schema first in its defaults (``_schema_<verb>``), so every
group option merges into a typed node and a misspelt key fails with its full name.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from rlgen_cli.schema.flow import CheckOnPolicyConfig, EvalConfig, SampleConfig, TrainConfig
from rlgen_cli.schema.serve import ServeRewardConfig

PRIMARY_SCHEMAS = {
    "_schema_train": TrainConfig,
    "_schema_check_onpolicy": CheckOnPolicyConfig,
    "_schema_sample": SampleConfig,
    "_schema_eval": EvalConfig,
    "_schema_serve_reward": ServeRewardConfig,
}


def register_schemas() -> None:
    """Store every primary schema (idempotent: re-storing replaces the node)."""
    store = ConfigStore.instance()
    for name, node in PRIMARY_SCHEMAS.items():
        store.store(name=name, node=node)
