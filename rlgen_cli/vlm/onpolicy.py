"""``rlgen check-onpolicy`` for the VLM recipes: the sampler's log-probs vs the training forward's.

**What is compared.** The rollout engine draws token t from softmax(process(z_t / T)) — temperature T,
top-k / top-p, vision tokens suppressed — and records, for the token it drew, log softmax(z_t) at
temperature 1 with the vision tokens out of the softmax, from the *raw* logits z_t (HF ``generate``'s
``output_logits``, taken before every processor; vLLM's raw log-probs with ``engine=vllm``). That is the
quantity training uses (:func:`~rlgen_cli.vlm.rollout.completion_logprobs`: temperature 1, same mask), so
the temperature and the processors drop out and the two sides differ only by how they were computed:
incremental KV-cache decoding inside the sampler vs one full forward of the training layout (gradients
on, as in training). The check reports, per sample, max |ratio − 1| (ratio = π_train / π_sampler) and
max |Δ log p| over its tokens and fails above ``check.text_tolerance``. Weights that changed between the
rollout and training (``check.perturb_weights``) fail it; so would a wrong layout, position ids,
attention mask or vision-token mask on either side.

**Why training still recomputes π_old** (``algo.token.old_logprobs=recompute``, the default). Both sides
estimate the same log-probs; the recompute is the one the optimizer differentiates. With it, the first
inner iteration's ratio π_θ / π_old is exactly 1 and PPO's clip acts only on real policy change. Taking
π_old from the sampler instead puts the sampler-vs-trainer numerics into every ratio (≤ 1e-6 here in
fp32, orders of magnitude more in bf16 or with vLLM's kernels), where the clip treats it as policy change
and biases per-token weights. What the recompute cannot see — the sampler's distribution drifting from
the trainer's — is what this check measures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.vlm.rollout import collate, completion_logprobs
from rlgen_cli.vlm.training import batches

__all__ = ["SampleGap", "check_rollout", "max_error", "print_report", "sampler_gaps"]


@dataclass(frozen=True)
class SampleGap:
    """One sample's tokens and its worst gap between the training forward and the sampler."""

    sample: int
    tokens: int
    ratio_error: float
    logp_error: float


def sampler_gaps(trained: Tensor, mask: Tensor, sampled: Sequence[Tensor]) -> list[tuple[float, float]]:
    """Per row: (max |exp(trained − sampled) − 1|, max |trained − sampled|) over its real tokens.

    Args:
        trained: (B, L) training-path log-probs.
        mask: (B, L) 1 on real completion tokens (the first ``mask[i].sum()`` of row i).
        sampled: B tensors (L_i,): the sampler's log-probs of the same tokens.

    Raises:
        RuntimeError: When a row's sampler log-probs are missing or not finite (an engine that returned
            none): a NaN would compare as "within tolerance".
    """
    out = []
    for i, row in enumerate(sampled):
        n = int(mask[i].sum())
        if row.numel() != n or not torch.isfinite(row).all():
            raise RuntimeError(
                f"row {i}: the sampler recorded {row.numel()} log-probs for {n} tokens, or some are not "
                "finite; the engine must return one finite log-prob per sampled token"
            )
        if not n:
            out.append((0.0, 0.0))
            continue
        delta = trained[i, :n].detach().double().cpu() - row.double()
        out.append((float((delta.exp() - 1).abs().max()), float(delta.abs().max())))
    return out


def check_rollout(
    recipe: Any, batch_size: int, perturb: Callable[[list[torch.nn.Parameter]], None]
) -> list[SampleGap]:
    """Roll out epoch 0 with a set-up ``VLMRLRecipe``, ``perturb`` its trainable weights (a no-op unless
    testing), then score every completion on the training path in batches of ``batch_size``."""
    from rlgen_cli.training.reporting.progress import Progress

    policy = recipe.policy
    with Progress(recipe.cfg.progress) as progress:
        rollouts = recipe.rollout(0, progress)
    if len(rollouts.sampler_logprobs) != len(rollouts.completions):
        raise RuntimeError(f"the {recipe.engine.name} engine recorded no log-probs; nothing to compare")
    perturb(policy.trainable_parameters())
    suppressed = None if recipe.engine.masks_suppressed else ()
    rows = []
    for part in batches(len(rollouts.completions), batch_size):
        batch = collate(policy, rollouts.prompts[part], rollouts.images[part], rollouts.completions[part])
        trained = completion_logprobs(policy, batch, suppressed=suppressed)
        gaps = sampler_gaps(trained, batch.completion_mask, rollouts.sampler_logprobs[part])
        for i, (ratio, delta) in enumerate(gaps):
            rows.append(SampleGap(part.start + i, int(batch.completion_mask[i].sum()), ratio, delta))
    return rows


def max_error(rows: Sequence[SampleGap]) -> float:
    """The verdict's number: the worst |ratio − 1| or |Δ log p| over every sample."""
    return max((max(r.ratio_error, r.logp_error) for r in rows), default=0.0)


def print_report(rows: Sequence[SampleGap], tolerance: float, engine: str) -> float:
    """Rich table of the samples and the verdict; returns :func:`max_error`."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="on-policy check (VLM): training forward vs the sampler's log-probs (max)")
    for column in ("sample", "tokens", "|ratio − 1|", "|Δ log p|"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row.sample), str(row.tokens), f"{row.ratio_error:.3e}", f"{row.logp_error:.3e}")
    worst = max_error(rows)
    console = Console()
    console.print(table)
    verdict = "[green]PASS[/]" if worst <= tolerance else "[bold red]FAIL[/]"
    console.print(
        f"{verdict} text ({engine} sampler): max error {worst:.3e} (check.text_tolerance {tolerance:.1e})"
    )
    return worst
