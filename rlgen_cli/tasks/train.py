"""``rlgen train``: validate, prepare the run directory, run the recipe in this process."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from rlgen_cli.tasks.common import run_dir_of, user_errors, validated


@user_errors
def train_task(cfg: DictConfig) -> Any:
    """Returns the last epoch's headline metric (eval reward when evaluated), for Hydra sweepers."""
    typed = validated(cfg)
    import importlib

    from rlgen_cli.training.run import prepare_run_dir, setup_logging

    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    recipe = importlib.import_module(f"rlgen_cli.recipes.{typed.algo.recipe}")
    metrics = recipe.run(typed, cfg)
    return metrics.get("eval/reward/mean", metrics.get("reward/mean"))
