"""One denoising step of a flow-matching sampler, with the Gaussian log-probability of the transition.

Implements, in float32, the transition kernels that policy-gradient RL for flow models trains
(docs/maths.md §2):

* ``ode`` — deterministic Euler step ``x' = x + v·dt`` (rectified flow, Liu et al., 2022).
* ``flow_sde`` — the reverse-time SDE with the same marginals as the flow ODE, noise level
  ``σ_t = a·sqrt(σ/(1−σ))`` (Flow-GRPO: Liu et al., 2025, "Flow-GRPO: Training Flow Matching Models
  via Online RL", Eq. 9–10).
* ``dance`` — the same SDE drift written with the score and a constant noise scale η
  (DanceGRPO: Xue et al., 2025, "DanceGRPO: Unleashing GRPO on Visual Generation").
* ``cps`` — coefficients-preserving sampling, which re-mixes the predicted clean image and noise so
  the sample keeps the noise level of the schedule (Wang & Yu, 2025, "Coefficients-Preserving
  Sampling for Reinforcement Learning with Flow Matching").

Convention: ``x_σ = (1 − σ)·x₀ + σ·ε``, the model predicts ``v ≈ ε − x₀``, and a step goes from
``σ`` to ``σ_next < σ`` with ``dt = σ_next − σ < 0``. Every stochastic kind is ``x' = μ + s·z`` with
``z ~ N(0, I)``, so ``log p(x' | x)`` is a diagonal Gaussian with per-sample std ``s``. Every kind takes
one ``noise_level`` (a of ``flow_sde`` and ``cps``, η of ``dance``: ``sampler.noise_level``); at 0 each kind
is exactly the Euler ODE step. The arguments come checked from the config (``schema/choices.py``): a bad
kind, reduction or level here is a programming error, and fails an assert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["StepOut", "gaussian_logprob", "reduce_nonbatch", "step"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class StepOut:
    """Result of one sampler step.

    Attributes:
        prev: ``x_{t+1}``, same shape as ``x``, float32 (the given ``prev`` when recomputing).
        mean: ``μ``, the mean of ``x_{t+1}`` given ``x_t``, same shape as ``x``, float32.
        std: ``(B,)`` total std ``s`` of ``x_{t+1}`` given ``x_t``; 0 for deterministic steps.
        logprob: ``(B,)`` ``log p(prev | x)`` reduced over the non-batch dims; 0 where ``std == 0``.
    """

    prev: Tensor
    mean: Tensor
    std: Tensor
    logprob: Tensor


def reduce_nonbatch(t: Tensor, reduce: str) -> Tensor:
    """Reduces every dim but the first: ``(B, ...) -> (B,)`` by ``"mean"`` or ``"sum"``.

    Args:
        t: Tensor of shape ``(B, ...)``; a ``(B,)`` tensor is returned unchanged.
        reduce: ``"mean"`` or ``"sum"``.

    Returns:
        Tensor of shape ``(B,)``.
    """
    flat = t.reshape(t.shape[0], -1)  # (B, N)
    if reduce == "mean":
        return flat.mean(dim=1)
    assert reduce == "sum", reduce
    return flat.sum(dim=1)


def _per_sample(value: Tensor | float, x: Tensor, name: str) -> Tensor:
    """Converts a float, 0-d or ``(B,)`` tensor to a ``(B,)`` float32 tensor on ``x``'s device."""
    batch = x.shape[0]
    if not isinstance(value, Tensor):
        return torch.full((batch,), float(value), dtype=torch.float32, device=x.device)
    if value.ndim == 0 or (value.ndim == 1 and value.shape[0] == batch):
        return value.detach().float().to(x.device).expand(batch)
    raise ValueError(
        f"{name} has shape {tuple(value.shape)} but x has batch size {batch}; pass a float, a 0-d "
        f"tensor or a ({batch},) tensor with one noise level per sample."
    )


def _bcast(t: Tensor, x: Tensor) -> Tensor:
    """Views a ``(B,)`` tensor as ``(B, 1, ..., 1)`` to broadcast against ``x``."""
    return t.view(-1, *([1] * (x.ndim - 1)))


def _check_tensors(x: Tensor, v: Tensor, noise: Tensor | None, prev: Tensor | None) -> None:
    if x.ndim < 1:
        raise ValueError("x must have a batch dim, got a 0-d tensor; pass x of shape (B, ...).")
    if noise is not None and prev is not None:
        raise ValueError(
            "both noise and prev were given: pass noise (or neither) to sample a transition, or "
            "prev alone to recompute the log-prob of a stored one."
        )
    for name, t in (("v", v), ("noise", noise), ("prev", prev)):
        if t is not None and t.shape != x.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but x has {tuple(x.shape)}; they must match."
            )


def _flow_sde(
    x: Tensor, v: Tensor, sigma: Tensor, dt: Tensor, noise_level: float, sigma_max: float | None
) -> tuple[Tensor, Tensor]:
    """Flow-GRPO SDE mean and ``(B,)`` std (docs/maths.md §2.2)."""
    at_one = sigma == 1  # (B,)
    if sigma_max is None and bool(at_one.any()):
        raise ValueError(
            "flow_sde got sigma == 1, where σ_t = a·sqrt(σ/(1−σ)) is infinite; pass "
            "sigma_max=sigmas[1] (the schedule's first sigma below 1) to use in the denominator."
        )
    if sigma_max is not None and not 0 <= sigma_max < 1:
        raise ValueError(f"sigma_max must lie in [0, 1), got {sigma_max!r}; pass sigma_max=sigmas[1].")
    denom = torch.where(at_one, torch.full_like(sigma, sigma_max or 0.0), sigma)  # (B,)
    sigma_t = noise_level * torch.sqrt(sigma / (1 - denom))  # (B,)
    c_x = 1 + sigma_t**2 * dt / (2 * sigma)  # (B,)
    c_v = (1 + sigma_t**2 * (1 - sigma) / (2 * sigma)) * dt  # (B,)
    mean = x * _bcast(c_x, x) + v * _bcast(c_v, x)
    return mean, sigma_t * torch.sqrt(-dt)


def _dance(x: Tensor, v: Tensor, sigma: Tensor, dt: Tensor, noise_level: float) -> tuple[Tensor, Tensor]:
    """DanceGRPO score-form SDE mean and ``(B,)`` std with constant η (docs/maths.md §2.4)."""
    sig = _bcast(sigma, x)
    x0_hat = x - sig * v
    score = -(x - (1 - sig) * x0_hat) / sig**2
    mean = x + (v - 0.5 * noise_level**2 * score) * _bcast(dt, x)
    return mean, noise_level * torch.sqrt(-dt)


def _cps(
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, noise_level: float
) -> tuple[Tensor, Tensor]:
    """Coefficients-preserving sampling mean and ``(B,)`` std (docs/maths.md §2.5)."""
    sigma_t = sigma_next * math.sin(noise_level * math.pi / 2)  # (B,)
    sig = _bcast(sigma, x)
    x0_hat = x - sig * v
    x1_hat = x + (1 - sig) * v
    c_noise = torch.sqrt((sigma_next**2 - sigma_t**2).clamp_min(0))  # (B,)
    mean = _bcast(1 - sigma_next, x) * x0_hat + _bcast(c_noise, x) * x1_hat
    return mean, sigma_t


def gaussian_logprob(prev: Tensor, mean: Tensor, std: Tensor, reduce: str = "mean") -> Tensor:
    """Log-density of ``N(mean, std²·I)`` at ``prev``, reduced over non-batch dims.

    Per element ``−(prev − μ)²/(2s²) − log s − ½·log(2π)``, then mean or sum per sample. Samples with
    ``std == 0`` (deterministic transitions, which have no density and are never trained) get 0.
    ``prev`` is treated as data (detached), so gradients flow through ``mean`` only.

    Args:
        prev: ``(B, ...)`` the point to evaluate.
        mean: ``(B, ...)`` Gaussian mean.
        std: ``(B,)`` per-sample std ``s`` >= 0.
        reduce: ``"mean"`` (upstream Flow-GRPO) or ``"sum"`` (the true joint density).

    Returns:
        ``(B,)`` float32 log-probabilities.
    """
    sq = reduce_nonbatch((prev.detach().float() - mean.float()) ** 2, reduce)  # (B,)
    count = 1 if reduce == "mean" else prev[0].numel()
    live = std > 0  # (B,)
    s = torch.where(live, std.float(), torch.ones_like(std, dtype=torch.float32))  # (B,)
    logp = -sq / (2 * s**2) - count * (torch.log(s) + _HALF_LOG_2PI)  # (B,)
    return torch.where(live, logp, torch.zeros_like(logp))


def _upstream_logprob(prev: Tensor, mean: Tensor, std: Tensor, reduce: str) -> Tensor:
    """Upstream CPS "log-prob" ``−(prev − μ)²`` reduced per sample; 0 where ``std == 0``."""
    logp = -reduce_nonbatch((prev.detach().float() - mean) ** 2, reduce)  # (B,)
    return torch.where(std > 0, logp, torch.zeros_like(logp))


def _mean_std(
    kind: str,
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    noise_level: float,
    sigma_max: float | None,
) -> tuple[Tensor, Tensor]:
    """Dispatches to the kind's mean ``(B, ...)`` and std ``(B,)``; noise level 0 is the Euler ODE."""
    dt = sigma_next - sigma  # (B,)
    if bool((dt > 0).any()):
        raise ValueError(
            "sigma_next > sigma: a denoising step must go from noise toward data (dt = "
            "sigma_next − sigma <= 0); pass consecutive entries sigmas[i], sigmas[i + 1]."
        )
    if kind == "ode" or noise_level == 0:
        return x + v * _bcast(dt, x), torch.zeros_like(sigma)
    if kind == "flow_sde":
        return _flow_sde(x, v, sigma, dt, noise_level, sigma_max)
    if kind == "dance":
        return _dance(x, v, sigma, dt, noise_level)
    assert kind == "cps", kind
    return _cps(x, v, sigma, sigma_next, noise_level)


def step(
    kind: str,
    x: Tensor,
    v: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    *,
    noise_level: float = 0.0,
    noise: Tensor | None = None,
    prev: Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | None = None,
    reduce: str = "mean",
    logprob_form: str = "gaussian",
) -> StepOut:
    """Takes one sampler step from ``sigma`` to ``sigma_next`` and scores the transition.

    Exactly one mode: ``prev`` given recomputes ``log p(prev | x)`` of a stored transition (training;
    the returned ``prev`` is the given one); ``noise`` given samples ``μ + s·noise``; neither draws
    ``z ~ N(0, I)`` from ``generator``. Deterministic steps (``ode`` or ``noise_level == 0``, which equal
    ``x + v·dt`` exactly) draw no noise and have ``std = logprob = 0``.

    Args:
        kind: ``ode``, ``flow_sde``, ``dance`` or ``cps`` (``schema.choices.StepKind``).
        x: ``(B, ...)`` current sample ``x_t``: images ``(B, C, H, W)``, videos ``(B, C, F, H, W)``
            or packed tokens ``(B, L, D)``.
        v: ``(B, ...)`` predicted velocity at ``(x, sigma)``.
        sigma: Current σ of the schedule: float, 0-d or ``(B,)`` tensor.
        sigma_next: Next noise level (<= ``sigma``), same forms.
        noise_level: ≥ 0: a of ``flow_sde`` and ``cps`` (≤ 1 there), constant η of ``dance``.
        noise: Optional ``(B, ...)`` standard-normal draw to use.
        prev: Optional ``(B, ...)`` stored ``x_{t+1}`` to score.
        generator: RNG for the draw when neither ``noise`` nor ``prev`` is given.
        sigma_max: ``flow_sde`` only: the value replacing σ = 1 in ``1 − σ`` (pass ``sigmas[1]``).
        reduce: ``"mean"`` (default, upstream) or ``"sum"`` over non-batch dims for the log-prob.
        logprob_form: ``"gaussian"`` (true density) or ``"upstream"`` (``cps`` only: ``−(x'−μ)²``).

    Returns:
        :class:`StepOut` with float32 ``prev``, ``mean``, ``std`` ``(B,)`` and ``logprob`` ``(B,)``.

    Raises:
        ValueError: On both ``noise`` and ``prev``, shape mismatches, ``sigma_next > sigma``, or
            ``flow_sde`` at σ = 1 without ``sigma_max``.
    """
    assert 0 <= noise_level < math.inf and (kind != "cps" or noise_level <= 1), (kind, noise_level)
    assert logprob_form == "gaussian" or kind in ("cps", "ode"), (kind, logprob_form)
    _check_tensors(x, v, noise, prev)
    x, v = x.float(), v.float()
    sig, sig_next = _per_sample(sigma, x, "sigma"), _per_sample(sigma_next, x, "sigma_next")
    mean, std = _mean_std(kind, x, v, sig, sig_next, noise_level, sigma_max)  # (B, ...), (B,)
    std = std.contiguous()
    if prev is not None:
        prev = prev.float()
    elif kind == "ode" or noise_level == 0:
        prev = mean
    else:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        prev = mean + _bcast(std, x) * noise.float()
    if logprob_form == "upstream":
        logprob = _upstream_logprob(prev, mean, std, reduce)
    else:
        assert logprob_form == "gaussian", logprob_form
        logprob = gaussian_logprob(prev, mean, std, reduce)
    return StepOut(prev=prev, mean=mean, std=std, logprob=logprob)
