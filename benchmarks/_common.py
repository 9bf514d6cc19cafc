"""Shared helpers for the benchmark scripts: set up a Flow-GRPO run from Hydra overrides without the CLI."""

from __future__ import annotations

import tempfile

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlgen_cli._hydra import conf_dir
from rlgen_cli.recipes.flow_run import FlowRun, setup
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.tasks.common import validated


def compose_recipe(overrides: list[str]) -> FlowRun:
    """A set-up training run composed from ``overrides`` alone (run dir in /tmp)."""
    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="train", overrides=["progress=false", *overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = tempfile.mkdtemp(prefix="rlgen-bench-")
    return setup(validated(cfg), cfg)


def build_recipe(overrides: list[str]) -> FlowRun:
    """A set-up training run for the tiny CPU demo (``experiment=tiny_cpu`` unless ``overrides`` name
    another experiment) plus ``overrides`` (run dir in /tmp)."""
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=tiny_cpu", *overrides]
    return compose_recipe(overrides)
