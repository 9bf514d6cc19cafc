"""Noise schedules (sigmas) for flow-matching samplers.

Implements the two schedules used by the flow models rlgen trains, reproducing diffusers'
``FlowMatchEulerDiscreteScheduler`` (Esser et al., 2024, "Scaling Rectified Flow Transformers for
High-Resolution Image Synthesis", the SD3 paper, §5.3.2 "resolution-dependent shifting"):

* SD3 / SD3.5: a static shift ``s·σ / (1 + (s − 1)·σ)`` of a linear grid (:func:`sd3_sigmas`).
* FLUX / Qwen-Image: a dynamic, resolution-dependent exponential time shift with
  ``μ`` linear in the image token count (:func:`calculate_mu`, :func:`dynamic_shift_sigmas`).

Convention (docs/maths.md §1.1): ``x_σ = (1 − σ)·x₀ + σ·ε``; σ = 1 is pure noise; a schedule walks
σ₀ = 1 > σ₁ > … > σ_T = 0 and has ``T + 1`` entries (the final 0 is appended). Schedules are computed
in float64 (as diffusers does with numpy) and returned as float32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["calculate_mu", "dynamic_shift_sigmas", "sd3_sigmas", "shift_sigmas"]


def _check_shift(shift: float) -> None:
    if not shift > 0 or not math.isfinite(shift):
        raise ValueError(
            f"shift must be a finite number > 0, got {shift!r}: the SD3 shift s·σ/(1+(s−1)·σ) is "
            "only a monotone map of [0, 1] for s > 0; use 3.0 for SD3.5 or 1.0 for no shift."
        )


def _shift(sigmas: Tensor, shift: float) -> Tensor:
    """SD3 shift in the dtype of ``sigmas`` (no cast)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """Applies the SD3 timestep shift ``s·σ / (1 + (s − 1)·σ)``.

    Args:
        sigmas: Noise levels in [0, 1], any shape.
        shift: Shift factor ``s`` > 0; ``s > 1`` spends more steps at high noise, ``s = 1`` is identity.

    Returns:
        The shifted sigmas, same shape, float32.

    Raises:
        ValueError: If ``shift`` is not a finite positive number.
    """
    _check_shift(shift)
    return _shift(sigmas.float(), shift)


def sd3_sigmas(num_steps: int, shift: float = 3.0, sigma_min: float = 1 / 1000) -> Tensor:
    """SD3 / SD3.5 schedule, identical to ``FlowMatchEulerDiscreteScheduler(shift=shift)``.

    diffusers builds its training sigmas ``k/1000`` (k = 1000…1), shifts them once in the
    constructor, then places ``num_steps`` points linearly between the largest and the smallest
    *shifted* training sigma and shifts those again. So the grid is
    ``linspace(1, shift(sigma_min), T)``, shifted, with 0 appended; for T = 10 and s = 3 the last
    non-zero sigma is 0.00893 (not shift(0.001) = 0.00299). This reproduces that exactly.

    Args:
        num_steps: Number of denoising steps ``T`` >= 1.
        shift: SD3 shift ``s`` > 0 (3.0 for SD3.5).
        sigma_min: Smallest training sigma before the shift (``1 / num_train_timesteps``).

    Returns:
        Sigmas of shape ``(T + 1,)``, float32, from 1 down to a final 0.

    Raises:
        ValueError: If ``shift`` <= 0 (a family's ``model.shift``).
    """
    assert num_steps >= 1 and 0 < sigma_min < 1, (num_steps, sigma_min)
    _check_shift(shift)
    end = _shift(torch.tensor(sigma_min, dtype=torch.float64), shift)  # ()
    base = torch.linspace(1.0, float(end), num_steps, dtype=torch.float64)  # (T,)
    sigmas = _shift(base, shift)  # (T,)
    return torch.cat([sigmas, sigmas.new_zeros(1)]).float()  # (T + 1,)


def calculate_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX dynamic-shift exponent ``μ``, linear in the number of image tokens.

    ``μ = base_shift + (max_shift − base_shift)·(image_seq_len − base_seq_len)/(max_seq_len −
    base_seq_len)`` (diffusers' ``calculate_shift``); it extrapolates outside the range.

    Args:
        image_seq_len: Number of image tokens of the (packed) latent, e.g. 4096 for FLUX at 1024 px.
        base_seq_len: Token count that gets ``base_shift``.
        max_seq_len: Token count that gets ``max_shift``.
        base_shift: ``μ`` at ``base_seq_len``.
        max_shift: ``μ`` at ``max_seq_len``.

    Returns:
        The exponent ``μ`` as a Python float.

    """
    assert max_seq_len != base_seq_len, "μ is interpolated between base_seq_len and max_seq_len"
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return float(image_seq_len * slope + intercept)


def dynamic_shift_sigmas(num_steps: int, mu: float) -> Tensor:
    """FLUX / Qwen-Image schedule with a resolution-dependent (exponential) time shift.

    Base grid ``linspace(1, 1/T, T)``, mapped by ``exp(μ) / (exp(μ) + (1/σ − 1))``, then a final 0;
    equal to diffusers' scheduler with ``use_dynamic_shifting=True`` and
    ``set_timesteps(sigmas=linspace(1, 1/T, T), mu=mu)``.

    Args:
        num_steps: Number of denoising steps ``T`` >= 1.
        mu: Shift exponent, see :func:`calculate_mu`; ``μ = 0`` leaves the grid unchanged.

    Returns:
        Sigmas of shape ``(T + 1,)``, float32, from 1 down to a final 0.
    """
    assert num_steps >= 1 and math.isfinite(mu), (num_steps, mu)
    base = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)  # (T,)
    e_mu = math.exp(mu)
    sigmas = e_mu / (e_mu + (1.0 / base - 1.0))  # (T,)
    return torch.cat([sigmas, sigmas.new_zeros(1)]).float()  # (T + 1,)
