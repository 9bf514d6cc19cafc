"""``rlgen check-onpolicy`` for unified policies: both tracks at ratio exactly 1, in both stages.

Runs the recipe's own rollouts — step 0 (reason) and step 1 (refine, from the buffer step 0 filled) —
then, with gradients enabled as in training but without an update, recomputes

* **text** — every completion token's log-prob on the training path (the DDP wrapper, when there is one)
  against π_old recorded right after the rollout, and reports the gap to the sampler's own raw-logit
  log-probs (KV cache vs full forward; informative only);
* **image** — the log-prob of each image's stochastic step, recomputed through the same ``velocity`` (CFG
  recombined as in the rollout) against the one recorded while sampling.

The worst |ratio − 1| over both tracks and stages must stay within ``check.tolerance``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlgen_cli.r3.rollout import micro_batches

__all__ = ["CheckRow", "check_stage", "print_report"]


@dataclass(frozen=True)
class CheckRow:
    """One (stage, track) line of the report."""

    stage: str
    track: str
    rows: int
    ratio_error: float
    sampler_gap: float | None


def _text_rows(recipe, batch) -> CheckRow:
    ratio_err, gap = 0.0, 0.0
    for mb in batch.text_micro:
        logp = recipe.policy.token_logprobs(mb.batch).detach()
        mask = mb.batch.completion_mask.bool()
        ratio_err = max(ratio_err, (torch.exp(logp - mb.old) - 1).abs()[mask].max().item())
        for i, row in enumerate(range(mb.rows.start, mb.rows.stop)):
            n = int(mask[i].sum())
            sampled = batch.thoughts.sampler_logprobs[row].to(logp.device)
            gap = max(gap, (logp[i, :n] - sampled[:n]).abs().max().item() if n else 0.0)
    return CheckRow(batch.stage, "text", len(batch.positions), ratio_err, gap)


def _image_rows(recipe, batch) -> CheckRow:
    rollout, ratio_err = batch.images, 0.0
    if rollout.traj.num_steps:
        for rows in micro_batches(len(batch.positions), recipe.cfg.r3.micro_batch_size):
            traj = rollout.traj.index(rows)
            out, _ = recipe.image_step(traj, rollout.cond.index(rows), rollout.spec)
            ratio = torch.exp(out.logprob.detach() - traj.logprobs[:, 0])
            ratio_err = max(ratio_err, (ratio - 1).abs().max().item())
    return CheckRow(
        batch.stage, f"image (SDE step {rollout.sde_step})", len(batch.positions), ratio_err, None
    )


def check_stage(recipe, step: int) -> list[CheckRow]:
    """Roll out ``step`` with the recipe and check its text and image tracks (no update)."""
    batch = recipe.rollout_reason(step) if step % 2 == 0 else recipe.rollout_refine(step)
    if not batch.text_micro:  # the text track is not tuned: check it all the same
        batch.text_micro = recipe.prepare_text(batch.thoughts)
    return [_text_rows(recipe, batch), _image_rows(recipe, batch)]


def print_report(rows: list[CheckRow], tolerance: float) -> float:
    """Rich table of the rows and the verdict; returns the worst |ratio − 1|."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="on-policy check (R3): training path vs the rollout")
    for column in ("stage", "track", "rows", "max |ratio − 1|", "max |Δ log p| vs sampler"):
        table.add_column(column, justify="right")
    for row in rows:
        gap = "—" if row.sampler_gap is None else f"{row.sampler_gap:.3e}"
        table.add_row(row.stage, row.track, str(row.rows), f"{row.ratio_error:.3e}", gap)
    worst = max(row.ratio_error for row in rows)
    console = Console()
    console.print(table)
    verdict = "[green]PASS[/]" if worst <= tolerance else "[bold red]FAIL[/]"
    console.print(f"{verdict} max |ratio − 1| {worst:.3e} (tolerance {tolerance:.1e})")
    return worst
