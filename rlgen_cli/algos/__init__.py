"""Pure objectives (torch only): group advantages and the Flow-GRPO clipped loss."""

from rlgen_cli.algos.advantages import (
    COMBINE_MODES,
    SCALES,
    AdvantageStats,
    combine_rewards,
    group_advantages,
    group_moments,
)
from rlgen_cli.algos.grpo import GRPOLossOut, grpo_loss

__all__ = [
    "COMBINE_MODES",
    "SCALES",
    "AdvantageStats",
    "GRPOLossOut",
    "combine_rewards",
    "grpo_loss",
    "group_advantages",
    "group_moments",
]
