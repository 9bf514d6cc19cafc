"""DGPO: Direct Group Preference Optimization of a flow model on the forward process.

Luo et al. 2025, "Reinforcing Diffusion Models by Direct Group Preference Optimization" (code:
Luo-Yihong/DGPO). A DPO over whole groups instead of pairs: the K samples of one prompt, weighted by their
group advantages A_i (which sum to zero in a group), make the positive and negative sides of one
preference, so the partition function of the Bradley–Terry model cancels and no likelihood of a
denoising step is needed. Rollouts come from any solver; the clean samples x₀ are noised forward at σ
and ε that the whole group shares (docs/algorithms.md, "DGPO"):

    e_i   = mean((v_θ(x_σ,i) − (ε − x₀,i))²)              flow-matching error of sample i
    Δ_i   = e_i − e_ref,i                                   against the reference (base model or old policy)
    S_g   = (β/G)·Σ_{i∈g} A_i·Δ_i                           G = group size, β = ``beta``
    L_g   = −log σ(−S_g)        ∇L_g = σ(S_g)·(β/G)·Σ_{i∈g} A_i·∇e_i

The loss this module returns is the surrogate with that gradient up to the constant β/G (upstream's):
``mean_i(sg(σ(S_g(i)))·A_i·e_i)``. A group whose positives already beat the reference by a wide margin
(S_g ≪ 0) gets a weight near 0; a group the policy ranks the wrong way (S_g ≫ 0) a weight near 1.

Optionally, as upstream's default, a PPO-style clip against the old policy: with ratio
``ρ_i = exp(e_old,i − e_i)``, sample i's error is detached where ``A_i > 0`` and ``ρ_i > 1 + c`` or
``A_i ≤ 0`` and ``ρ_i < 1 − c`` (it has moved far enough in its advantage's direction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlgen_cli.algos.dpo import flow_matching_error

__all__ = [
    "DGPOLossOut",
    "clip_mask",
    "dgpo_loss",
    "group_weights",
    "truncated_timestep_indices",
]


@dataclass(frozen=True)
class DGPOLossOut:
    """Result of :func:`dgpo_loss`.

    Attributes:
        loss: Scalar to backpropagate: ``policy_loss + kl_weight·kl_loss`` (differentiable).
        policy_loss: Scalar ``mean(w·A·e)``, detached.
        kl_loss: Scalar ``mean((v_θ − v_ref)²)``, detached (0 without ``v_ref``), unweighted.
        stats: As Python floats: ``fm_error_mean`` (mean e), ``group_weight_mean`` (mean w),
            ``clip_fraction`` (share of samples whose error the clip detached).
    """

    loss: Tensor
    policy_loss: Tensor
    kl_loss: Tensor
    stats: dict[str, float]


def group_weights(
    advantages: Tensor, deltas: Tensor, group_ids: Tensor, *, beta: float, group_size: int
) -> Tensor:
    """Each sample's group weight ``σ(S_g)``, ``S_g = (β/G)·Σ_{i∈g} A_i·Δ_i`` summed in float64.

    Args:
        advantages: (N,) group advantages A.
        deltas: (N, ...) ``e_θ − e_ref`` per sample (and per trained σ in the trailing dims).
        group_ids: (N,) group keys; every group must be whole: exactly ``group_size`` samples.
        beta: The preference strength β > 0 (upstream 100).
        group_size: G, the samples per prompt.

    Returns:
        (N, ...) float64 weights in (0, 1), one per sample (per σ), constant within a group.

    Raises:
        ValueError: If a group has other than ``group_size`` samples (its sum would be partial).
    """
    assert beta > 0 and group_size >= 1, (beta, group_size)
    assert advantages.shape == group_ids.shape == deltas.shape[:1], (advantages.shape, deltas.shape)
    keys, slot, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    partial = keys[counts != group_size]
    if len(partial):
        raise ValueError(
            f"groups {partial.tolist()} have {counts[counts != group_size].tolist()} samples here, not "
            f"group_size={group_size}: DGPO sums over whole groups"
        )
    terms = advantages.double().view(-1, *([1] * (deltas.dim() - 1))) * deltas.double()  # (N, ...)
    sums = terms.new_zeros((len(keys), *deltas.shape[1:])).index_add_(0, slot, terms)  # (groups, ...)
    return torch.sigmoid(sums * (beta / group_size))[slot]


def clip_mask(errors: Tensor, old_errors: Tensor, advantages: Tensor, clip_range: float) -> Tensor:
    """(B,) True where the PPO-style clip detaches a sample's error: ratio ``exp(e_old − e)`` above
    ``1 + clip_range`` for A > 0, below ``1 − clip_range`` otherwise."""
    assert clip_range > 0, clip_range
    ratio = torch.exp(old_errors.detach() - errors.detach())
    return torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def dgpo_loss(
    v_pred: Tensor,
    x0: Tensor,
    noise: Tensor,
    advantages: Tensor,
    weights: Tensor,
    *,
    old_errors: Tensor | None = None,
    clip_range: float = 0.0,
    v_ref: Tensor | None = None,
    kl_weight: float = 0.0,
) -> DGPOLossOut:
    """DGPO's surrogate on one forward-noised micro-batch (see the module docstring).

    Gradients flow into ``v_pred`` only; everything else is a constant.

    Args:
        v_pred: (B, ...) policy velocity at ``x_σ = (1 − σ)·x₀ + σ·ε``.
        x0: (B, ...) clean rollout latents.
        noise: (B, ...) the ε that built ``x_σ`` (shared within a group).
        advantages: (B,) group advantages (clipped to ±A_max).
        weights: (B,) group weights σ(S_g) (:func:`group_weights`), from the whole groups.
        old_errors: (B,) the old policy's flow-matching errors on the same inputs; needed when
            ``clip_range`` > 0.
        clip_range: The PPO-style clip c (upstream 1e-2); 0 turns the clip off.
        v_ref: (B, ...) reference (base) velocity, or None; > 0 ``kl_weight`` needs it.
        kl_weight: Weight of ``mean((v_θ − v_ref)²)`` (upstream 0.02 on GenEval and OCR).

    Returns:
        :class:`DGPOLossOut`.
    """
    errors = flow_matching_error(v_pred, x0, noise)  # (B,), checks the shapes
    assert advantages.shape == weights.shape == errors.shape, "advantages and weights must be (B,)"
    assert clip_range >= 0 and (clip_range == 0 or old_errors is not None), clip_range
    assert kl_weight >= 0 and (kl_weight == 0 or v_ref is not None), kl_weight
    adv = advantages.detach().to(errors.dtype)
    clipped = (
        clip_mask(errors, old_errors.to(errors.dtype), adv, clip_range)
        if clip_range > 0 and old_errors is not None  # asserted above: clip_range > 0 brings old_errors
        else torch.zeros_like(errors, dtype=torch.bool)
    )
    trained = torch.where(clipped, errors.detach(), errors)
    w = weights.detach().to(errors.dtype)
    policy_loss = (w * adv * trained).mean()
    kl_loss = (
        errors.new_zeros(())
        if v_ref is None
        else (v_pred.to(errors.dtype) - v_ref.detach().to(errors.dtype)).pow(2).mean()
    )
    stats = torch.stack([errors.detach().mean(), w.mean(), clipped.to(errors.dtype).mean()]).tolist()
    return DGPOLossOut(
        loss=policy_loss + kl_weight * kl_loss,
        policy_loss=policy_loss.detach(),
        kl_loss=kl_loss.detach(),
        stats=dict(zip(("fm_error_mean", "group_weight_mean", "clip_fraction"), stats)),
    )


def truncated_timestep_indices(
    num_steps: int, count: int, fraction: float, generator: torch.Generator
) -> Tensor:
    """``count`` distinct rollout-schedule indices drawn uniformly from [0, int(T·fraction)]: DGPO trains
    the noisier part of the schedule only (upstream: 4 of the indices 0…6 of a 10-step rollout for OCR,
    0…4 for GenEval; index 0 is pure noise).

    Returns:
        (count,) int64 indices on the CPU, in random order.
    """
    top = int(num_steps * fraction)
    assert 0 <= top < num_steps and 1 <= count <= top + 1, (num_steps, count, fraction)
    keys = torch.rand(top + 1, generator=generator, device=generator.device)
    return keys.argsort()[:count].cpu()
