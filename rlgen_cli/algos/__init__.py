"""Pure objectives (torch only): group advantages, Flow-GRPO / GRPO-Guard losses, Flow-DPO and SFT."""

from rlgen_cli.algos.advantages import (
    AdvantageStats,
    best_and_worst,
    combine_rewards,
    group_advantages,
    group_moments,
)
from rlgen_cli.algos.dpo import (
    NUM_TRAIN_TIMESTEPS,
    DPOLossOut,
    PreferencePairs,
    dpo_loss,
    flow_matching_error,
    preference_pairs,
    sample_dpo_sigmas,
)
from rlgen_cli.algos.grpo import GRPOLossOut, grpo_loss, nonzero_advantage_rows
from rlgen_cli.algos.guard import guard_loss
from rlgen_cli.algos.sft import SFTLossOut, select_best, sft_loss

__all__ = [
    "AdvantageStats",
    "best_and_worst",
    "GRPOLossOut",
    "combine_rewards",
    "grpo_loss",
    "group_advantages",
    "group_moments",
    "guard_loss",
    "nonzero_advantage_rows",
    "NUM_TRAIN_TIMESTEPS",
    "DPOLossOut",
    "PreferencePairs",
    "dpo_loss",
    "flow_matching_error",
    "preference_pairs",
    "sample_dpo_sigmas",
    "SFTLossOut",
    "select_best",
    "sft_loss",
]
