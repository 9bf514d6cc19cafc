"""``rlgen check-onpolicy``: prove that the training path reproduces the log-probabilities the rollout
recorded while sampling.

Rolls out one epoch, then recomputes what was recorded with the exact training code (no update, no
accumulation) and exits 1 when the two disagree beyond the tolerance: the sampler and the trainer
disagree, and PPO's clip would be silently eating that error. Every track compares two computations:

* **flow models** — each trained step's log-prob stored by the rollout vs its recompute on the training
  path, per step and σ (``check.tolerance``);
* **VLMs** — the sampler's per-token log-probs (``generate``'s raw logits / vLLM's log-probs) vs the
  training forward (``check.text_tolerance``; ``vlm/onpolicy.py``);
* **unified policies (R3)** — both tracks in both stages (``r3/onpolicy.py``).

``check.perturb_weights`` adds noise to the trainable weights between the rollout and the recompute:
the check must then fail, which is how the tests show that it can.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from omegaconf import DictConfig

from rlgen_cli.errors import UserError
from rlgen_cli.sde.noise import Stream
from rlgen_cli.tasks.common import run_dir_of, user_errors, validated

log = logging.getLogger(__name__)
EXIT_MISMATCH = 1

Perturb = Callable[[Sequence[torch.nn.Parameter]], None]


def perturb_weights(params: Sequence[torch.nn.Parameter], std: float, seed: int) -> None:
    """Add N(0, std²) noise, drawn on the CPU from ``seed``, to every tensor of ``params`` in place (std 0:
    nothing). The check that follows must fail: this is ``check.perturb_weights``.

    Raises:
        UserError: When asked to perturb a model with no trainable weights (nothing could change).
    """
    if std == 0:
        return
    if not params:
        raise UserError("check.perturb_weights is set but the model has no trainable weights to perturb")
    generator = torch.Generator().manual_seed(seed + Stream.ONPOLICY_PERTURB)
    with torch.no_grad():
        for param in params:
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_(noise.to(device=param.device, dtype=param.dtype), alpha=std)
    log.warning("check.perturb_weights=%g: noise added to %d trainable tensors after the rollout; the check "
                "must fail", std, len(params))  # fmt: skip


@user_errors
def check_onpolicy_task(cfg: DictConfig) -> float:
    typed = validated(cfg)
    from rlgen_cli.training.reporting.run_dir import prepare_run_dir, setup_logging

    perturb = functools.partial(perturb_weights, std=typed.check.perturb_weights, seed=typed.seed)
    if typed.recipe not in ("flow_grpo", "vlm_rl", "r3"):
        raise UserError(
            f"check-onpolicy checks the RL recipes' rollouts; recipe={typed.recipe} (from the algo option) has "
            "none: use algo=grpo (flow models), algo=token_grpo or algo=step_grpo (VLMs)"
        )
    text = typed.recipe in ("vlm_rl", "r3")
    if text and typed.check.train_noise_level is not None:
        raise UserError(
            "check.train_noise_level recomputes flow steps at another noise level; it has no meaning for "
            f"model.family={typed.model.family} (use check.perturb_weights to see the check fail)"
        )
    run_dir = prepare_run_dir(run_dir_of(typed), cfg)
    setup_logging(run_dir)
    require_prerequisites(typed, run_dir, ("train",) if text else ("train", "test"))
    if typed.recipe == "vlm_rl":
        worst, passed = _check_vlm(typed, cfg, perturb)
    elif typed.recipe == "r3":
        worst, passed = _check_r3(typed, cfg, perturb)
    else:
        worst, passed = _check_flow(typed, cfg, perturb)
    if not passed:
        sys.exit(EXIT_MISMATCH)
    return worst


def require_prerequisites(cfg, run_dir, splits: tuple[str, ...]) -> None:
    """The prompt files it rolls out and the weights of every model it builds, all reported together
    with exit code 2 before any model is built (``tasks/prerequisites.py``, as ``rlgen train`` does).
    Rewards are not checked: the check scores nothing."""
    from rlgen_cli.tasks.prerequisites import Prerequisites, data_problems, model_problems

    Prerequisites().add(data_problems(cfg, run_dir, splits)).add(model_problems(cfg)).require()


def _check_flow(typed, cfg: DictConfig, perturb: Perturb) -> tuple[float, bool]:
    """Every trained step's stored log-prob vs its training-path recompute."""
    from rlgen_cli.recipes import flow_grpo, loop
    from rlgen_cli.sde.sampling import batches
    from rlgen_cli.training.reporting.progress import Progress

    run = loop.setup(typed, cfg)
    check = typed.check
    spec = loop.step_spec(typed)
    if check.train_noise_level is not None:
        spec = replace(spec, noise_level=check.train_noise_level)
    batch_size = check.train_batch_size or typed.algo.train_batch_size
    with Progress(typed.progress) as progress:
        rollouts = flow_grpo.sample_rollouts(run, 0, progress)  # no scoring: only the log-probs matter
    perturb(run.policy.trainable.parameters())
    n, steps = len(rollouts.indices), rollouts.traj.num_steps
    ratio_err = torch.zeros(steps)
    logp_err = torch.zeros(steps)
    with torch.no_grad():
        for part in batches(n, batch_size):
            traj, cond = rollouts.traj.index(part), rollouts.cond.index(part)
            every_step = [(j, slice(None)) for j in range(steps)]  # folded as the update folds them
            for fold in flow_grpo.step_folds(every_step, typed.algo.timesteps_per_pass):
                for (j, _), (out, _) in zip(fold, flow_grpo.folded_logprobs(run, traj, cond, fold, spec)):
                    new_logp = out.logprob
                    delta = (new_logp - traj.logprobs[:, j]).abs().max().cpu()
                    ratio = (torch.exp(new_logp - traj.logprobs[:, j]) - 1).abs().max().cpu()
                    logp_err[j] = torch.maximum(logp_err[j], delta)
                    ratio_err[j] = torch.maximum(ratio_err[j], ratio)
    run.logger.close()
    worst = float(ratio_err.max().maximum(logp_err.max()))
    _report(rollouts.traj, ratio_err, logp_err, check.tolerance, worst)
    return worst, worst <= check.tolerance


def _check_vlm(typed, cfg: DictConfig, perturb: Perturb) -> tuple[float, bool]:
    """Per-token log-probs of the rollout engine vs the training forward on the same completions."""
    from rlgen_cli.recipes.vlm_rl import VLMRLRecipe
    from rlgen_cli.vlm.onpolicy import check_rollout, print_report

    recipe = VLMRLRecipe(typed, cfg)
    recipe.setup()
    try:
        batch_size = typed.check.train_batch_size or typed.algo.train_batch_size
        rows = check_rollout(recipe, batch_size, perturb)
    finally:
        recipe.cleanup()
    worst = print_report(rows, typed.check.text_tolerance, recipe.engine.name)
    return worst, worst <= typed.check.text_tolerance


def _check_r3(typed, cfg: DictConfig, perturb: Perturb) -> tuple[float, bool]:
    """Both tracks of a unified policy, in the reason (step 0) and the refine (step 1) stage."""
    from rlgen_cli.r3.onpolicy import check_stage, print_report
    from rlgen_cli.recipes.r3 import R3Recipe

    recipe = R3Recipe(typed, cfg)
    recipe.setup()
    tolerances = typed.check.tolerance, typed.check.text_tolerance
    try:
        rows = check_stage(recipe, 0, perturb, *tolerances) + check_stage(recipe, 1, perturb, *tolerances)
    finally:
        recipe.cleanup()
    passed = print_report(rows)
    return max(row.error for row in rows), passed


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
