"""DiffusionNFT: negative-aware fine-tuning of a flow model on the forward process.

Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (code:
NVlabs/DiffusionNFT). Rollouts come from any solver (no log-probabilities); each clean sample x₀ is
noised *forward*, ``x_σ = (1 − σ)·x₀ + σ·ε``, and the policy regresses the flow-matching target through
two implicit policies built from the current velocity v_θ and a frozen old one v_old
(docs/algorithms.md, "DiffusionNFT"):

    r     = clamp(A / (2·A_max) + ½, 0, 1)                 optimality probability, A clipped to ±A_max
    v⁺    = (1 − β)·v_old + β·v_θ                          implicit positive policy
    v⁻    = (1 + β)·v_old − β·v_θ                          implicit negative policy
    ℓ(v)  = mean((x̂₀(v) − x₀)²) / sg(max(mean|x̂₀(v) − x₀|, 1e-5)),   x̂₀(v) = x_σ − σ·v
    L     = (A_max / β)·mean_i[r_i·ℓ(v⁺_i) + (1 − r_i)·ℓ(v⁻_i)]  + β_KL·mean((v_θ − v_ref)²)

Good samples (r → 1) pull v⁺ towards the target, bad ones (r → 0) pull v⁻ there, which pushes v_θ the
other way. The x₀-space error is ``x̂₀(v) − x₀ = −σ·(v − (ε − x₀))``, so ℓ is a velocity error weighted by
σ and normalised by its own (detached) mean absolute size: the "adaptive weighting" of upstream's code
(``adaptive=False`` keeps the plain σ²·mean((v − (ε − x₀))²)). ``scale`` is upstream's A_max factor.

At v_θ = v_old (the first step after the old policy is refreshed) the gradient is the advantage-weighted
flow-matching gradient, ``∂L/∂v_θ = (scale/A_max)·A·∂ℓ(v_old)/∂v`` whatever β: DiffusionNFT then moves
like AWM (``algos/awm.py``), and β only shapes how far it goes before the old policy catches up.

The old policy follows the trained one as an average refreshed after every epoch,
``θ_old ← d·θ_old + (1 − d)·θ`` with ``d = old_policy_decay(step)`` (upstream's ``decay_type`` schedules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ADAPTIVE_FLOOR",
    "NFTLossOut",
    "nft_loss",
    "old_policy_decay",
    "optimality_probability",
    "subset_timestep_indices",
]

ADAPTIVE_FLOOR = 1e-5  # the smallest mean |x̂₀ − x₀| the adaptive weight divides by (upstream's clip)


@dataclass(frozen=True)
class NFTLossOut:
    """Result of :func:`nft_loss`.

    Attributes:
        loss: Scalar to backpropagate: ``policy_loss + kl_weight·kl_loss`` (differentiable).
        policy_loss: Scalar ``(scale/β)·mean(r·ℓ⁺ + (1 − r)·ℓ⁻)``, detached.
        kl_loss: Scalar ``mean((v_θ − v_ref)²)``, detached (0 without ``v_ref``), unweighted.
        stats: As Python floats: ``positive_loss`` / ``negative_loss`` (means of ℓ⁺ / ℓ⁻),
            ``old_deviation`` (mean((v_θ − v_old)²)), ``optimality_mean`` (mean r).
    """

    loss: Tensor
    policy_loss: Tensor
    kl_loss: Tensor
    stats: dict[str, float]


def optimality_probability(advantages: Tensor, clip_max: float) -> Tensor:
    """``r = clamp(clamp(A, ±clip_max)/(2·clip_max) + ½, 0, 1)``: A = 0 → ½, A = ±clip_max → 1 / 0.

    Args:
        advantages: (B,) advantages (already clipped or not).
        clip_max: The advantage bound A_max, > 0.

    Returns:
        (B,) r in [0, 1], in ``advantages``' dtype.
    """
    assert clip_max > 0, f"clip_max must be > 0 (the advantage bound), got {clip_max}"
    clipped = advantages.clamp(-clip_max, clip_max)
    return (clipped / clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def _x0_space_loss(v: Tensor, x0: Tensor, noise: Tensor, sigma: Tensor, adaptive: bool) -> Tensor:
    """(B,) ℓ(v): mean((x̂₀ − x₀)²) over non-batch dims, divided by its detached mean |x̂₀ − x₀| if
    ``adaptive``. ``x̂₀ − x₀ = −σ·(v − (ε − x₀))``."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    s = sigma.to(dtype).view(-1, *([1] * (v.dim() - 1)))  # (B, 1, ...)
    error = s * (v.to(dtype) - (noise.to(dtype) - x0.to(dtype)))  # (B, ...) = −(x̂₀ − x₀)
    squared = error.pow(2).flatten(1).mean(dim=1)  # (B,)
    if not adaptive:
        return squared
    with torch.no_grad():  # upstream measures the weight in float64
        weight = error.double().abs().flatten(1).mean(dim=1).clamp(min=ADAPTIVE_FLOOR)  # (B,)
    return squared / weight.to(dtype)


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    x0: Tensor,
    noise: Tensor,
    sigma: Tensor,
    r: Tensor,
    *,
    beta: float = 1.0,
    adaptive: bool = True,
    scale: float = 1.0,
    v_ref: Tensor | None = None,
    kl_weight: float = 0.0,
) -> NFTLossOut:
    """DiffusionNFT's loss on one forward-noised batch (see the module docstring).

    Gradients flow into ``v_theta`` only; everything else is a constant.

    Args:
        v_theta: (B, ...) the trained policy's velocity at ``x_σ = (1 − σ)·x₀ + σ·ε``.
        v_old: (B, ...) the old policy's velocity on the same inputs.
        x0: (B, ...) clean rollout latents.
        noise: (B, ...) the ε that built ``x_σ``.
        sigma: (B,) each sample's σ.
        r: (B,) optimality probabilities in [0, 1] (:func:`optimality_probability`).
        beta: The implicit-policy strength β > 0 (upstream 1.0; 0.1 for OCR and multi-reward).
        adaptive: Divide each ℓ by its own detached mean absolute x₀ error (upstream).
        scale: Constant factor of the policy loss (upstream: the advantage bound A_max = 5).
        v_ref: (B, ...) the reference (base) velocity, or None; logged as ``kl_loss``.
        kl_weight: Weight of ``mean((v_θ − v_ref)²)`` in ``loss`` (upstream 1e-4); > 0 needs ``v_ref``.

    Returns:
        :class:`NFTLossOut`.
    """
    assert v_theta.shape == v_old.shape == x0.shape == noise.shape and v_theta.dim() >= 2, (
        f"v_theta {tuple(v_theta.shape)}, v_old {tuple(v_old.shape)}, x0 {tuple(x0.shape)} and noise "
        f"{tuple(noise.shape)} must share one shape (B, ...)"
    )
    assert sigma.shape == r.shape == v_theta.shape[:1], "sigma and r must be (B,)"
    assert beta > 0 and kl_weight >= 0 and (kl_weight == 0 or v_ref is not None), (beta, kl_weight)
    v_old = v_old.detach()
    positive = beta * v_theta + (1.0 - beta) * v_old  # (B, ...)
    negative = (1.0 + beta) * v_old - beta * v_theta  # (B, ...)
    noise, x0 = noise.detach(), x0.detach()
    loss_pos = _x0_space_loss(positive, x0, noise, sigma, adaptive)  # (B,)
    loss_neg = _x0_space_loss(negative, x0, noise, sigma, adaptive)  # (B,)
    r = r.detach().to(loss_pos.dtype)
    policy_loss = scale / beta * (r * loss_pos + (1.0 - r) * loss_neg).mean()
    dtype = loss_pos.dtype
    kl_loss = (
        policy_loss.new_zeros(())
        if v_ref is None
        else (v_theta.to(dtype) - v_ref.detach().to(dtype)).pow(2).mean()
    )
    deviation = (v_theta.detach().to(dtype) - v_old.to(dtype)).pow(2).mean()
    stats = torch.stack([loss_pos.detach().mean(), loss_neg.detach().mean(), deviation, r.mean()]).tolist()
    return NFTLossOut(
        loss=policy_loss + kl_weight * kl_loss,
        policy_loss=policy_loss.detach(),
        kl_loss=kl_loss.detach(),
        stats=dict(zip(("positive_loss", "negative_loss", "old_deviation", "optimality_mean"), stats)),
    )


def old_policy_decay(step: int, *, flat_steps: int, rate: float, max_decay: float) -> float:
    """The old policy's decay after ``step`` optimizer steps: 0 for the first ``flat_steps``, then
    ``min(rate·(step − flat_steps), max_decay)``.

    Upstream's schedules: DiffusionNFT ``decay_type`` 0 = (0, 0, 0) (the old policy is the current one),
    1 = (0, 1e-3, 0.5), 2 = (75, 7.5e-3, 0.999); AWM's ``linear`` KL-EMA = (0, 1e-3, 0.3).
    """
    assert step >= 0 and flat_steps >= 0 and rate >= 0 and 0 <= max_decay < 1
    if step < flat_steps:
        return 0.0
    return min(rate * (step - flat_steps), max_decay)


def subset_timestep_indices(num_steps: int, count: int, generator: torch.Generator) -> Tensor:
    """``count`` distinct indices of the ``num_steps`` rollout σ, drawn uniformly (DiffusionNFT trains
    int(T·0.99) of the T schedule entries per sample, a fresh random choice each epoch).

    Returns:
        (count,) int64 indices on the CPU, in random order.
    """
    assert 1 <= count <= num_steps, (count, num_steps)
    keys = torch.rand(num_steps, generator=generator, device=generator.device)
    return keys.argsort()[:count].cpu()
