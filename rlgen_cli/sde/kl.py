"""Per-step KL between the policy's and the reference model's Gaussian transitions.

Implements the KL regulariser of Flow-GRPO (Liu et al., 2025, "Flow-GRPO: Training Flow Matching
Models via Online RL", Eq. 12; REFERENCE §1.5). Both transitions share the std ``s`` (it depends only
on the schedule), so ``KL(N(μ, s²I) ‖ N(μ_ref, s²I)) = ‖μ − μ_ref‖² / (2s²)``.

* ``"true"`` (default): the Gaussian KL per element, ``mean((μ − μ_ref)²) / (2s²)``.
* ``"upstream"``: Flow-GRPO's code divides by ``2σ_t²`` with ``σ_t = s / sqrt(−dt)``, i.e. it omits
  the ``|dt|`` factor of the variance (acknowledged upstream); equals ``"true"·(−dt)``. Note that for
  ``cps`` upstream's ``σ_t`` is already the full std, so its KL is the ``"true"`` form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlgen_cli.sde.step import _check_choice, _per_sample, reduce_nonbatch

__all__ = ["KL_FORMS", "step_kl"]

KL_FORMS = ("true", "upstream")


def step_kl(
    mean: Tensor,
    ref_mean: Tensor,
    std: Tensor | float,
    dt: Tensor | float,
    form: str = "true",
    reduce: str = "mean",
) -> Tensor:
    """KL between two equal-variance Gaussian step transitions, per sample.

    Samples with ``std == 0`` (deterministic steps, never trained) get 0.

    Args:
        mean: ``(B, ...)`` policy step mean ``μ_θ`` (``StepOut.mean``).
        ref_mean: ``(B, ...)`` reference step mean ``μ_ref``.
        std: Total step std ``s``: float, 0-d or ``(B,)`` (``StepOut.std``).
        dt: ``sigma_next − sigma`` (<= 0): float, 0-d or ``(B,)``; used by ``form="upstream"`` only.
        form: ``"true"`` (Gaussian KL) or ``"upstream"`` (Flow-GRPO's, missing ``|dt|``).
        reduce: ``"mean"`` (default, upstream) or ``"sum"`` (the KL of the joint) over non-batch dims.

    Returns:
        ``(B,)`` float32 KL values.

    Raises:
        ValueError: On an unknown ``form`` / ``reduce`` or mismatched shapes.
    """
    _check_choice("KL form", form, KL_FORMS)
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"mean has shape {tuple(mean.shape)} but ref_mean has {tuple(ref_mean.shape)}; pass the "
            "policy and reference step means of the same batch."
        )
    sq = reduce_nonbatch((mean.float() - ref_mean.float()) ** 2, reduce)  # (B,)
    s = _per_sample(std, mean, "std")  # (B,)
    live = s > 0  # (B,)
    var = torch.where(live, s**2, torch.ones_like(s))  # (B,) s²
    if form == "upstream":
        neg_dt = -_per_sample(dt, mean, "dt")  # (B,)
        var = torch.where(live, var / neg_dt, var)  # σ_t² = s² / (−dt)
    kl = sq / (2 * var)
    return torch.where(live, kl, torch.zeros_like(kl))
