"""Weighted sum of several rewards, as configured by ``{name: weight}``.

Follows Flow-GRPO's multi-reward setup: the total is ``Σ_k w_k · s_k`` on the raw component scores, with
no per-reward normalisation (group-wise ``normalize_then_sum`` as in MixGRPO belongs to the advantage
computation in ``algos/``, which reads the per-component scores from ``details``). Every component's
raw scores and details are returned so they can all be logged. A ``NaN`` in any component makes that
sample's total ``NaN``; it is never replaced by 0.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.rewards.base import Reward, RewardBatch, RewardResult, check_result
from rlgen_cli.rewards.registry import build_reward

logger = logging.getLogger(__name__)

__all__ = ["WeightedMix", "build_mix"]


def _validate_weights(names: set[str], weights: Mapping[str, float]) -> dict[str, float]:
    """Check that weights match the rewards one to one, are finite and not all zero.

    Args:
        names: Names of the component rewards.
        weights: Weight per component name.

    Returns:
        The weights as a plain ``dict`` of floats.

    Raises:
        ValueError: On missing/extra names, a non-finite weight, or all-zero weights.
    """
    if not names:
        raise ValueError("a reward mix needs at least one component; got an empty spec.")
    if set(weights) != names:
        raise ValueError(
            f"reward mix weights {sorted(weights)} do not match its rewards {sorted(names)}; "
            "give exactly one weight per reward."
        )
    out = {name: float(w) for name, w in weights.items()}
    bad = {name: w for name, w in out.items() if not math.isfinite(w)}
    if bad:
        raise ValueError(f"reward mix weights must be finite, got {bad}; fix them in the reward config.")
    if all(w == 0.0 for w in out.values()):
        raise ValueError(
            f"all reward mix weights are zero ({out}); give at least one reward a non-zero weight."
        )
    return out


class WeightedMix:
    """A reward whose score is the weighted sum of its components' scores.

    Attributes:
        name: Always ``"mix"``.
        rewards: Component rewards by name.
        weights: Weight per component name.
    """

    name: str = "mix"

    def __init__(self, rewards: Mapping[str, Reward], weights: Mapping[str, float]) -> None:
        """Create the mix.

        Args:
            rewards: Component rewards keyed by the name they are logged under.
            weights: One finite weight per component; not all zero.

        Raises:
            ValueError: If the weights are invalid (see :func:`_validate_weights`).
        """
        self.weights = _validate_weights(set(rewards), weights)
        self.rewards = dict(rewards)

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score ``batch`` with every component and sum the weighted scores.

        Args:
            batch: The samples to score.

        Returns:
            ``scores`` = ``Σ w·s`` as float32 on the CPU; ``details`` holds each component's raw scores
            under its name and each of its own details under ``"{name}/{key}"``.

        Raises:
            ValueError: If a component returns a number of scores different from ``len(batch)``.
        """
        total = torch.zeros(len(batch), dtype=torch.float32)
        details: dict[str, Any] = {}
        for name, reward in self.rewards.items():
            scores, component_details = self._score_component(name, reward, batch)
            total = total + self.weights[name] * scores  # NaN stays NaN, even with weight 0
            details[name] = scores
            details.update({f"{name}/{key}": value for key, value in component_details.items()})
        return RewardResult(scores=total, details=details)

    @staticmethod
    def _score_component(name: str, reward: Reward, batch: RewardBatch) -> tuple[Tensor, dict[str, Any]]:
        """Run one component, check its length, and return its scores and details.

        Args:
            name: Component name (for errors and logs).
            reward: The component reward.
            batch: The samples to score.

        Returns:
            ``(B,)`` float32 scores on the CPU, and the component's own details.

        Raises:
            ValueError: If the component returns the wrong number of scores.
        """
        result = reward.score(batch)
        check_result(result, len(batch), name)
        scores = result.scores.detach().to(device="cpu", dtype=torch.float32)
        n_nan = int(torch.isnan(scores).sum())
        if n_nan:
            logger.warning("reward %r returned NaN for %d of %d samples", name, n_nan, len(batch))
        return scores, result.details


def build_mix(spec: Mapping[str, float], **per_reward_kwargs: dict[str, Any]) -> WeightedMix:
    """Build a :class:`WeightedMix` from registered rewards.

    Args:
        spec: ``{reward_name: weight}``.
        **per_reward_kwargs: Optional constructor kwargs per reward name,
            e.g. ``jpeg_compressibility={"quality": 90}``.

    Returns:
        The mix, with components built by :func:`~rlgen_cli.rewards.registry.build_reward`.

    Raises:
        ValueError: If ``spec`` is empty, a name is unknown, kwargs name a reward not in ``spec``, or
            the weights are invalid.
    """
    if not spec:
        raise ValueError("reward mix spec is empty; give at least one {reward_name: weight} entry.")
    extra = sorted(set(per_reward_kwargs) - set(spec))
    if extra:
        raise ValueError(
            f"kwargs given for rewards {extra} that are not in the mix {sorted(spec)}; "
            "add them to the mix or remove their kwargs."
        )
    weights = _validate_weights(set(spec), spec)
    rewards = {name: build_reward(name, **per_reward_kwargs.get(name, {})) for name in spec}
    return WeightedMix(rewards, weights)
