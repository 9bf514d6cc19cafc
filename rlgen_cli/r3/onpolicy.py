"""``rlgen check-onpolicy`` for unified policies: both tracks, in both stages, against what the rollout
recorded while sampling.

Runs the recipe's own rollouts — step 0 (reason) and step 1 (refine, from the buffer step 0 filled) —
then, with gradients enabled as in training but without an update, recomputes on the training path

* **text** — every completion token's log-prob (the training layout, full forward; the DDP wrapper when
  there is one) against the sampler's own: ``generate``'s raw logits at temperature 1 with the vision
  tokens masked, the very quantity training uses, computed by KV-cache decoding (``vlm/onpolicy.py``
  explains why the temperature and the processors drop out). Tolerance ``check.text_tolerance``.
* **image** — the log-prob of each image's stochastic step, recomputed through the same ``velocity`` (CFG
  recombined as in the rollout) against the one recorded while sampling. Tolerance ``check.tolerance``.

π_old of the text track is the training forward itself (right after the rollout), so it is never what
this check compares against. ``perturb`` runs between each rollout and its recompute (the weights of both
tracks: ``check.perturb_weights``), and any track whose weights moved must then fail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlgen_cli.r3.policy import IMAGE, TEXT
from rlgen_cli.r3.rollout import micro_batches
from rlgen_cli.vlm.onpolicy import sampler_gaps

__all__ = ["CheckRow", "check_stage", "print_report"]


@dataclass(frozen=True)
class CheckRow:
    """One (stage, track) line of the report."""

    stage: str
    track: str
    rows: int
    ratio_error: float
    logp_error: float
    tolerance: float

    @property
    def error(self) -> float:
        return max(self.ratio_error, self.logp_error)

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance


def _text_row(recipe, batch, tolerance: float) -> CheckRow:
    thoughts, ratio_err, logp_err = batch.thoughts, 0.0, 0.0
    for rows in micro_batches(len(thoughts), recipe.geometry.micro_batch):
        tokens = recipe.policy.token_batch(thoughts, rows)
        trained = recipe.policy.token_logprobs(tokens)
        for ratio, delta in sampler_gaps(trained, tokens.completion_mask, thoughts.sampler_logprobs[rows]):
            ratio_err, logp_err = max(ratio_err, ratio), max(logp_err, delta)
    return CheckRow(batch.stage, "text", len(thoughts), ratio_err, logp_err, tolerance)


def _image_row(recipe, batch, tolerance: float) -> CheckRow:
    ratio_err, logp_err = 0.0, 0.0
    for rollout in batch.images:  # one per group this process holds, each with its own SDE step
        if not rollout.traj.num_steps:
            continue
        for rows in micro_batches(len(rollout.images), recipe.geometry.micro_batch):
            traj = rollout.traj.index(rows)
            out, _ = recipe.image_step(traj, rollout.cond.index(rows), rollout.spec)
            delta = out.logprob.detach() - traj.logprobs[:, 0]
            ratio_err = max(ratio_err, (torch.exp(delta) - 1).abs().max().item())
            logp_err = max(logp_err, delta.abs().max().item())
    steps = sorted({rollout.sde_step for rollout in batch.images if rollout.traj.num_steps})
    named = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
    track = f"image, {named}" if steps else "image, no SDE"
    return CheckRow(batch.stage, track, len(batch.positions), ratio_err, logp_err, tolerance)


def check_stage(
    recipe,
    step: int,
    perturb: Callable[[list[torch.nn.Parameter]], None],
    tolerance: float,
    text_tolerance: float,
) -> list[CheckRow]:
    """Roll out ``step`` with the recipe, ``perturb`` the trainable weights of both tracks (a no-op unless
    testing), then check the text and the image track (no update)."""
    batch = recipe.rollout_reason(step) if step % 2 == 0 else recipe.rollout_refine(step)
    perturb(recipe.policy.trainable_parameters(TEXT) + recipe.policy.trainable_parameters(IMAGE))
    return [_text_row(recipe, batch, text_tolerance), _image_row(recipe, batch, tolerance)]


def print_report(rows: list[CheckRow]) -> bool:
    """Rich table of the rows and the verdict; True when every row is within its tolerance."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="on-policy check (R3): training path vs the log-probs recorded while sampling (max)")
    for column in ("stage", "track", "rows", "|ratio − 1|", "|Δ log p|", "tol.", "verdict"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.stage,
            row.track,
            str(row.rows),
            f"{row.ratio_error:.3e}",
            f"{row.logp_error:.3e}",
            f"{row.tolerance:.1e}",
            "ok" if row.passed else "FAIL",
        )
    passed = all(row.passed for row in rows)
    worst = max(rows, key=lambda row: row.error / row.tolerance)
    console = Console()
    console.print(table)
    verdict = "[green]PASS[/]" if passed else "[bold red]FAIL[/]"
    console.print(
        f"{verdict} worst: {worst.stage} {worst.track}, max error {worst.error:.3e} "
        f"(tolerance {worst.tolerance:.1e})"
    )
    return passed
