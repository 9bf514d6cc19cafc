"""The Mix-GRPO loss of R3: token GRPO on the text track, Flow-GRPO on the image track (docs/maths.md §9.3).

    L = ce_weight·(L_text + kl_weight_text·KL_text) + mse_weight·L_img + kl_weight_image·KL_img

* ``L_text`` — the clipped token surrogate (ε = 0.2), per-sequence token mean then batch mean
  (``algos/token_grpo.py``, ``loss_type="grpo"``), log-probs at temperature 1; ``KL_text`` the k3 estimator
  against the reference (adapter off).
* ``L_img`` — the clipped surrogate of the one SDE step each image took (``algos/grpo.py``); ``KL_img`` =
  mean((μθ − μref)²)/s² at that step, s its total std (R3's form: twice the Gaussian KL of
  ``sde/kl.py``). Rows whose image track is masked (no edit happened) contribute neither term; the mean
  runs over all rows, so the scale does not depend on how many branches edited.

Each function returns the weighted loss of one micro-batch and its statistics; the recipe divides by the
number of micro-batches and calls backward once per track.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlgen_cli.algos.grpo import grpo_loss
from rlgen_cli.algos.token_grpo import token_grpo_loss
from rlgen_cli.sde.kl import step_kl
from rlgen_cli.sde.step import StepOut

__all__ = ["TrackLoss", "image_kl", "image_track_loss", "text_track_loss"]


@dataclass
class TrackLoss:
    """One track's weighted loss on a micro-batch (differentiable) and its statistics (floats)."""

    loss: Tensor
    stats: dict[str, float]


def text_track_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logp: Tensor | None,
    *,
    clip_range: float,
    ce_weight: float,
    kl_weight: float,
) -> TrackLoss:
    """ce_weight·(L_text + kl_weight·KL_text) on (B, L) completion log-probs.

    Args:
        logp: (B, L) log π_θ of the completion tokens (with gradients).
        old_logp: (B, L) log π_old recorded right after the rollout.
        advantages: (B,) text advantages.
        mask: (B, L) completion mask.
        ref_logp: (B, L) log π_ref, or None when kl_weight is 0.
        clip_range: ε.
        ce_weight: Weight of the track.
        kl_weight: β of the k3 KL.
    """
    out = token_grpo_loss(
        logp,
        old_logp,
        advantages,
        mask,
        loss_type="grpo",
        epsilon=clip_range,
        kl_weight=kl_weight,
        ref_logp=ref_logp,
    )
    stats = {f"text/{k}": v for k, v in out.stats.items()}
    stats |= {"text/policy_loss": out.policy_loss.item(), "text/kl": out.kl.item()}
    return TrackLoss(ce_weight * out.loss, stats)


def image_kl(out: StepOut, ref_mean: Tensor) -> Tensor:
    """(B,) mean((μθ − μref)²)/s² of one step: R3's image KL (twice the Gaussian KL)."""
    return 2 * step_kl(out.mean, ref_mean, out.std, dt=0.0)


def image_track_loss(
    out: StepOut,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    kl: Tensor | None,
    *,
    clip_range: float,
    mse_weight: float,
    kl_weight: float,
) -> TrackLoss:
    """mse_weight·L_img + kl_weight·KL_img for the trained step of B images.

    Args:
        out: The training-path step (log-prob and mean with gradients).
        old_logp: (B,) log-prob recorded at sampling.
        advantages: (B,) image advantages (0 where masked).
        mask: (B,) bool, False where the image track is masked.
        kl: (B,) :func:`image_kl`, or None when kl_weight is 0.
        clip_range: ε.
        mse_weight: Weight of the policy term.
        kl_weight: Weight of the KL term.
    """
    live = mask.to(out.logprob.dtype)
    policy = grpo_loss(out.logprob, old_logp, advantages * live, clip_range=clip_range)
    kl_term = (kl * live).mean() if kl is not None else torch.zeros((), device=live.device)
    stats = {f"image/{k}": v for k, v in policy.stats.items()}
    stats |= {"image/policy_loss": policy.policy_loss.item(), "image/kl": kl_term.detach().item()}
    return TrackLoss(mse_weight * policy.loss + kl_weight * kl_term, stats)
