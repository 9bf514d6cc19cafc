"""Schema sections of the multimodal-LLM side (Qwen2-VL / Qwen2.5-VL): ``model.vlm`` and ``algo.token``.

They sit inside the shared ``ModelConfig`` / ``AlgoConfig`` so one ``rlgen train`` composes flow and
VLM runs alike (``model=tiny_qwen2_vl algo=step_grpo``); flow recipes ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlgen_cli.schema.errors import UserError

TOKEN_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence")
REWARD_SCALINGS = ("group", "batch", "none")


@dataclass
class VLMOptions:
    min_pixels: int = 3136
    """Processor lower bound on image pixels (Qwen2-VL: 4·28·28)."""
    max_pixels: int = 400000
    """Processor upper bound on image pixels (R1-VL: 400000)."""
    max_context: int = 4096
    """Prompt + image tokens + completion must fit; longer prompts fail early (never truncated)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise UserError(f"model.vlm.min_pixels ({self.min_pixels}) must be in (0, max_pixels ({self.max_pixels})]")


@dataclass
class TokenGRPOOptions:
    loss_type: str = "grpo"
    """Loss aggregation: grpo (per-sequence token mean) | bnpo | dr_grpo | dapo."""
    importance_level: str = "token"
    """Importance ratio per token or per sequence (GSPO-style)."""
    epsilon_high: float | None = None
    """Upper clip ε (DAPO's clip-higher); null = clip_range."""
    scale_rewards: str = "group"
    """Advantage std: per group, over the batch, or none."""
    temperature: float = 1.2
    """Rollout sampling temperature (log-probs are always taken at temperature 1)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k filtering (generate's default of 50 is overridden explicitly)."""
    max_completion_tokens: int = 1024
    num_iterations: int = 1
    """Updates per rollout batch (μ in GRPO)."""

    def __post_init__(self) -> None:
        for value, valid, key in (
            (self.loss_type, TOKEN_LOSSES, "algo.token.loss_type"),
            (self.importance_level, IMPORTANCE_LEVELS, "algo.token.importance_level"),
            (self.scale_rewards, REWARD_SCALINGS, "algo.token.scale_rewards"),
        ):
            if value not in valid:
                raise UserError(f"{key}={value!r} is not valid; choose one of {', '.join(valid)}")
