"""``rlgen train``: validate, prepare the run directory, then run the recipe here or launch workers.

With ``launcher=local`` the recipe runs in this process. Otherwise this process is the controller: it
writes ``resolved.yaml`` and starts ``accelerate launch`` workers that read it (``launch/worker.py``),
then exits with their exit code.
"""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import DictConfig

from rlgen_cli.recipes.registry import recipe_of
from rlgen_cli.tasks.common import run_dir_of, user_errors, validated
from rlgen_cli.tasks.switched_off import refuse_switched_off


@user_errors
def train_task(cfg: DictConfig) -> Any:
    """Returns the last epoch's headline metric (eval reward when evaluated), for Hydra sweepers."""
    from rlgen_cli.training.reporting.console import print_job_header

    print_job_header()  # a sweep job says which overrides it runs before anything can fail
    typed = validated(cfg)
    refuse_switched_off(typed)
    from rlgen_cli.training.checkpoints.checkpoint import stop_cleanly, sweep_stale_temporaries
    from rlgen_cli.training.reporting.run_dir import RESOLVED_FILE, prepare_run_dir, setup_logging

    run_dir = run_dir_of(typed)
    with stop_cleanly(run_dir):  # a full disk or a non-finite reward: one line naming the last checkpoint
        sweep_stale_temporaries(run_dir)  # before anything is written: a killed save's space comes back
        prepare_run_dir(run_dir, cfg)  # builtin prompt sets are generated into it
        require_prerequisites(typed, run_dir)
        if typed.launcher.name != "local":
            from rlgen_cli.launch.commands import run_launch

            code = run_launch(typed.launcher, run_dir / RESOLVED_FILE)
            if code != 0:
                sys.exit(code)
            return None
        setup_logging(run_dir)
        metrics = recipe_of(typed).run(typed, cfg)
    return metrics.get("eval/reward/mean", metrics.get("reward/mean"))


def require_prerequisites(cfg: Any, run_dir: Any) -> None:
    """Prompt files, resume target, model weights, rewards and their servers: every missing one reported
    at once, before the launcher starts workers or any model is built (``tasks/prerequisites.py``)."""
    from rlgen_cli.tasks.prerequisites import (
        Prerequisites,
        data_problems,
        model_problems,
        resume_problems,
        reward_problems,
    )

    missing = Prerequisites().add(data_problems(cfg, run_dir, recipe_of(cfg).splits_read(cfg)))
    missing.add(resume_problems(cfg)).add(model_problems(cfg)).add(reward_problems(cfg)).require()
