"""Deterministic ODE solvers for flow matching, and the compressed schedule MixGRPO-Flash runs them on.

* :func:`euler` — the first-order Euler step ``x' = x + v·(σ' − σ)`` of the probability-flow ODE.
* :func:`dpm_solver_2m` — the second-order multistep DPM-Solver++ (Lu et al. 2022, "DPM-Solver++: Fast
  Solver for Guided Sampling of Diffusion Probabilistic Models", Alg. 2, the "midpoint" form used by
  diffusers) written for flow matching, as MixGRPO-Flash (Li et al. 2025, "MixGRPO") uses it for the ODE
  steps after the SDE window.
* :func:`compressed_schedule` — keeps a schedule up to the window's end and re-samples the rest with a
  fraction of the steps.

Flow matching as a diffusion: ``x_σ = α·x₀ + σ·ε`` with ``α = 1 − σ``; the data prediction is
``x̂₀ = x − σ·v`` and the half log-SNR ``λ = log(α/σ)``. DPM-Solver++'s first-order step
``x_t = (σ_t/σ_s)·x_s + α_t·(1 − e^{−h})·x̂₀``, ``h = λ_t − λ_s``, simplifies to
``(σ_t/σ_s)·x_s + (1 − σ_t/σ_s)·x̂₀``: exactly the Euler step, finite even at σ_s = 1 (λ = −∞).

Edge handling: at σ = 1 the log-SNR is −∞, so the step *from* σ = 1 is first order and the step after it
too (its previous λ-interval is infinite, so the second-order correction vanishes in the limit; it is
skipped explicitly). A step *to* σ = 0 returns ``x̂₀`` (λ = +∞: DPM-Solver++ with ``lower_order_final``).
Both keep second-order global accuracy (one or two first-order steps add O(Δσ²)).

Every solver takes the model as ``velocity(x (B, ...), sigma 0-d) -> v (B, ...)`` and works in the
dtype of ``x`` promoted to at least float32. Gradients flow if the caller enables them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["compressed_schedule", "dpm_solver_2m", "euler"]

Velocity = Callable[[Tensor, Tensor], Tensor]
"""``velocity(x (B, ...), sigma 0-d) -> v (B, ...)``."""


def _check_sigmas(sigmas: Tensor) -> list[float]:
    """``sigmas`` as Python floats after checking they form a descending schedule in [0, 1]."""
    if sigmas.dim() != 1 or sigmas.numel() < 2:
        raise ValueError(
            f"sigmas must be a 1-D tensor of K + 1 >= 2 noise levels, got shape {tuple(sigmas.shape)}; "
            "pass e.g. sd3_sigmas(num_steps)"
        )
    values = [float(s) for s in sigmas.tolist()]
    if not all(0.0 <= s <= 1.0 for s in values) or any(b >= a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"sigmas must decrease strictly within [0, 1] (σ = 1 noise, σ = 0 data), got {values}; "
            "a solver walks from noise towards data"
        )
    return values


def _working(x: Tensor) -> Tensor:
    """``x`` in at least float32 (bf16 latents lose the ODE's accuracy)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _log_snr(sigma: float) -> float:
    """λ = log(α/σ) with α = 1 − σ, for σ in (0, 1)."""
    return math.log1p(-sigma) - math.log(sigma)


def euler(velocity: Velocity, x: Tensor, sigmas: Tensor) -> Tensor:
    """Integrates the flow ODE with Euler steps ``x ← x + v(x, σ_i)·(σ_{i+1} − σ_i)``.

    Args:
        velocity: The model, ``velocity(x, sigma) -> v``.
        x: (B, ...) the state at ``sigmas[0]``.
        sigmas: (K + 1,) strictly descending noise levels in [0, 1].

    Returns:
        (B, ...) the state at ``sigmas[-1]``, in ``x``'s dtype promoted to at least float32.

    Raises:
        ValueError: If ``sigmas`` is not a strictly descending 1-D schedule in [0, 1].
    """
    values = _check_sigmas(sigmas)
    x = _working(x)
    for i in range(len(values) - 1):
        v = velocity(x, sigmas[i]).to(x.dtype)  # (B, ...)
        x = x + v * (values[i + 1] - values[i])
    return x


def _first_order(x: Tensor, x0: Tensor, sigma: float, sigma_next: float) -> Tensor:
    """DPM-Solver++ (1) = DDIM = Euler for flow matching: ``(σ'/σ)·x + (1 − σ'/σ)·x̂₀``."""
    ratio = sigma_next / sigma
    return ratio * x + (1.0 - ratio) * x0


def _second_order(
    x: Tensor, x0: Tensor, prev_x0: Tensor, lam_prev: float, sigma: float, sigma_next: float
) -> Tensor:
    """DPM-Solver++ (2M), midpoint form: uses the previous data prediction ``prev_x0`` at λ ``lam_prev``.

    ``x_t = (σ_t/σ_s)·x + c·D0 + ½·c·D1`` with ``c = α_t·(1 − e^{−h})``, ``D0 = x̂₀``,
    ``D1 = (x̂₀ − x̂₀_prev)/r``, ``r = h_prev/h``.
    """
    lam, lam_next = _log_snr(sigma), _log_snr(sigma_next)
    h, h_prev = lam_next - lam, lam - lam_prev
    c = (1.0 - sigma_next) * -math.expm1(-h)
    d1 = (x0 - prev_x0) * (h / h_prev)  # (B, ...)
    return (sigma_next / sigma) * x + c * x0 + 0.5 * c * d1


def dpm_solver_2m(velocity: Velocity, x: Tensor, sigmas: Tensor) -> Tensor:
    """Integrates the flow ODE with the second-order multistep DPM-Solver++ (one model call per step).

    The first step (and the step after a σ = 1 step) is first order; a final step to σ = 0 returns the
    data prediction ``x̂₀ = x − σ·v``. With σ uniform in [1, σ_end] the global error falls ≈ 4× per doubling
    of the steps; down to σ = 0 the last few uniform-in-σ steps are long in λ (``log(k/(k−1))``), so the
    asymptotic rate appears only for many steps, though the error stays far below Euler's.

    Args:
        velocity: The model, ``velocity(x, sigma) -> v``.
        x: (B, ...) the state at ``sigmas[0]``.
        sigmas: (K + 1,) strictly descending noise levels in [0, 1], usually ending at 0.

    Returns:
        (B, ...) the state at ``sigmas[-1]``, in ``x``'s dtype promoted to at least float32.

    Raises:
        ValueError: If ``sigmas`` is not a strictly descending 1-D schedule in [0, 1].
    """
    values = _check_sigmas(sigmas)
    x = _working(x)
    prev_x0: Tensor | None = None  # x̂₀ of the previous step, None when it was at σ = 1
    lam_prev = 0.0
    for i in range(len(values) - 1):
        sigma, sigma_next = values[i], values[i + 1]
        x0 = x - sigma * velocity(x, sigmas[i]).to(x.dtype)  # (B, ...) data prediction
        if sigma_next == 0.0:
            x = x0
        elif prev_x0 is None:
            x = _first_order(x, x0, sigma, sigma_next)
        else:
            x = _second_order(x, x0, prev_x0, lam_prev, sigma, sigma_next)
        prev_x0, lam_prev = (x0, _log_snr(sigma)) if sigma < 1.0 else (None, 0.0)
    return x


def compressed_schedule(sigmas: Tensor, start: int, ratio: float) -> Tensor:
    """Keeps ``sigmas[: start + 1]`` and re-samples the rest with ``max(1, round(ratio·(K − start)))`` steps.

    MixGRPO-Flash runs the ODE steps after its SDE window on fewer, second-order steps: with the last
    SDE step ``j`` (:func:`rlgen_cli.sde.window.last_sde_step`) pass ``start = j + 1``. The new levels
    re-sample the *given* schedule at evenly spaced fractional step indices between ``start`` and ``K``
    (piecewise-linear in the index), so a shifted schedule keeps its shape without knowing its shift
    (MixGRPO instead rebuilds a linspace in unshifted time and re-applies its SD3 shift); the first kept
    level is ``sigmas[start]`` and the last exactly ``sigmas[-1]``. ``round`` rounds halves up.

    Args:
        sigmas: (K + 1,) strictly descending noise levels in [0, 1].
        start: Index of the first level to re-sample from, in ``[0, K − 1]``.
        ratio: Share of the remaining ``K − start`` steps to keep, in (0, 1].

    Returns:
        (start + n + 1,) float32 levels, ``n = max(1, round(ratio·(K − start)))``, on ``sigmas``' device.

    Raises:
        ValueError: If ``sigmas`` is not a descending schedule.
    """
    _check_sigmas(sigmas)
    steps = sigmas.numel() - 1  # K
    assert 0 <= start < steps and 0 < ratio <= 1, (start, steps, ratio)  # algo.flash.ratio, checked
    remaining = steps - start
    n = max(1, math.floor(ratio * remaining + 0.5))
    grid = sigmas.to(torch.float64)  # (K + 1,)
    index = torch.linspace(start, steps, n + 1, dtype=torch.float64, device=sigmas.device)  # (n + 1,)
    lower = index.floor().long().clamp(max=steps - 1)  # (n + 1,)
    frac = index - lower  # (n + 1,) in [0, 1]
    tail = grid[lower] + frac * (grid[lower + 1] - grid[lower])  # (n + 1,)
    tail[-1] = grid[-1]  # exact end (usually 0)
    return torch.cat([grid[:start], tail]).float()  # (start + n + 1,)
