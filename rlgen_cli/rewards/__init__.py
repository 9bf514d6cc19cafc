"""Rewards: the :class:`Reward` protocol, the registry, weighted mixes and local rewards.

Importing this package registers the built-in local rewards (``jpeg_compressibility``,
``jpeg_incompressibility``). It never imports :mod:`rlgen_cli.models`.
"""

from rlgen_cli.rewards import jpeg as _jpeg  # noqa: F401  (registers the JPEG rewards)
from rlgen_cli.rewards.base import Reward, RewardBatch, RewardResult
from rlgen_cli.rewards.mix import WeightedMix, build_mix
from rlgen_cli.rewards.registry import available, build_reward, register

__all__ = [
    "Reward",
    "RewardBatch",
    "RewardResult",
    "WeightedMix",
    "available",
    "build_mix",
    "build_reward",
    "register",
]
