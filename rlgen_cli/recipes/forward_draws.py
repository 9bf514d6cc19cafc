"""What the forward-process recipes (DiffusionNFT, AWM, DGPO) share below their loops: which σ of the
rollout schedule a sample trains on, a velocity under other weights (old policy, reference), and the
per-σ loss statistics they log."""

from __future__ import annotations

from collections import defaultdict
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.algos.awm import stratified_timestep_indices
from rlgen_cli.algos.dgpo import truncated_timestep_indices
from rlgen_cli.algos.nft import subset_timestep_indices
from rlgen_cli.schema.forward import ForwardConfig


def trained_indices(forward: ForwardConfig, num_steps: int, generator: torch.Generator) -> Tensor:
    """(K,) positions in the rollout's σ schedule that one sample trains on this pass."""
    if forward.timestep_sampling == "subset":
        return subset_timestep_indices(num_steps, int(num_steps * forward.timestep_fraction), generator)
    if forward.timestep_sampling == "truncated":
        return truncated_timestep_indices(
            num_steps, forward.num_timesteps, forward.timestep_fraction, generator
        )
    return stratified_timestep_indices(num_steps, forward.num_timesteps, forward.timestep_fraction, generator)


def frozen_velocity(velocity: Any, x: Tensor, sigma: Tensor, weights: AbstractContextManager[Any]) -> Tensor:
    """The velocity under other weights (old policy, reference), without gradients."""
    with torch.no_grad(), weights:
        return velocity(x, sigma)


def record_loss(stats: defaultdict[str, list[float]], out: Any) -> None:
    """Append one σ's loss output (``stats``, ``policy_loss``, ``kl_loss``: NFT, AWM or DGPO) to ``stats``."""
    for key, value in {
        **out.stats,
        "policy_loss": out.policy_loss.item(),
        "kl_loss": out.kl_loss.item(),
    }.items():
        stats[key].append(value)
