"""Clipped GRPO surrogate objective for one trained denoising step.

Implements the per-step policy loss of Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching
Models via Online RL"), the PPO-style clipped objective of GRPO (Shao et al. 2024, "DeepSeekMath"):

    ratio = exp(logp_new - logp_old)
    L     = mean(max(-A·ratio, -A·clip(ratio, 1-ε, 1+ε))) + β·mean(KL)

The KL term (between the policy's and the reference's step means) is computed in ``sde/`` and passed in
as ``kl``; this module only weighs it. Diagnostics follow upstream: ``approx_kl = ½·mean(Δlogp²)`` and
the clip fraction, split into ratio above / below the trust region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GRPOLossOut", "grpo_loss", "nonzero_advantage_rows"]


@dataclass(frozen=True)
class GRPOLossOut:
    """Result of :func:`grpo_loss`.

    Attributes:
        loss: Scalar to backpropagate: ``policy_loss + β·kl_loss`` (differentiable).
        policy_loss: Scalar clipped surrogate, detached.
        kl_loss: Scalar ``mean(kl)``, detached (0 when no ``kl`` is given), unweighted by β.
        stats: ``approx_kl``, ``clipfrac``, ``clipfrac_high``, ``clipfrac_low``, ``ratio_mean``,
            ``ratio_min``, ``ratio_max`` as Python floats.
    """

    loss: Tensor
    policy_loss: Tensor
    kl_loss: Tensor
    stats: dict[str, float]


def _check_args(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_range: float,
    kl: Tensor | None,
    kl_weight: float,
) -> None:
    """Raise ``ValueError`` on mismatched shapes, an empty batch or a bad ``clip_range`` / ``kl_weight`` (asserted)."""
    shapes = {"new_logp": new_logp.shape, "old_logp": old_logp.shape, "advantages": advantages.shape}
    if kl is not None:
        shapes["kl"] = kl.shape
    if len(set(shapes.values())) != 1:
        listed = ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items())
        raise ValueError(
            f"grpo_loss inputs must share one shape (B,), got {listed}; pass one log-prob, advantage "
            "(and KL) per trained sample."
        )
    if new_logp.numel() == 0:
        raise ValueError("grpo_loss got an empty batch; there must be at least one trained sample.")
    assert clip_range > 0 and kl_weight >= 0, (clip_range, kl_weight)
    assert kl_weight == 0 or kl is not None, "kl_weight > 0 needs the per-sample kl"


@torch.no_grad()
def _ratio_stats(log_ratio: Tensor, ratio: Tensor, clip_range: float) -> dict[str, float]:
    """Upstream diagnostics from ``log_ratio`` and ``ratio`` (both (B,)), with one device sync."""
    ratio = ratio.float()
    values = torch.stack(
        [
            0.5 * (log_ratio.float() ** 2).mean(),  # approx_kl
            ((ratio - 1.0).abs() > clip_range).float().mean(),  # clipfrac
            (ratio > 1.0 + clip_range).float().mean(),  # clipfrac_high
            (ratio < 1.0 - clip_range).float().mean(),  # clipfrac_low
            ratio.mean(),
            ratio.min(),
            ratio.max(),
        ]
    ).tolist()
    names = ("approx_kl", "clipfrac", "clipfrac_high", "clipfrac_low", "ratio_mean", "ratio_min", "ratio_max")
    return dict(zip(names, values, strict=True))


def grpo_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    kl: Tensor | None = None,
    kl_weight: float = 0.0,
) -> GRPOLossOut:
    """Flow-GRPO clipped surrogate (+ optional KL penalty) for one trained step.

    Gradients flow into ``new_logp`` (and ``kl``) only; ``old_logp`` and ``advantages`` are treated as
    constants. Where the pessimistic ``max`` picks the clipped term, the sample contributes no policy
    gradient.

    Args:
        new_logp: (B,) log-probs of the stored transitions under the current policy.
        old_logp: (B,) log-probs recorded at sampling time.
        advantages: (B,) advantages.
        clip_range: ε of the trust region ``[1-ε, 1+ε]``; must be > 0.
        kl: (B,) per-sample KL to the reference, or None. Always logged as ``kl_loss``; weighted by
            ``kl_weight`` into ``loss`` (so ``kl_weight=0`` logs it without training on it).
        kl_weight: KL weight β (``algo.kl_weight``), >= 0; > 0 requires ``kl``.

    Returns:
        :class:`GRPOLossOut`.

    Raises:
        ValueError: On shape mismatch or an empty batch.
    """
    _check_args(new_logp, old_logp, advantages, clip_range, kl, kl_weight)
    adv = advantages.detach()  # (B,)
    log_ratio = new_logp - old_logp.detach()  # (B,)
    ratio = torch.exp(log_ratio)  # (B,)
    unclipped = -adv * ratio  # (B,)
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)  # (B,)
    policy_loss = torch.maximum(unclipped, clipped).mean()  # ()
    if kl is None:
        kl_loss = policy_loss.new_zeros(())
        loss = policy_loss
    else:
        kl_loss = kl.mean()  # ()
        loss = policy_loss + kl_weight * kl_loss
    return GRPOLossOut(
        loss=loss,
        policy_loss=policy_loss.detach(),
        kl_loss=kl_loss.detach(),
        stats=_ratio_stats(log_ratio.detach(), ratio.detach(), clip_range),
    )


def nonzero_advantage_rows(advantages: Tensor, num_batches: int, generator: torch.Generator) -> Tensor:
    """Flow-GRPO's zero-advantage filter: which samples to train (docs/maths.md §4.5).

    Keeps the samples whose advantage is non-zero (a sample's advantage is the same at every trained
    step), then adds randomly chosen zero-advantage samples until the count splits into ``num_batches``
    equal micro-batches with at least one sample each (when N is a multiple of ``num_batches`` there are
    always enough). The caller trains the same number of micro-batches as without the filter, so each
    micro-batch is smaller and — the loss being a mean over the micro-batch — every kept sample weighs
    more.

    Args:
        advantages: (N,) advantages of this process's samples.
        num_batches: Micro-batches per epoch, 1 ≤ num_batches ≤ N.
        generator: Picks the zero-advantage samples that fill the last places.

    Returns:
        (N',) ascending row indices, N' ≥ ``num_batches``.

    Raises:
        ValueError: If ``advantages`` is not 1-D or ``num_batches`` is not in [1, N].
    """
    if advantages.ndim != 1:
        raise ValueError(f"advantages must be (N,), got shape {tuple(advantages.shape)}")
    n = advantages.shape[0]
    if not 1 <= num_batches <= n:
        raise ValueError(f"{n} samples do not fill {num_batches} micro-batches")
    keep = advantages.cpu() != 0  # (N,)
    kept = int(keep.sum())
    missing = num_batches if kept == 0 else -kept % num_batches  # one per micro-batch when none is kept
    zeros = torch.nonzero(~keep).squeeze(1)  # (Z,)
    keep[zeros[torch.randperm(zeros.numel(), generator=generator)[:missing]]] = True
    return torch.nonzero(keep).squeeze(1)
