"""Token-level GRPO objective for language / vision-language policies.

GRPO (Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models") with the loss variants of TRL's ``GRPOTrainer`` (von Werra et al., TRL) and R1-VL's StepGRPO
(Zhang et al. 2025, which is this loss with ``loss_type="grpo"`` and rule rewards). For each completion
token t of sequence i, with r = exp(log π_θ − log π_old) and group advantage A_i:

    ℓ_{i,t} = −min(r·A_i, clip(r, 1 − ε, 1 + ε_high)·A_i) + β·KL_{i,t}
    KL_{i,t} = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1        (k3, Schulman's estimator)

``importance_level="sequence"`` replaces r by exp(mean_t log-ratio) of the sequence (GSPO), shared by its
tokens. ``bias_correction_kl`` (TRL ≥ 1.16's ``use_bias_correction_kl``, DeepSeek-V3.2) weights the KL by
the ratio, β·r·KL_{i,t} with r not detached: the KL's gradient then estimates the reverse KL's without
bias when the samples come from π_old; on policy r = 1 in value but its gradient adds KL·∇log π_θ. Aggregation over the (B, T) token grid with completion mask m (TRL's names):

* ``grpo``    — mean_i( Σ_t m·ℓ / Σ_t m ): per-sequence token mean, then batch mean (DeepSeekMath, R1-VL);
* ``bnpo``    — Σ m·ℓ / Σ m over this micro-batch;
* ``dr_grpo`` — Σ m·ℓ / (B · max_completion_length) (Dr. GRPO: no length bias);
* ``dapo``    — Σ m·ℓ / num_items, num_items = completion tokens of the whole accumulated batch (DAPO).

Group advantages (:func:`advantage_options`): A_i = (r_i − mean_g r) / (std_g r + ε), ε = ``algo.adv_eps`` (1e-4), with the
*unbiased* std by default (``torch.std``, as R1-VL's trainer and TRL compute it; at G = 4 it is
√(4/3) ≈ 1.155 times the population std, so advantages are that much smaller); ``population`` is
rlgen's flow-side estimator (docs/maths.md §4.2, §8.1).

Everything is pure torch on log-probabilities the caller computed at temperature 1 (raw logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from rlgen_cli.schema.choices import TokenRewardScaling

__all__ = [
    "ADV_EPS", "TokenLossOut", "advantage_options", "aggregate", "k3_kl", "log_importance_weights",
    "token_grpo_loss",
]  # fmt: skip

ADV_EPS = 1e-4
"""Added to the std before dividing (R1-VL's trainer and TRL alike)."""


def advantage_options(scale_rewards: str, std_estimator: str, eps: float = ADV_EPS) -> dict[str, object]:
    """``combine_rewards`` options for TRL's ``scale_rewards`` (group | batch | none) and the std estimator.

    ``group`` divides by each prompt's std, ``batch`` by the std of the whole batch, ``none`` only
    centres on the group mean (Dr. GRPO); the std is ``unbiased`` (n − 1) or ``population`` (n).
    """
    assert scale_rewards in get_args(TokenRewardScaling), scale_rewards
    return {
        "global_std": scale_rewards == "batch",
        "scale": "none" if scale_rewards == "none" else "std",
        "eps": eps,
        "std_estimator": std_estimator,
    }


@dataclass
class TokenLossOut:
    """The objective of one micro-batch.

    Attributes:
        loss: Scalar to backpropagate (policy term + β·KL, aggregated).
        policy_loss: Detached scalar, the clipped surrogate alone, same aggregation.
        kl: Detached scalar, the masked token mean of the k3 KL (0 without a reference).
        stats: Floats for logging: ``clipfrac`` (low/high), ``ratio_min/max/mean``, ``approx_kl``.
    """

    loss: Tensor
    policy_loss: Tensor
    kl: Tensor
    stats: dict[str, float]


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(π_θ ‖ π_ref): exp(Δ) − Δ − 1 with Δ = log π_ref − log π_θ; (B, T)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def log_importance_weights(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """log r per token (B, T), or per sequence (B, 1) as the masked mean of the token log-ratios."""
    log_ratio = logp - old_logp  # (B, T)
    if level == "token":
        return log_ratio
    assert level == "sequence", level
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    num_items: float | None = None,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar as TRL's ``loss_type`` does (see the module docstring).

    Args:
        per_token: (B, T) per-token loss.
        mask: (B, T) completion mask (1 = real completion token).
        loss_type: grpo | bnpo | dr_grpo | dapo.
        max_completion_length: ``dr_grpo``'s constant (default: T).
        num_items: ``dapo``'s token count of the whole accumulated batch (default: this micro-batch's).
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * (max_completion_length or per_token.shape[1]))
    assert loss_type == "dapo", loss_type
    return masked.sum() / max(float(num_items if num_items is not None else mask.sum()), 1.0)


def _clip_stats(coef: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """TRL's clip fractions: low = r < 1−ε with A < 0; high = r > 1+ε_high with A > 0 (token means)."""
    low = ((coef < 1 - eps_low) & (adv < 0)).to(mask.dtype)
    high = ((coef > 1 + eps_high) & (adv > 0)).to(mask.dtype)
    ratios = coef.expand_as(mask)[mask > 0]
    return {
        "clipfrac_low": _masked_mean(low.expand_as(mask), mask).item(),
        "clipfrac_high": _masked_mean(high.expand_as(mask), mask).item(),
        "clipfrac": _masked_mean(torch.maximum(low, high).expand_as(mask), mask).item(),
        "ratio_mean": ratios.mean().item() if ratios.numel() else 1.0,
        "ratio_min": ratios.min().item() if ratios.numel() else 1.0,
        "ratio_max": ratios.max().item() if ratios.numel() else 1.0,
    }


def token_grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "grpo",
    importance_level: str = "token",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    kl_weight: float = 0.0,
    ref_logp: Tensor | None = None,
    max_completion_length: int | None = None,
    num_items: float | None = None,
    bias_correction_kl: bool = False,
) -> TokenLossOut:
    """The clipped token-level GRPO surrogate with an optional k3 KL penalty.

    Args:
        logp: (B, T) log π_θ of the completion tokens (with gradients).
        old_logp: (B, T) log π_old recorded for the rollout (no gradients).
        advantages: (B,) group advantages.
        mask: (B, T) completion mask.
        loss_type: Aggregation, see :func:`aggregate`.
        importance_level: ``token`` or ``sequence``.
        epsilon: Lower clip ε (and upper, unless ``epsilon_high``).
        epsilon_high: Upper clip ε (DAPO's clip-higher); None = ``epsilon``.
        kl_weight: KL weight β; with β > 0, ``ref_logp`` is required.
        ref_logp: (B, T) log π_ref (no gradients).
        max_completion_length: For ``dr_grpo``.
        num_items: For ``dapo``.
        bias_correction_kl: Multiply the per-token KL by the (differentiable) ratio r, as TRL's
            ``use_bias_correction_kl``; with ``importance_level="sequence"`` the sequence's r.

    Returns:
        :class:`TokenLossOut`.

    Raises:
        ValueError: On mismatched shapes.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape or advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"shapes disagree: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, mask "
            f"{tuple(mask.shape)}, advantages {tuple(advantages.shape)}; expected (B, T) ×3 and (B,)"
        )
    assert kl_weight == 0 or ref_logp is not None, "kl_weight > 0 needs ref_logp (the frozen reference's)"
    mask = mask.to(logp.dtype)
    valid = mask > 0  # padded positions may hold anything (even ±inf): they must not reach exp or grads
    old_logp = torch.where(valid, old_logp.detach(), 0.0)
    logp = torch.where(valid, logp, old_logp)
    ref_logp = None if ref_logp is None else torch.where(valid, ref_logp.detach(), logp.detach())
    eps_high = epsilon if epsilon_high is None else epsilon_high
    coef = torch.exp(log_importance_weights(logp, old_logp, mask, importance_level))  # (B,T)|(B,1)
    adv = advantages.to(logp.dtype).unsqueeze(-1)  # (B, 1)
    surrogate = -torch.min(coef * adv, torch.clamp(coef, 1 - epsilon, 1 + eps_high) * adv).expand_as(logp)
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    penalty = kl * coef if bias_correction_kl else kl  # (B, T)
    per_token = surrogate + kl_weight * penalty if kl_weight > 0 else surrogate
    options = {"max_completion_length": max_completion_length, "num_items": num_items}
    loss = aggregate(per_token, mask, loss_type, **options)
    stats = _clip_stats(coef.detach(), adv, mask, epsilon, eps_high)
    stats["approx_kl"] = _masked_mean(0.5 * (logp.detach() - old_logp) ** 2, mask).item()
    return TokenLossOut(
        loss=loss,
        policy_loss=aggregate(surrogate.detach(), mask, loss_type, **options),
        kl=_masked_mean(kl.detach(), mask),
        stats=stats,
    )
