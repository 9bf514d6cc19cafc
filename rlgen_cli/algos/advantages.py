"""Group-relative advantages for GRPO-style objectives.

Implements the per-prompt group z-score of GRPO (Shao et al. 2024, "DeepSeekMath: Pushing the Limits of
Mathematical Reasoning in Open Language Models") as used by Flow-GRPO (Liu et al. 2025, "Flow-GRPO:
Training Flow Matching Models via Online RL"), MixGRPO and DanceGRPO (docs/maths.md §4.2):

    A_i = clip((r_i - mean_g(r)) / (std + eps), -clip_max, +clip_max)

where ``g`` is the group of sample ``i`` (all samples of one prompt, keyed by dataset index) and ``std``
is the group's or, with ``global_std``, the whole batch's standard deviation. ``std_estimator`` picks
the estimator: ``population`` (divide by n; Flow-GRPO's ``np.std``, eps 1e-4) or ``unbiased`` (divide by
n − 1; MixGRPO's and DanceGRPO's ``torch.std``, eps 1e-8). At group size G the unbiased std is
√(G/(G−1)) times the population one.

Multi-reward aggregation (``combine_rewards``) offers Flow-GRPO's ``sum_then_normalize``, MixGRPO's
``advantage_aggr`` (``normalize_then_sum``: normalise each reward within its group, then sum the
weighted advantages) and GDPO (``gdpo``; NVlabs 2026, "GDPO: Group reward-Decoupled Normalization Policy
Optimization for Multi-reward RL Optimization", arXiv 2601.05242, github.com/NVlabs/GDPO:
``normalize_then_sum``, then the sum normalised over the whole batch).

All group statistics come from :func:`group_moments`, the single place a distributed version (group
statistics all-reduced over a policy group of ranks) will replace. Options arrive checked from the config
(``schema/choices.py``); a bad one here is a programming error and fails an assert. Rewards are data:
a NaN or a bad shape raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

import torch
from torch import Tensor

from rlgen_cli.schema.choices import StdEstimator

__all__ = [
    "AdvantageStats",
    "best_and_worst",
    "combine_rewards",
    "group_advantages",
    "group_moments",
]

_MAX_LISTED = 10  # how many offending indices an error message names


@dataclass(frozen=True)
class AdvantageStats:
    """Batch-level statistics of one advantage computation (for logging).

    Attributes:
        num_groups: Number of distinct groups (prompts) in the batch.
        mean_group_size: Samples per group, averaged over groups (N / num_groups).
        zero_std_ratio: Fraction of groups whose rewards all are equal (zero variance, no learning
            signal); singleton groups count as zero-variance.
        reward_mean: Mean of the rewards over all N samples.
        reward_std: Population standard deviation of the rewards over all N samples.
    """

    num_groups: int
    mean_group_size: float
    zero_std_ratio: float
    reward_mean: float
    reward_std: float


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def _check_inputs(rewards: Tensor, group_ids: Tensor) -> None:
    """Raise ``ValueError`` unless ``rewards`` (N,) float and ``group_ids`` (N,) int are usable."""
    if rewards.ndim != 1 or group_ids.ndim != 1:
        raise ValueError(
            f"rewards and group_ids must be 1-D (N,), got shapes {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}; flatten the batch before computing advantages."
        )
    if rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards has {rewards.numel()} entries but group_ids has {group_ids.numel()}; "
            "pass one group id (the prompt's dataset index) per reward."
        )
    if rewards.numel() == 0:
        raise ValueError("rewards is empty; advantages need at least one sample.")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got {rewards.dtype}; cast with .float().")
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"group_ids must be an integer tensor (e.g. int64 dataset indices), got {group_ids.dtype}."
        )
    if rewards.device != group_ids.device:
        raise ValueError(
            f"rewards are on {rewards.device} but group_ids on {group_ids.device}; move them to one device."
        )
    _check_finite(rewards)


def _check_finite(rewards: Tensor) -> None:
    """Raise ``ValueError`` naming how many rewards are NaN / infinite and where."""
    bad = ~torch.isfinite(rewards)  # (N,)
    if not bool(bad.any()):
        return
    idx = bad.nonzero().flatten().tolist()
    num_nan = int(torch.isnan(rewards).sum())
    shown = ", ".join(str(i) for i in idx[:_MAX_LISTED]) + (", ..." if len(idx) > _MAX_LISTED else "")
    raise ValueError(
        f"{num_nan} NaN and {len(idx) - num_nan} infinite reward(s) out of {rewards.numel()} at index "
        f"[{shown}]; rlgen never scores a failed sample silently: drop those samples or replace the NaN "
        "explicitly upstream (reward config) before computing advantages."
    )


# --------------------------------------------------------------------------------------------------
# group statistics
# --------------------------------------------------------------------------------------------------


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary (non-contiguous, unsorted) ids to dense group indices 0..G-1.

    Returns:
        ``(inverse, num_groups)`` with ``inverse`` (N,) int64 and ``num_groups`` G.
    """
    uniq, inverse = torch.unique(group_ids, return_inverse=True)  # (G,), (N,)
    return inverse, int(uniq.numel())


def _scatter_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Sum ``values`` (N,) per group -> (G,)."""
    return values.new_zeros(num_groups).index_add_(0, inverse, values)


def group_moments(
    values: Tensor, group_ids: Tensor, *, std_estimator: str = "population"
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, std and group size (vectorised, no loop over groups).

    Statistics are accumulated in float64 (two-pass variance) and returned in ``values.dtype``. A group
    whose values are all exactly equal gets exactly that value as its mean and exactly 0 as its std, so
    ``std == 0`` reliably marks zero-variance groups (singletons included).

    This is the single seam for distributed training: a version that all-reduces the group sums over a
    policy group of ranks can replace it without touching the callers.

    Args:
        values: (N,) float values (e.g. rewards).
        group_ids: (N,) integer group ids; need not be contiguous or sorted.
        std_estimator: ``population`` (sum of squares / n) or ``unbiased`` (/ (n − 1)); a group of one
            has std 0 either way.

    Returns:
        ``(mean, std, size)``, each (N,): the statistics of the group each sample belongs to; ``size``
        is int64.
    """
    _check_inputs(values, group_ids)
    assert std_estimator in get_args(StdEstimator), std_estimator
    inverse, num_groups = _group_index(group_ids)  # (N,), G
    x = values.double()  # (N,)
    count = _scatter_sum(torch.ones_like(x), inverse, num_groups)  # (G,)
    mean_g = _scatter_sum(x, inverse, num_groups) / count  # (G,)
    dev = x - mean_g[inverse]  # (N,)
    dof = count - 1 if std_estimator == "unbiased" else count  # (G,)
    std_g = (_scatter_sum(dev * dev, inverse, num_groups) / dof.clamp(min=1)).sqrt()  # (G,)
    vmax = x.new_full((num_groups,), float("-inf")).scatter_reduce_(0, inverse, x, reduce="amax")
    vmin = x.new_full((num_groups,), float("inf")).scatter_reduce_(0, inverse, x, reduce="amin")
    constant = vmax == vmin  # (G,) exact zero-variance test, immune to rounding in the mean
    mean_g = torch.where(constant, vmin, mean_g)
    std_g = torch.where(constant, torch.zeros_like(std_g), std_g)
    return (
        mean_g[inverse].to(values.dtype),
        std_g[inverse].to(values.dtype),
        count[inverse].long(),
    )


def _advantage_stats(rewards: Tensor, group_ids: Tensor, zero_var: Tensor) -> AdvantageStats:
    """Summarise a batch: group count/size, zero-variance ratio, reward mean/std.

    Args:
        rewards: (N,) rewards the stats describe.
        group_ids: (N,) integer group ids.
        zero_var: (N,) bool, True for samples of a zero-variance group.
    """
    _, num_groups = _group_index(group_ids)
    num_zero = int(torch.unique(group_ids[zero_var]).numel())
    x = rewards.double()
    return AdvantageStats(
        num_groups=num_groups,
        mean_group_size=rewards.numel() / num_groups,
        zero_std_ratio=num_zero / num_groups,
        reward_mean=float(x.mean()),
        reward_std=float(x.std(unbiased=False)),
    )


# --------------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------------


def _clip(advantages: Tensor, clip_max: float | None) -> Tensor:
    """Clamp to ±clip_max; ``clip_max`` None or <= 0 disables clipping."""
    if clip_max is None or clip_max <= 0:
        return advantages
    return advantages.clamp(-clip_max, clip_max)


def _batch_std(rewards: Tensor, std_estimator: str) -> Tensor:
    """Std of all N rewards (0 for a single reward, whose advantage is 0 anyway)."""
    if rewards.numel() < 2:
        return rewards.new_zeros(())
    return rewards.double().std(unbiased=std_estimator == "unbiased").to(rewards.dtype)


def _normalize(
    rewards: Tensor, group_ids: Tensor, *, global_std: bool, eps: float, scale: str, std_estimator: str
) -> tuple[Tensor, Tensor]:
    """Unclipped group advantages and the per-sample zero-variance mask, both (N,)."""
    mean, std, _ = group_moments(rewards, group_ids, std_estimator=std_estimator)  # (N,) each
    zero_var = std == 0  # (N,) singletons and constant groups
    centered = rewards - mean  # (N,)
    assert scale in ("std", "none") and eps >= 0 and not (global_std and scale == "none"), (scale, eps)
    if scale == "std":
        denom = _batch_std(rewards, std_estimator) if global_std else std
        centered = centered / (denom + eps)
    # Exactly 0 for zero-variance groups, whatever the rounding in the mean or the size of eps.
    return torch.where(zero_var, torch.zeros_like(centered), centered), zero_var


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    clip_max: float | None = 5.0,
    scale: str = "std",
    std_estimator: str = "population",
) -> tuple[Tensor, AdvantageStats]:
    """GRPO / Flow-GRPO group-relative advantages.

    ``A = (r - mean_group) / (std + eps)``, clamped to ±``clip_max``. ``std`` is the std of the sample's
    group or, with ``global_std``, of all N rewards (Flow-GRPO's SD3/FLUX default), computed with
    ``std_estimator``. ``scale="none"`` skips the division (R3: ``A = r - mean_group``). Samples of a
    zero-variance group (all rewards equal, or a group of one) get exactly 0 (upstream divides their
    rounding residue by eps instead, which with eps 1e-8 can reach the clip bound).

    Args:
        rewards: (N,) float rewards; NaN/inf raise (handle failed scores upstream, explicitly).
        group_ids: (N,) integer group ids (the prompt's dataset index); groups may differ in size and
            ids need not be contiguous or sorted.
        global_std: Divide by the std of the whole batch instead of the group's.
        eps: Added to the std before dividing (Flow-GRPO 1e-4, MixGRPO / DanceGRPO 1e-8).
        clip_max: Clamp bound; None or <= 0 disables clipping.
        scale: ``"std"`` (z-score) or ``"none"`` (mean-centering only).
        std_estimator: ``"population"`` (/ n) or ``"unbiased"`` (/ (n − 1)).

    Returns:
        ``(advantages, stats)``: advantages (N,) in ``rewards.dtype`` on ``rewards.device``, and
        :class:`AdvantageStats` of the rewards.

    Raises:
        ValueError: On bad shapes/dtypes or non-finite rewards.
    """
    adv, zero_var = _normalize(
        rewards, group_ids, global_std=global_std, eps=eps, scale=scale, std_estimator=std_estimator
    )
    return _clip(adv, clip_max), _advantage_stats(rewards, group_ids, zero_var)


def _check_keys(components: Mapping[str, Tensor], weights: Mapping[str, float]) -> None:
    """Raise ``ValueError`` unless ``components`` and ``weights`` have the same, non-empty key set."""
    if not components:
        raise ValueError("components is empty; pass at least one reward component {name: (N,) tensor}.")
    missing = sorted(set(components) - set(weights))
    extra = sorted(set(weights) - set(components))
    if missing or extra:
        raise ValueError(
            f"reward components and weights disagree: no weight for {missing}, weight without a "
            f"component for {extra}; give exactly one weight per component "
            f"(components: {sorted(components)})."
        )


def _check_components(components: Mapping[str, Tensor], group_ids: Tensor) -> None:
    """Validate every component like a reward vector, naming the offending component."""
    for name, values in components.items():
        try:
            _check_inputs(values, group_ids)
        except ValueError as err:
            raise ValueError(f"reward component {name!r}: {err}") from None


def combine_rewards(
    components: Mapping[str, Tensor],
    weights: Mapping[str, float],
    group_ids: Tensor,
    *,
    mode: str = "sum_then_normalize",
    **adv_kwargs: Any,
) -> tuple[Tensor, AdvantageStats]:
    """Advantages of a weighted multi-reward mix.

    * ``sum_then_normalize`` (Flow-GRPO): ``r = Σ_k w_k·r_k``, then :func:`group_advantages`.
    * ``normalize_then_sum`` (MixGRPO ``advantage_aggr``): ``A = Σ_k w_k·A_k`` with ``A_k`` the
      unclipped group advantages of component k; the clip is applied once, after the sum.
    * ``gdpo`` (GDPO): the ``normalize_then_sum`` sum, then ``(A − mean(A)) / (std(A) + eps)`` over the
      whole batch (``std_estimator``, ``eps``), then the clip. Each reward then moves the policy by its
      rank within the group, not by its scale, and the sum keeps a batch-wide scale however many rewards
      it adds.

    Stats describe the weighted-sum reward ``Σ_k w_k·r_k`` in every mode; in ``normalize_then_sum`` and
    ``gdpo`` a group counts as zero-variance only when every component is constant within it (no signal
    at all), and its advantages stay exactly 0 (the batch mean removed by ``gdpo`` is 0 but for rounding).

    Args:
        components: ``{name: (N,) float rewards}``.
        weights: ``{name: weight}``, exactly the keys of ``components``.
        group_ids: (N,) integer group ids.
        mode: ``"sum_then_normalize"``, ``"normalize_then_sum"`` or ``"gdpo"``.
        **adv_kwargs: ``global_std``, ``eps``, ``clip_max``, ``scale``, ``std_estimator`` of
            :func:`group_advantages`.

    Returns:
        ``(advantages, stats)``, advantages (N,).

    Raises:
        ValueError: On a key mismatch, or anything :func:`group_advantages` rejects.
    """
    _check_keys(components, weights)
    _check_components(components, group_ids)
    names = sorted(components)
    start = torch.zeros_like(components[names[0]])  # a Tensor start (not int 0): the same sum, typed Tensor
    total = sum((float(weights[k]) * components[k] for k in names), start)  # (N,)
    if mode == "sum_then_normalize":
        return group_advantages(total, group_ids, **adv_kwargs)
    assert mode in ("normalize_then_sum", "gdpo"), mode
    clip_max = adv_kwargs.pop("clip_max", 5.0)
    opts = {"global_std": False, "eps": 1e-4, "scale": "std", "std_estimator": "population", **adv_kwargs}
    adv = torch.zeros_like(total)  # (N,)
    zero_var = torch.ones_like(total, dtype=torch.bool)  # (N,)
    for k in names:
        adv_k, zero_k = _normalize(components[k], group_ids, **opts)
        adv = adv + float(weights[k]) * adv_k
        zero_var = zero_var & zero_k
    if mode == "gdpo":
        adv = _batch_normalize(adv, zero_var, eps=opts["eps"], std_estimator=opts["std_estimator"])
    return _clip(adv, clip_max), _advantage_stats(total, group_ids, zero_var)


def _batch_normalize(advantages: Tensor, zero_var: Tensor, *, eps: float, std_estimator: str) -> Tensor:
    """GDPO's last step: ``(A − mean(A)) / (std(A) + eps)`` over all N samples, in float64.

    ``advantages`` and ``zero_var`` are (N,); samples of a group with no signal stay exactly 0, so the
    zero-advantage filter still finds them.
    """
    x = advantages.double()  # (N,)
    scaled = (x - x.mean()) / (_batch_std(x, std_estimator) + eps)
    return torch.where(zero_var, torch.zeros_like(scaled), scaled).to(advantages.dtype)


def best_and_worst(rewards: Tensor, group_ids: Tensor, k: int) -> Tensor:
    """Positions of the k best and k worst samples of each group (DanceGRPO's best-of-N); k=0 = all."""
    if k == 0:
        return torch.arange(len(rewards))
    keep = []
    for group in torch.unique(group_ids):
        members = (group_ids == group).nonzero().squeeze(1)
        order = members[torch.argsort(rewards[members], descending=True)]
        keep.append(torch.cat([order[:k], order[-k:]]))
    return torch.sort(torch.cat(keep)).values
