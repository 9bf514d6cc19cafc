"""Flow-DPO: Diffusion-DPO on the flow-matching (velocity) error.

Implements the preference objective of Flow-DPO (Liu et al. 2025, "Improving Video Generation with
Human Feedback"), the flow-matching form of Diffusion-DPO (Wallace et al. 2023, "Diffusion Model
Alignment Using Direct Preference Optimization"). For a pair (winner w, loser l) noised with the
*same* σ and ε (docs/maths.md §7.1):

    e          = mean((v(x_σ) − (ε − x₀))²)                     (per sample, over non-batch dims)
    inner      = (e_θʷ − e_refʷ) − (e_θˡ − e_refˡ)
    L          = mean(−log σ(−(β/2)·inner)),  β = 100

``inner < 0`` means the policy lowered the winner's error relative to the loser's more than the
reference did: the pair is "implicitly correct" (Diffusion-DPO's ``implicit_acc``). The implicit
reward of a sample is ``−(β/2)·(e_θ − e_ref)``, so the logit inside σ is the reward margin.

Helpers: :func:`flow_matching_error` (the per-sample ``e``), :func:`sample_dpo_sigmas` (logit-normal
u mapped through the 1000-entry training schedule) and :func:`preference_pairs` (argmax / argmin reward
per prompt group, constant groups skipped and counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlgen_cli.algos.advantages import group_moments

__all__ = [
    "NUM_TRAIN_TIMESTEPS",
    "DPOLossOut",
    "PreferencePairs",
    "dpo_loss",
    "flow_matching_error",
    "preference_pairs",
    "sample_dpo_sigmas",
]

NUM_TRAIN_TIMESTEPS = 1000  # entries of the training schedule σ table (diffusers num_train_timesteps)


@dataclass(frozen=True)
class DPOLossOut:
    """Result of :func:`dpo_loss`.

    Attributes:
        loss: Scalar to backpropagate: ``mean(−log σ(−(β/2)·inner))`` (differentiable).
        stats: As Python floats: ``implicit_acc`` (fraction of pairs with ``inner < 0``),
            ``reward_chosen`` / ``reward_rejected`` (means of ``−(β/2)·(e_θ − e_ref)``),
            ``reward_margin`` (their difference, the mean logit), ``err_policy_chosen``,
            ``err_policy_rejected``, ``err_ref_chosen``, ``err_ref_rejected`` (mean errors).
    """

    loss: Tensor
    stats: dict[str, float]


class PreferencePairs(NamedTuple):
    """Result of :func:`preference_pairs`.

    Attributes:
        chosen: (P,) int64 index of each pair's highest-reward sample.
        rejected: (P,) int64 index of each pair's lowest-reward sample.
        num_skipped: Groups without a pair (all rewards equal, or a single sample).
    """

    chosen: Tensor
    rejected: Tensor
    num_skipped: int


# --------------------------------------------------------------------------------------------------
# flow-matching error and σ sampling
# --------------------------------------------------------------------------------------------------


def flow_matching_error(v_pred: Tensor, x0: Tensor, noise: Tensor) -> Tensor:
    """Per-sample flow-matching error ``mean((v − (ε − x₀))²)`` over the non-batch dims.

    Computed in at least float32 (bf16 predictions are upcast).

    Args:
        v_pred: (B, ...) predicted velocity at ``x_σ = (1−σ)·x₀ + σ·ε``.
        x0: (B, ...) clean latents.
        noise: (B, ...) the noise ε used to build ``x_σ``.

    Returns:
        (B,) errors.

    Raises:
        ValueError: Unless the three tensors share one shape (B, ...) with B >= 1.
    """
    if not v_pred.shape == x0.shape == noise.shape or v_pred.ndim == 0 or v_pred.shape[0] == 0:
        raise ValueError(
            f"v_pred {tuple(v_pred.shape)}, x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must share "
            "one non-empty shape (B, ...); pass the prediction, clean latents and noise of the same batch."
        )
    dtype = torch.promote_types(v_pred.dtype, torch.float32)
    target = noise.detach().to(dtype) - x0.detach().to(dtype)  # (B, ...)
    return (v_pred.to(dtype) - target).pow(2).flatten(1).mean(dim=1)  # (B,)


def sample_dpo_sigmas(n: int, sigmas_table: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw ``n`` training σ: logit-normal ``u ~ sigmoid(N(0, 1))``, ``σ = sigmas_table[⌊1000·u⌋]``.

    ``sigmas_table`` is the *training* schedule: the 1000 σ of the scheduler configured with
    ``num_train_timesteps=1000`` (shift applied, highest σ first), not the shorter inference schedule
    used for sampling. Winner and loser of a pair must get the same σ (and ε): draw one σ per pair.

    Args:
        n: Number of σ to draw, >= 1.
        sigmas_table: (1000,) training-schedule σ.
        generator: Optional generator (its device is where ``u`` is drawn); None uses the global RNG on
            the CPU.

    Returns:
        (n,) σ in ``sigmas_table``'s dtype and on its device.

    Raises:
        ValueError: If ``n < 1`` or ``sigmas_table`` is not 1-D of length 1000.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    if sigmas_table.ndim != 1 or sigmas_table.numel() != NUM_TRAIN_TIMESTEPS:
        raise ValueError(
            f"sigmas_table must be the 1-D training schedule of {NUM_TRAIN_TIMESTEPS} σ, got shape "
            f"{tuple(sigmas_table.shape)}; build it from a scheduler with num_train_timesteps="
            f"{NUM_TRAIN_TIMESTEPS} (not the {sigmas_table.numel()}-entry inference schedule)."
        )
    device = generator.device if generator is not None else torch.device("cpu")
    u = torch.sigmoid(torch.randn(n, generator=generator, device=device, dtype=torch.float64))  # (n,)
    idx = (u * NUM_TRAIN_TIMESTEPS).long().clamp_(0, NUM_TRAIN_TIMESTEPS - 1)  # (n,)
    return sigmas_table[idx.to(sigmas_table.device)]


# --------------------------------------------------------------------------------------------------
# pairs
# --------------------------------------------------------------------------------------------------


def _first_index_where(mask: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Lowest sample index with ``mask`` True in each group -> (G,) int64 (N where none)."""
    n = mask.numel()
    idx = torch.arange(n, device=mask.device)
    idx = torch.where(mask, idx, torch.full_like(idx, n))  # (N,)
    return idx.new_full((num_groups,), n).scatter_reduce_(0, inverse, idx, reduce="amin")


def preference_pairs(rewards: Tensor, group_ids: Tensor) -> PreferencePairs:
    """One (chosen, rejected) pair per group: the argmax and argmin reward (first index on ties).

    Groups whose rewards are all equal (singletons included) carry no preference: they are skipped
    and counted in ``num_skipped``. Pairs come in ascending group-id order.

    Args:
        rewards: (N,) float rewards; NaN/inf raise.
        group_ids: (N,) integer group ids (the prompt's dataset index).

    Returns:
        :class:`PreferencePairs` ``(chosen, rejected, num_skipped)``.

    Raises:
        ValueError: On bad shapes/dtypes or non-finite rewards (see :func:`group_moments`).
    """
    _, std, _ = group_moments(rewards, group_ids)  # validates; std == 0 exactly for constant groups
    uniq, inverse = torch.unique(group_ids, return_inverse=True)  # (G,), (N,)
    num_groups = int(uniq.numel())
    gmax = rewards.new_full((num_groups,), float("-inf")).scatter_reduce_(0, inverse, rewards, reduce="amax")
    gmin = rewards.new_full((num_groups,), float("inf")).scatter_reduce_(0, inverse, rewards, reduce="amin")
    chosen = _first_index_where(rewards == gmax[inverse], inverse, num_groups)  # (G,)
    rejected = _first_index_where(rewards == gmin[inverse], inverse, num_groups)  # (G,)
    constant = rewards.new_zeros(num_groups, dtype=torch.bool).index_fill_(0, inverse[std == 0], True)
    keep = ~constant  # (G,)
    return PreferencePairs(chosen[keep], rejected[keep], int(constant.sum()))


# --------------------------------------------------------------------------------------------------
# loss
# --------------------------------------------------------------------------------------------------


def _check_errors(errors: dict[str, Tensor], beta: float) -> None:
    """Raise ``ValueError`` unless the four error vectors share one non-empty (P,) shape."""
    shapes = {t.shape for t in errors.values()}
    first = next(iter(errors.values()))
    if len(shapes) != 1 or first.ndim != 1 or first.numel() == 0:
        listed = ", ".join(f"{k} {tuple(v.shape)}" for k, v in errors.items())
        raise ValueError(
            f"dpo_loss errors must share one non-empty 1-D shape (P,), got {listed}; pass one "
            "flow_matching_error per pair for policy/reference × chosen/rejected."
        )
    assert beta > 0, f"beta must be > 0 (the DPO temperature), got {beta}"


@torch.no_grad()
def _dpo_stats(
    inner: Tensor, beta: float, ew: Tensor, el: Tensor, rw: Tensor, rl: Tensor
) -> dict[str, float]:
    """Implicit accuracy, implicit rewards and mean errors, with one device sync."""
    reward_w = -(beta / 2) * (ew - rw)  # (P,)
    reward_l = -(beta / 2) * (el - rl)  # (P,)
    values = torch.stack(
        [
            (inner < 0).double().mean(),
            reward_w.double().mean(),
            reward_l.double().mean(),
            (reward_w - reward_l).double().mean(),
            ew.double().mean(),
            el.double().mean(),
            rw.double().mean(),
            rl.double().mean(),
        ]
    ).tolist()
    names = (
        "implicit_acc",
        "reward_chosen",
        "reward_rejected",
        "reward_margin",
        "err_policy_chosen",
        "err_policy_rejected",
        "err_ref_chosen",
        "err_ref_rejected",
    )
    return dict(zip(names, values, strict=True))


def dpo_loss(
    err_policy_w: Tensor,
    err_policy_l: Tensor,
    err_ref_w: Tensor,
    err_ref_l: Tensor,
    *,
    beta: float = 100.0,
) -> DPOLossOut:
    """Flow-DPO loss ``mean(−log σ(−(β/2)·[(e_θʷ − e_refʷ) − (e_θˡ − e_refˡ)]))``.

    Gradients flow into the policy errors only; the reference errors are constants. Computed with
    ``logsigmoid`` (stable for large β·inner).

    Args:
        err_policy_w: (P,) policy flow-matching error of each pair's chosen sample.
        err_policy_l: (P,) policy error of the rejected sample (same σ and ε as the chosen one).
        err_ref_w: (P,) reference error of the chosen sample.
        err_ref_l: (P,) reference error of the rejected sample.
        beta: DPO temperature, > 0.

    Returns:
        :class:`DPOLossOut`.

    Raises:
        ValueError: On mismatched or empty shapes.
    """
    errors = {
        "err_policy_w": err_policy_w,
        "err_policy_l": err_policy_l,
        "err_ref_w": err_ref_w,
        "err_ref_l": err_ref_l,
    }
    _check_errors(errors, beta)
    ref_w, ref_l = err_ref_w.detach(), err_ref_l.detach()
    inner = (err_policy_w - ref_w) - (err_policy_l - ref_l)  # (P,)
    loss = -F.logsigmoid(-(beta / 2) * inner).mean()  # ()
    stats = _dpo_stats(inner.detach(), beta, err_policy_w.detach(), err_policy_l.detach(), ref_w, ref_l)
    return DPOLossOut(loss=loss, stats=stats)
