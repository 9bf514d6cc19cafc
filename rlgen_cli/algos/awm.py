"""Advantage Weighted Matching (AWM): the pretraining flow-matching loss, weighted by advantages.

Xue et al. 2025, "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models" (code:
scxue/advantage_weighted_matching). The policy-gradient score of a whole sample is replaced by the
flow-matching (denoising score matching) loss of that sample, noised forward at a few σ, so RL uses the
same objective as pretraining with a per-sample weight (docs/algorithms.md, "AWM"):

    e_i   = mean((v_θ(x_σ) − (ε − x₀))²),   x_σ = (1 − σ)·x₀ + σ·ε        per sample and σ
    ρ(e)  = e (uniform) | σ·e (t) | σ²·e (t2) | σ·((e + δ)^p − δ^p)/p (ghuber, δ = 1e-10, p = 0.25)
    L     = mean_i(A_i·ρ(e_i)) + β·mean((v_θ − v_ref)²) + β_old·mean((v_θ − v_old)²)

Upstream writes the policy term as a clipped ratio ``exp(−ρ + sg(ρ))`` (``exp_first``) with the
advantage rescaled to ``A·advantage_max/adv_clip_max``; on policy the ratio is 1 and its gradient is
exactly ``A·∇ρ``, which is what this module computes directly (its value is the weighted error, not
upstream's ``−mean(A)``). The two regularisers pull towards the base model (reference) and towards an
old policy that trails the trained one (upstream's "KL-EMA", refreshed after each epoch like
DiffusionNFT's old policy, ``algos/nft.py``).

With every advantage equal to 1, uniform weighting and no old-policy term this is exactly the SFT
flow-matching loss (``algos/sft.py``); with advantages that sum to zero in a group, samples better than
their group are imitated and worse ones unlearned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlgen_cli.algos.dpo import flow_matching_error

__all__ = [
    "AWM_WEIGHTINGS",
    "GHUBER_DELTA",
    "TIMESTEP_DRAWS",
    "AWMLossOut",
    "awm_loss",
    "micro_batch_timestep_indices",
    "stratified_timestep_indices",
    "weigh",
]

AWM_WEIGHTINGS = ("uniform", "t", "t2", "ghuber")
GHUBER_DELTA = 1e-10  # keeps the generalised Huber's gradient finite at e = 0 (upstream's constant)
TIMESTEP_DRAWS = ("per_sample", "per_microbatch")


@dataclass(frozen=True)
class AWMLossOut:
    """Result of :func:`awm_loss`.

    Attributes:
        loss: Scalar to backpropagate: ``policy_loss + kl_weight·kl_loss + old_weight·old_loss``.
        policy_loss: Scalar ``mean(A·ρ(e))``, detached.
        kl_loss: Scalar ``mean((v_θ − v_ref)²)``, detached (0 without ``v_ref``), unweighted.
        old_loss: Scalar ``mean((v_θ − v_old)²)``, detached (0 without ``v_old``), unweighted.
        stats: As Python floats: ``fm_error_mean`` (mean e), ``weighted_error_mean`` (mean ρ(e)),
            ``advantage_abs_mean`` (mean |A|).
    """

    loss: Tensor
    policy_loss: Tensor
    kl_loss: Tensor
    old_loss: Tensor
    stats: dict[str, float]


def weigh(errors: Tensor, sigma: Tensor, weighting: str, power: float = 0.25) -> Tensor:
    """ρ(e) per sample (see the module docstring): (B,) errors and (B,) σ → (B,)."""
    assert weighting in AWM_WEIGHTINGS, f"weighting={weighting!r}; one of {AWM_WEIGHTINGS}"
    s = sigma.to(errors.dtype)
    if weighting == "uniform":
        return errors
    if weighting == "t":
        return s * errors
    if weighting == "t2":
        return s * s * errors
    assert power > 0, f"ghuber power must be > 0, got {power}"
    return s * ((errors + GHUBER_DELTA).pow(power) - GHUBER_DELTA**power) / power


def _mean_square(a: Tensor, b: Tensor | None, dtype: torch.dtype) -> Tensor:
    """mean((a − b)²) with ``b`` detached; 0 without ``b``."""
    if b is None:
        return a.new_zeros((), dtype=dtype)
    return (a.to(dtype) - b.detach().to(dtype)).pow(2).mean()


def awm_loss(
    v_pred: Tensor,
    x0: Tensor,
    noise: Tensor,
    sigma: Tensor,
    advantages: Tensor,
    *,
    weighting: str = "uniform",
    power: float = 0.25,
    v_ref: Tensor | None = None,
    kl_weight: float = 0.0,
    v_old: Tensor | None = None,
    old_weight: float = 0.0,
) -> AWMLossOut:
    """AWM's loss on one forward-noised batch (see the module docstring).

    Gradients flow into ``v_pred`` only; everything else is a constant.

    Args:
        v_pred: (B, ...) policy velocity at ``x_σ = (1 − σ)·x₀ + σ·ε``.
        x0: (B, ...) clean rollout latents.
        noise: (B, ...) the ε that built ``x_σ``.
        sigma: (B,) each sample's σ (used by the σ-dependent weightings).
        advantages: (B,) per-sample advantages (upstream: clipped to ±5, then divided by 5).
        weighting: ``uniform``, ``t``, ``t2`` or ``ghuber`` (upstream's default, power 0.25).
        power: The generalised Huber power p.
        v_ref: (B, ...) reference (base) velocity, or None; > 0 ``kl_weight`` needs it.
        kl_weight: Weight of ``mean((v_θ − v_ref)²)`` (upstream 1e-3 GenEval, 3e-3 OCR, 1e-4 PickScore).
        v_old: (B, ...) old-policy velocity, or None; > 0 ``old_weight`` needs it.
        old_weight: Weight of ``mean((v_θ − v_old)²)`` (upstream ``ema_beta`` 1).

    Returns:
        :class:`AWMLossOut`.
    """
    errors = flow_matching_error(v_pred, x0, noise)  # (B,), checks the shapes
    assert sigma.shape == advantages.shape == errors.shape, "sigma and advantages must be (B,)"
    assert kl_weight >= 0 and (kl_weight == 0 or v_ref is not None), kl_weight
    assert old_weight >= 0 and (old_weight == 0 or v_old is not None), old_weight
    weighted = weigh(errors, sigma, weighting, power)  # (B,)
    adv = advantages.detach().to(errors.dtype)
    policy_loss = (adv * weighted).mean()
    kl_loss = _mean_square(v_pred, v_ref, errors.dtype)
    old_loss = _mean_square(v_pred, v_old, errors.dtype)
    stats = torch.stack([errors.detach().mean(), weighted.detach().mean(), adv.abs().mean()]).tolist()
    return AWMLossOut(
        loss=policy_loss + kl_weight * kl_loss + old_weight * old_loss,
        policy_loss=policy_loss.detach(),
        kl_loss=kl_loss.detach(),
        old_loss=old_loss.detach(),
        stats=dict(zip(("fm_error_mean", "weighted_error_mean", "advantage_abs_mean"), stats)),
    )


def stratified_timestep_indices(
    num_steps: int, count: int, fraction: float, generator: torch.Generator
) -> Tensor:
    """One rollout-schedule index in each of ``count`` strata of [1, int(T·fraction)] (AWM's
    ``discrete_wo_init``: the first, pure-noise σ is never trained; upstream: 6 strata of 14 steps × 0.9).

    Stratum k spans ``[b_k, b_{k+1})`` with ``b = int(linspace(1, int(T·fraction), count + 1))``; the
    index is ``b_k + ⌊u·(b_{k+1} − b_k)⌋``, u uniform (a stratum of width 0 gives its lower bound).

    Returns:
        (count,) int64 indices on the CPU, ascending.
    """
    top = int(num_steps * fraction)
    assert count >= 1 and num_steps >= 2 and 1 <= top <= num_steps, (num_steps, count, fraction)
    bounds = torch.linspace(1, top, count + 1).long()  # (count + 1,) float32 as upstream, then floored
    lower, upper = bounds[:-1], bounds[1:]
    u = torch.rand(count, generator=generator, device=generator.device, dtype=torch.float64).cpu()
    return lower + (u * (upper - lower)).long()


def micro_batch_timestep_indices(per_sample: Tensor, draw: str) -> Tensor:
    """The σ positions a micro-batch trains on, from each sample's own draw ``per_sample`` (B, K).

    ``per_sample`` keeps every sample's draw; ``per_microbatch`` gives the first sample's draw to every
    sample, as AWM's script draws its strata once per micro-batch. Both have the same expectation; a
    shared draw makes the micro-batch's σ move together (more variance between micro-batches). The first
    sample's stream is keyed by its global position, so the shared draw is the same on any process count.

    Returns:
        (B, K) indices.
    """
    assert draw in TIMESTEP_DRAWS, f"timestep draw {draw!r}; one of {TIMESTEP_DRAWS}"
    assert per_sample.dim() == 2 and len(per_sample) >= 1, per_sample.shape
    if draw == "per_sample":
        return per_sample
    return per_sample[:1].expand_as(per_sample)
