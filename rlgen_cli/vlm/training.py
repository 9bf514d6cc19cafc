"""Small pieces shared by the VLM recipes: micro-batch slices, the learning-rate schedule, the
completion budget, statistic summaries and what runs over several processes."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from rlgen_cli.errors import UserError
from rlgen_cli.training.control.schedule import decay_factor

log = logging.getLogger(__name__)
SCHEDULER_KEY = "scheduler"  # trainer-state key of the learning-rate scheduler in checkpoints

__all__ = [
    "SCHEDULER_KEY",
    "batches",
    "completion_budget",
    "make_scheduler",
    "require_whole_weights",
]


def batches(n: int, size: int) -> list[slice]:
    """Consecutive slices of ``size`` covering ``range(n)`` (the last may be shorter)."""
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def lr_lambda(step: int, total: int, warmup: int, schedule: str) -> float:
    """Linear warm-up over ``warmup`` steps, then constant / cosine / linear decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    return decay_factor(min(1.0, (step - warmup) / max(1, total - warmup)), schedule)


def make_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, schedule: str
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up over ``ceil(warmup_ratio · total_steps)`` optimizer steps, then ``schedule``."""
    warmup = math.ceil(warmup_ratio * total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, total_steps, warmup, schedule))


def completion_budget(requested: int, cap: int | None) -> int:
    """``algo.token.max_completion_tokens`` capped by ``model.vlm.completion_cap`` (the cap is logged)."""
    if cap is not None and cap < requested:
        log.info("completion budget %d capped at %d by model.vlm.completion_cap", requested, cap)
        return cap
    return requested


def require_whole_weights(dist: Any, engine: str = "hf") -> None:
    """The VLM recipes run on DDP (``launcher=accelerate``) and DeepSpeed ZeRO-2, where every rank holds the
    whole model and ``generate`` runs on it alone.

    Args:
        dist: The run's ``training.dist.Dist``.
        engine: ``algo.token.engine`` (the SFT recipe has none: ``hf``).

    Raises:
        UserError: Under ZeRO-3 / FSDP (sharded weights: every rank would have to join every decoding step
            of every other rank's ``generate``), or for the vLLM engine over several processes.
    """
    if dist.sharded:
        raise UserError(
            "the VLM recipes need whole weights on every rank (each rank samples with HF generate on its own "
            "prompts); ZeRO-3 / FSDP shard them: use launcher=accelerate or launcher=deepspeed_zero2"
        )
    if engine == "vllm" and dist.world_size > 1:
        raise UserError(
            "algo.token.engine=vllm runs in one process for now; over several processes use "
            "algo.token.engine=hf, or run vLLM with launcher=local"
        )
