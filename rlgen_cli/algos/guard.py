"""GRPO-Guard: the Flow-GRPO clipped objective with a normalised ratio and a step-reweighted loss.

Implements the regulated clipping of GRPO-Guard (Wang et al. 2025, "GRPO-Guard: Mitigating Implicit
Over-Optimization in Flow Matching via Regulated Clipping", arXiv 2510.22319). With the SDE step's
Gaussian ``N(μ, s²)``, ``s = σ_t·sqrt(−dt)``, and the log-prob averaged over elements (Flow-GRPO's
convention, docs/maths.md §2.3), the plain log-ratio of a stored transition ``x' = μ_old + s·z`` is
``mean(z·Δμ)/s − mean(Δμ²)/(2s²)`` with ``Δμ = μ_θ − μ_old``: the second term is always negative (the
ratio distribution is left-shifted) and the scale ``1/s`` differs by orders of magnitude between steps,
so one clip range fits no step. GRPO-Guard removes both, per sample ``i``:

    bias_i   = mean((μ_θ − μ_old)²) / (2·(s̄_i·σ̄_i)²)
    ratio_i  = exp((logp_θ − logp_old + bias_i) · s̄_i·σ̄_i)          (= exp(mean(z·Δμ)))
    L        = mean_i( max(−A_i·ratio_i, −A_i·clip(ratio_i, 1−ε, 1+ε)) / s̄_i² ) + β·mean(KL)

where ``σ̄_i`` is the mean noise scale σ_t and ``s̄_i`` the mean ``sqrt(−dt)`` of sample i's trained
step(s) (docs/maths.md §6); the division by ``s̄²`` is the paper's gradient reweighting (Eq. 12,
``δ = 1/Δt`` for Flow-GRPO's SDE), which makes the gradient magnitude step-size invariant. Upstream
clip ranges are 2e-6…4e-6.

Normalisation choices (the public code is ambiguous; checked against the GRPO-Guard actor as ported
into TeleBoost ``algorithms/grpo_guard.py`` and Flow-Factory's ``GRPOGuardTrainer``):

* **Per sample, not per batch.** Upstream reduces σ_t and sqrt(−dt) to batch scalars
  (``sqrt_dt.mean()``), which mixes different steps when timesteps are shuffled per sample (as
  Flow-GRPO does). rlgen takes one ``(σ̄, s̄)`` per sample; pass the batch mean to every sample to
  reproduce upstream exactly.
* **No epsilon.** Upstream adds 1e-6 inside ``σ_t/(sqrt_dt + eps)`` and ``2·(scale² + eps)``; rlgen
  requires σ_t > 0 and sqrt(−dt) > 0 instead (an ODE step or the σ = 0 step has no density and must
  not be trained), so an on-policy ratio is exactly 1.
* **Squared scale in the bias.** Flow-Factory divides by ``2·scale`` (not ``scale²``), which does not
  cancel the Gaussian term, and later overwrites the normalised ratio with the plain one; both are
  bugs and not followed.
* **Differentiable bias.** As upstream, gradients flow through ``bias`` (via μ_θ); its gradient is
  zero on-policy and it is what makes ``log ratio = mean(z·Δμ)`` hold off-policy.
* **KL not reweighted.** Only the policy term is divided by ``s̄²``; the KL term is weighted by β alone.

``logp`` must be the per-element *mean* log-density (``sde`` default); with summed log-probs divide
them by the element count first, or the bias no longer cancels the ``Δμ²`` term. Diagnostics match
:func:`~rlgen_cli.algos.grpo.grpo_loss`: ``approx_kl`` from the plain ``Δlogp``, clip fractions and
ratio stats from the normalised ratio, plus the bias, scale and loss-weight means.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlgen_cli.algos.grpo import GRPOLossOut, _ratio_stats

__all__ = ["guard_loss"]


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def _check_shapes(
    per_sample: dict[str, Tensor], mean_new: Tensor, mean_old: Tensor, kl: Tensor | None
) -> None:
    """Raise ``ValueError`` unless every per-sample input is (B,) and the means are (B, ...) alike."""
    if kl is not None:
        per_sample = {**per_sample, "kl": kl}
    if len({t.shape for t in per_sample.values()}) != 1 or next(iter(per_sample.values())).ndim != 1:
        listed = ", ".join(f"{k} {tuple(v.shape)}" for k, v in per_sample.items())
        raise ValueError(
            f"guard_loss per-sample inputs must share one 1-D shape (B,), got {listed}; pass one "
            "log-prob, σ̄, s̄, advantage (and KL) per trained sample."
        )
    batch = next(iter(per_sample.values())).shape[0]
    if batch == 0:
        raise ValueError("guard_loss got an empty batch; there must be at least one trained sample.")
    if mean_new.shape != mean_old.shape or mean_new.ndim == 0 or mean_new.shape[0] != batch:
        raise ValueError(
            f"mean_new {tuple(mean_new.shape)} and mean_old {tuple(mean_old.shape)} must both be "
            f"(B={batch}, ...): the step mean recomputed now and the one stored at sampling, per sample."
        )


def _check_positive(name: str, values: Tensor) -> None:
    """Raise ``ValueError`` unless all ``values`` are finite and > 0 (one device sync)."""
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        idx = bad.nonzero().flatten().tolist()[:10]
        raise ValueError(
            f"{name} must be finite and > 0 for every sample, got {values[bad].tolist()[:10]} at index "
            f"{idx}; GRPO-Guard divides by σ_t·sqrt(−dt): train SDE steps only (noise level > 0, not "
            "the final σ = 0 step)."
        )


def _check_args(
    new_logp: Tensor,
    old_logp: Tensor,
    mean_new: Tensor,
    mean_old: Tensor,
    sigma_t: Tensor,
    sqrt_neg_dt: Tensor,
    advantages: Tensor,
    clip_range: float,
    kl: Tensor | None,
    kl_weight: float,
) -> None:
    """Raise ``ValueError`` on bad shapes, non-positive scales or a bad ``clip_range`` / ``kl_weight`` (asserted)."""
    per_sample = {
        "new_logp": new_logp,
        "old_logp": old_logp,
        "sigma_t": sigma_t,
        "sqrt_neg_dt": sqrt_neg_dt,
        "advantages": advantages,
    }
    _check_shapes(per_sample, mean_new, mean_old, kl)
    _check_positive("sigma_t", sigma_t)
    _check_positive("sqrt_neg_dt", sqrt_neg_dt)
    assert clip_range > 0 and kl_weight >= 0, (clip_range, kl_weight)
    assert kl_weight == 0 or kl is not None, "kl_weight > 0 needs the per-sample kl"


# --------------------------------------------------------------------------------------------------
# loss
# --------------------------------------------------------------------------------------------------


def _mean_shift_bias(mean_new: Tensor, mean_old: Tensor, scale: Tensor) -> Tensor:
    """``mean((μ_θ − μ_old)²) / (2·scale²)`` per sample -> (B,), at least float32.

    Args:
        mean_new: (B, ...) step means under the current policy (differentiable).
        mean_old: (B, ...) step means stored at sampling.
        scale: (B,) per-sample step std ``s̄·σ̄``.
    """
    dtype = torch.promote_types(mean_new.dtype, torch.float32)
    diff = mean_new.to(dtype) - mean_old.detach().to(dtype)  # (B, ...)
    mse = diff.pow(2).flatten(1).mean(dim=1)  # (B,)
    return mse / (2 * scale.to(dtype) ** 2)


@torch.no_grad()
def _guard_stats(bias: Tensor, scale: Tensor, weight: Tensor) -> dict[str, float]:
    """GRPO-Guard diagnostics (bias mean/max, scale mean, loss-weight mean) with one device sync."""
    values = torch.stack(
        [bias.float().mean(), bias.float().max(), scale.float().mean(), weight.float().mean()]
    ).tolist()
    names = ("guard_bias_mean", "guard_bias_max", "guard_scale_mean", "guard_weight_mean")
    return dict(zip(names, values, strict=True))


def guard_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    mean_new: Tensor,
    mean_old: Tensor,
    sigma_t: Tensor,
    sqrt_neg_dt: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    kl: Tensor | None = None,
    kl_weight: float = 0.0,
) -> GRPOLossOut:
    """GRPO-Guard clipped surrogate (+ optional KL penalty) for one trained step.

    Gradients flow into ``new_logp``, ``mean_new`` (through the bias) and ``kl``; ``old_logp``,
    ``mean_old``, ``sigma_t``, ``sqrt_neg_dt`` and ``advantages`` are constants. On-policy
    (``μ_θ = μ_old``, equal log-probs) every ratio is exactly 1 and the loss is
    ``mean(−A / s̄²)``.

    Args:
        new_logp: (B,) per-element-mean log-probs of the stored transitions under the current policy.
        old_logp: (B,) the same, recorded at sampling time.
        mean_new: (B, ...) the step means μ_θ recomputed now.
        mean_old: (B, ...) the step means μ_old stored at sampling.
        sigma_t: (B,) σ̄, the mean noise scale σ_t of each sample's trained step(s); > 0.
        sqrt_neg_dt: (B,) s̄, the mean ``sqrt(−dt)`` of each sample's trained step(s); > 0.
        advantages: (B,) advantages.
        clip_range: ε of the trust region ``[1-ε, 1+ε]`` on the normalised ratio; must be > 0.
        kl: (B,) per-sample KL to the reference, or None. Always logged as ``kl_loss``; weighted by
            ``kl_weight`` (not by ``1/s̄²``) into ``loss``.
        kl_weight: KL weight β (``algo.kl_weight``), >= 0; > 0 requires ``kl``.

    Returns:
        :class:`~rlgen_cli.algos.grpo.GRPOLossOut`; ``stats`` holds :func:`grpo_loss`'s keys plus
        ``guard_bias_mean``, ``guard_bias_max``, ``guard_scale_mean`` (s̄σ̄) and ``guard_weight_mean``
        (1/s̄²).

    Raises:
        ValueError: On shape mismatch, an empty batch, or σ̄ or s̄ not finite and > 0.
    """
    _check_args(
        new_logp, old_logp, mean_new, mean_old, sigma_t, sqrt_neg_dt, advantages, clip_range, kl, kl_weight
    )
    adv = advantages.detach()  # (B,)
    s_bar = sqrt_neg_dt.detach()  # (B,)
    scale = s_bar * sigma_t.detach()  # (B,) the step std s̄·σ̄
    weight = 1.0 / s_bar**2  # (B,) gradient reweighting 1/s̄²
    bias = _mean_shift_bias(mean_new, mean_old, scale)  # (B,)
    plain_log_ratio = new_logp - old_logp.detach()  # (B,)
    ratio = torch.exp((plain_log_ratio + bias) * scale)  # (B,)
    unclipped = -adv * ratio  # (B,)
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)  # (B,)
    policy_loss = (torch.maximum(unclipped, clipped) * weight).mean()  # ()
    if kl is None:
        kl_loss = policy_loss.new_zeros(())
        loss = policy_loss
    else:
        kl_loss = kl.mean()  # ()
        loss = policy_loss + kl_weight * kl_loss
    stats = _ratio_stats(plain_log_ratio.detach(), ratio.detach(), clip_range)
    stats.update(_guard_stats(bias.detach(), scale, weight))
    return GRPOLossOut(
        loss=loss,
        policy_loss=policy_loss.detach(),
        kl_loss=kl_loss.detach(),
        stats=stats,
    )
