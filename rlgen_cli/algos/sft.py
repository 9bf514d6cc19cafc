"""Reward-filtered SFT: flow matching on the best samples of each group, optionally anchored to the base.

The SFT baseline of Flow-GRPO's family (docs/maths.md §7.2; rejection-sampling fine-tuning, e.g. RAFT,
Dong et al. 2023, "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment"): keep the
top-k samples of each prompt group (:func:`select_best`), re-noise them and regress the velocity:

    e_i = mean((v_θ(x_σ) − (ε − x₀))²)                      (per sample, over non-batch dims)
    L   = mean_i(w_i · e_i) + β · mean_i(mean((v_θ − v_base)²))

with β = ``anchor_weight`` (``algo.pref.anchor_weight``). ``w`` are optional non-negative per-sample
weights, e.g. the positive part of the advantages. Upstream
applies the advantage only in its ``β > 0`` branch and silently drops it when ``β = 0``, a bug: here
``weights`` scale the flow-matching term whatever β is. The anchor term is unweighted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlgen_cli.algos.advantages import group_moments
from rlgen_cli.algos.dpo import flow_matching_error

__all__ = ["SFTLossOut", "select_best", "sft_loss"]


@dataclass(frozen=True)
class SFTLossOut:
    """Result of :func:`sft_loss`.

    Attributes:
        loss: Scalar to backpropagate: ``fm_loss + β·anchor_loss`` (differentiable).
        fm_loss: Scalar weighted flow-matching loss ``mean(w·e)``, detached.
        anchor_loss: Scalar ``mean((v_θ − v_base)²)``, detached (0 when no ``v_base``), unweighted by β.
        stats: As Python floats: ``fm_error_mean`` (unweighted mean of ``e``), ``weight_mean``
            (1.0 without weights).
    """

    loss: Tensor
    fm_loss: Tensor
    anchor_loss: Tensor
    stats: dict[str, float]


def select_best(rewards: Tensor, group_ids: Tensor, top_k: int = 1) -> Tensor:
    """Indices of the ``top_k`` highest-reward samples of every group.

    Ties go to the lower index; a group smaller than ``top_k`` contributes all its samples. Groups are
    not skipped when their rewards are all equal (every sample is then equally good). Output order:
    ascending group id, then best first within the group.

    Args:
        rewards: (N,) float rewards; NaN/inf raise.
        group_ids: (N,) integer group ids (the prompt's dataset index).
        top_k: Samples kept per group, >= 1.

    Returns:
        (K,) int64 indices into the batch.

    Raises:
        ValueError: If ``top_k < 1``, or on bad shapes/dtypes or non-finite rewards.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1 (samples kept per group), got {top_k}.")
    group_moments(rewards, group_ids)  # validation only
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (N,)
    by_reward = torch.argsort(rewards, descending=True, stable=True)  # (N,) ties keep index order
    order = by_reward[torch.argsort(inverse[by_reward], stable=True)]  # (N,) group, then best first
    sorted_groups = inverse[order]  # (N,)
    starts = torch.searchsorted(sorted_groups, sorted_groups, right=False)  # (N,) first slot of group
    rank = torch.arange(order.numel(), device=order.device) - starts  # (N,) 0 = best of its group
    return order[rank < top_k]


def _check_sft_args(
    v_pred: Tensor, v_base: Tensor | None, anchor_weight: float, weights: Tensor | None
) -> None:
    """Raise ``ValueError`` on a bad ``v_base`` / ``weights`` shape or negative weights."""
    if v_base is not None and v_base.shape != v_pred.shape:
        raise ValueError(
            f"v_base {tuple(v_base.shape)} must match v_pred {tuple(v_pred.shape)}; pass the base model's "
            "velocity on the same inputs."
        )
    assert anchor_weight >= 0 and (anchor_weight == 0 or v_base is not None), anchor_weight
    if weights is None:
        return
    if weights.ndim != 1 or weights.shape[0] != v_pred.shape[0]:
        raise ValueError(
            f"weights must be (B,) = ({v_pred.shape[0]},), got {tuple(weights.shape)}; one weight per sample."
        )
    if bool((~torch.isfinite(weights) | (weights < 0)).any()):
        raise ValueError(
            "weights must be finite and >= 0 (SFT imitates; a negative weight pushes away without bound); "
            "pass the positive part of the advantages, e.g. advantages.clamp(min=0)."
        )


def sft_loss(
    v_pred: Tensor,
    x0: Tensor,
    noise: Tensor,
    *,
    v_base: Tensor | None = None,
    anchor_weight: float = 0.0,
    weights: Tensor | None = None,
) -> SFTLossOut:
    """Weighted flow-matching loss on the selected samples, plus ``anchor_weight·mean((v_θ − v_base)²)``.

    Gradients flow into ``v_pred`` only; ``x0``, ``noise``, ``v_base`` and ``weights`` are constants.

    Args:
        v_pred: (B, ...) policy velocity at ``x_σ = (1−σ)·x₀ + σ·ε``.
        x0: (B, ...) clean latents of the selected samples.
        noise: (B, ...) the noise ε used to build ``x_σ``.
        v_base: (B, ...) base-model velocity on the same inputs, or None. Always logged as
            ``anchor_loss``; weighted by ``anchor_weight`` into ``loss``.
        anchor_weight: Weight of the anchor term (``algo.pref.anchor_weight``), >= 0; > 0 requires
            ``v_base``.
        weights: (B,) non-negative per-sample weights of the flow-matching term (e.g. positive
            advantages), or None for 1. Honoured for every anchor weight.

    Returns:
        :class:`SFTLossOut`.

    Raises:
        ValueError: On mismatched shapes, negative or non-finite weights.
    """
    errors = flow_matching_error(v_pred, x0, noise)  # (B,), validates shapes
    _check_sft_args(v_pred, v_base, anchor_weight, weights)
    w = errors.new_ones(errors.shape) if weights is None else weights.detach().to(errors.dtype)  # (B,)
    fm_loss = (w * errors).mean()  # ()
    if v_base is None:
        anchor_loss = fm_loss.new_zeros(())
        loss = fm_loss
    else:
        diff = v_pred.to(errors.dtype) - v_base.detach().to(errors.dtype)  # (B, ...)
        anchor_loss = diff.pow(2).mean()  # ()
        loss = fm_loss + anchor_weight * anchor_loss
    stats = torch.stack([errors.detach().mean(), w.mean()]).tolist()
    return SFTLossOut(
        loss=loss,
        fm_loss=fm_loss.detach(),
        anchor_loss=anchor_loss.detach(),
        stats={"fm_error_mean": stats[0], "weight_mean": stats[1]},
    )
