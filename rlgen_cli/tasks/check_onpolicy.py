"""``rlgen check-onpolicy``: prove that the training path reproduces the rollout's log-probabilities.

Rolls out one epoch, then recomputes every trained step's log-prob with the exact training code
(one batch per epoch, no update, no accumulation) and reports max |ratio − 1| and |Δ log p| per step and
σ. Exits 1 when any exceeds ``check.tolerance``: the sampler and the trainer disagree, and PPO's clip
would be silently eating that error.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
from omegaconf import DictConfig

from rlgen_cli.tasks.common import run_dir_of, user_errors, validated

EXIT_MISMATCH = 1


@user_errors
def check_onpolicy_task(cfg: DictConfig) -> float:
    typed = validated(cfg)
    from rlgen_cli.schema.r3 import is_r3
    from rlgen_cli.schema.vlm import VLM_FAMILIES

    if typed.model.family in VLM_FAMILIES:
        return _check_vlm(typed, cfg)
    if is_r3(typed.model):
        return _check_r3(typed, cfg)
    from rlgen_cli.recipes.flow_rl import FlowRLRecipe
    from rlgen_cli.recipes.sampling import batches
    from rlgen_cli.training.progress import Progress
    from rlgen_cli.training.run import prepare_run_dir, setup_logging

    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    recipe = FlowRLRecipe(typed, cfg)
    recipe.setup()
    check = typed.check
    spec = (
        recipe.spec if check.train_noise_level is None else replace(recipe.spec, eta=check.train_noise_level)
    )
    batch_size = check.train_batch_size or typed.algo.train_batch_size
    with Progress(typed.progress) as progress:
        rollouts = recipe.sample_epoch(0, progress)
    n, steps = len(rollouts.indices), rollouts.traj.num_steps
    ratio_err = torch.zeros(steps)
    logp_err = torch.zeros(steps)
    with torch.no_grad():
        for part in batches(n, batch_size):
            traj, cond = rollouts.traj.index(part), rollouts.cond.index(part)
            for j in range(steps):
                new_logp = recipe.step_logprob(traj, cond, j, spec)[0].logprob
                delta = (new_logp - traj.logprobs[:, j]).abs().max().cpu()
                ratio = (torch.exp(new_logp - traj.logprobs[:, j]) - 1).abs().max().cpu()
                logp_err[j] = torch.maximum(logp_err[j], delta)
                ratio_err[j] = torch.maximum(ratio_err[j], ratio)
    recipe.cleanup()
    worst = float(ratio_err.max().maximum(logp_err.max()))
    _report(rollouts.traj, ratio_err, logp_err, check.tolerance, worst)
    if worst > check.tolerance:
        sys.exit(EXIT_MISMATCH)
    return worst


def _check_vlm(typed, cfg: DictConfig) -> float:
    """Token-level check of the VLM recipe: the first inner epoch's ratio must be exactly 1."""
    from rlgen_cli.recipes.vlm_rl import check_onpolicy
    from rlgen_cli.training.run import prepare_run_dir, setup_logging

    setup_logging(prepare_run_dir(run_dir_of(typed), cfg))
    worst = check_onpolicy(typed, cfg)
    if worst > typed.check.tolerance:
        sys.exit(EXIT_MISMATCH)
    return worst


def _check_r3(typed, cfg: DictConfig) -> float:
    """Both tracks of a unified policy, in the reason (step 0) and the refine (step 1) stage."""
    from rlgen_cli.r3.onpolicy import check_stage, print_report
    from rlgen_cli.recipes.r3 import R3Recipe
    from rlgen_cli.training.run import prepare_run_dir, setup_logging

    setup_logging(prepare_run_dir(run_dir_of(typed), cfg))
    recipe = R3Recipe(typed, cfg)
    recipe.setup()
    try:
        rows = check_stage(recipe, 0) + check_stage(recipe, 1)
    finally:
        recipe.cleanup()
    worst = print_report(rows, typed.check.tolerance)
    if worst > typed.check.tolerance:
        sys.exit(EXIT_MISMATCH)
    return worst


def _report(traj, ratio_err: torch.Tensor, logp_err: torch.Tensor, tolerance: float, worst: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="on-policy check: training-path recompute vs rollout")
    for column in ("step", "σ", "σ next", "max |ratio − 1|", "max |Δ log p|"):
        table.add_column(column, justify="right")
    for j in range(len(ratio_err)):
        table.add_row(
            str(int(traj.step_indices[j])), f"{float(traj.sigmas[j]):.4f}", f"{float(traj.sigmas_next[j]):.4f}",
            f"{float(ratio_err[j]):.3e}", f"{float(logp_err[j]):.3e}",
        )  # fmt: skip
    console = Console()
    console.print(table)
    verdict = "[green]PASS[/]" if worst <= tolerance else "[bold red]FAIL[/]"
    console.print(f"{verdict} max error {worst:.3e} (tolerance {tolerance:.1e})")
