"""Per-step KL between the policy's and the reference model's Gaussian transitions (docs/maths.md §3).

Implements the KL regulariser of Flow-GRPO (Liu et al., 2025, "Flow-GRPO: Training Flow Matching
Models via Online RL", Eq. 12). Both transitions share the std ``s`` (it depends only on the schedule),
so ``KL(N(μ, s²I) ‖ N(μ_ref, s²I)) = ‖μ − μ_ref‖² / (2s²)``.

* ``"gaussian"`` (default): that KL per element, ``mean((μ − μ_ref)²) / (2s²)``.
* ``"upstream"``: what Flow-GRPO's code computes, ``mean((μ − μ_ref)²) / (2σ_t²)`` with its step's
  ``σ_t``. For ``flow_sde`` (and ``dance``) ``σ_t = s / sqrt(−dt)``, so the term is ``"gaussian"·(−dt)``:
  the ``|dt|`` factor of the variance is missing and a β tuned for one form does not carry over. For
  ``cps`` the code's ``σ_t`` is the full std ``s``, so the upstream term equals ``"gaussian"``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlgen_cli.sde.step import _per_sample, reduce_nonbatch

__all__ = ["step_kl"]

FULL_STD_KINDS = ("cps",)  # kinds whose upstream σ_t is the total std s (no √(−dt) factor)


def _variance(s: Tensor, dt: Tensor | float, mean: Tensor, form: str, kind: str) -> Tensor:
    """(B,) the variance the KL divides by: s², or upstream's σ_t² = s²/(−dt) for flow_sde-like steps."""
    var = s**2
    if form == "gaussian" or kind in FULL_STD_KINDS:
        return var
    assert form == "upstream", form
    neg_dt = -_per_sample(dt, mean, "dt")  # (B,); 0 only on deterministic steps, whose KL is 0 anyway
    return var / torch.where(neg_dt > 0, neg_dt, torch.ones_like(neg_dt))


def step_kl(
    mean: Tensor,
    ref_mean: Tensor,
    std: Tensor | float,
    dt: Tensor | float,
    form: str = "gaussian",
    reduce: str = "mean",
    kind: str = "flow_sde",
) -> Tensor:
    """KL between two equal-variance Gaussian step transitions, per sample.

    Samples with ``std == 0`` (deterministic steps, never trained) get 0.

    Args:
        mean: ``(B, ...)`` policy step mean ``μ_θ`` (``StepOut.mean``).
        ref_mean: ``(B, ...)`` reference step mean ``μ_ref``.
        std: Total step std ``s``: float, 0-d or ``(B,)`` (``StepOut.std``).
        dt: ``sigma_next − sigma`` (<= 0): float, 0-d or ``(B,)``; used by ``form="upstream"`` only.
        form: ``"gaussian"`` (the Gaussian KL) or ``"upstream"`` (Flow-GRPO's term, see the module doc).
        reduce: ``"mean"`` (default, upstream) or ``"sum"`` (the KL of the joint) over non-batch dims.
        kind: The sampler step that produced ``std`` (``sampler.kind``); decides upstream's ``σ_t``.

    Returns:
        ``(B,)`` float32 KL values.

    Raises:
        ValueError: On mismatched shapes.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"mean has shape {tuple(mean.shape)} but ref_mean has {tuple(ref_mean.shape)}; pass the "
            "policy and reference step means of the same batch."
        )
    sq = reduce_nonbatch((mean.float() - ref_mean.float()) ** 2, reduce)  # (B,)
    s = _per_sample(std, mean, "std")  # (B,)
    live = s > 0  # (B,)
    safe = torch.where(live, s, torch.ones_like(s))  # (B,) avoids 0/0 on deterministic steps
    kl = sq / (2 * _variance(safe, dt, mean, form, kind))
    return torch.where(live, kl, torch.zeros_like(kl))
