"""What scores R3's images: ``reward_fn`` and the server keys of upstream R3, resolved to a reward mix.

* ``geneval`` — GenEval on a reward server (rlgen's ``remote`` client, reward ``geneval``);
* ``geneval_plus`` / ``tiif`` — an OpenAI-compatible VLM judge with the GenEval++ / TIIF prompts;
* ``mix`` — the ``reward`` section exactly as composed (``reward=NAME`` picks any local reward or mix);
* any other name — that local reward of the registry (``jpeg_compressibility``, ``shapes_geneval``, …).

Served rewards reach every ``reward_server_urls`` × ``reward_server_port`` endpoint (empty lists keep
the client's defaults); their other options come from ``reward.kwargs.<component>``, which may not name
another server reward or other endpoints (:func:`~rlgen_cli.schema.r3.require_served_reward_keys`). With an offline
stand-in (``r3.offline``, see ``schema/r3.py``) its local reward replaces all of this. A failed score
is an error, never a silent 0.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.errors import UserError
from rlgen_cli.r3.data import R3Sample
from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.schema.r3 import (
    SERVED_COMPONENTS,
    SERVED_GENEVAL,
    SERVED_REWARDS,
    R3Config,
    require_served_reward_keys,
)
from rlgen_cli.schema.run import RewardConfig
from rlgen_cli.training.checkpoints.checkpoint import NonFiniteRewards

log = logging.getLogger(__name__)

__all__ = ["R3Scorer", "reward_spec"]

COMPONENTS = SERVED_COMPONENTS
"""The reward component that scores each served ``reward_fn``."""


def _served(r3: R3Config, reward: RewardConfig) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The served reward's client: its ``reward.kwargs`` with the ``r3`` endpoints (conflicts refused)."""
    require_served_reward_keys(r3, reward)
    component = COMPONENTS[r3.reward_fn]
    kwargs = dict(reward.kwargs.get(component, {}))
    if component == "remote":
        kwargs["reward"] = SERVED_GENEVAL
    if r3.reward_server_urls:
        kwargs["hosts"] = list(r3.reward_server_urls)
    if r3.reward_server_port:
        kwargs["ports"] = list(r3.reward_server_port)
    return {component: 1.0}, {component: kwargs}


def reward_spec(r3: R3Config, reward: RewardConfig) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """``({name: weight}, {name: kwargs})`` of the reward that scores R3 images (see the module docstring)."""
    if r3.offline.enabled:
        name = r3.offline.reward
        return {name: 1.0}, {name: dict(reward.kwargs.get(name, {}))}
    if r3.reward_fn in SERVED_REWARDS:
        return _served(r3, reward)
    if r3.reward_fn == "mix":
        return dict(reward.weights), {k: dict(v) for k, v in reward.kwargs.items()}
    return {r3.reward_fn: 1.0}, {r3.reward_fn: dict(reward.kwargs.get(r3.reward_fn, {}))}


class R3Scorer:
    """Scores images against their samples' prompts and metadata: (N,) weighted rewards."""

    def __init__(self, r3: R3Config, reward: RewardConfig) -> None:
        weights, kwargs = reward_spec(r3, reward)
        if r3.offline.enabled:
            log.warning(
                "offline stand-in of this model: scoring with %s instead of reward_fn=%s "
                "(r3.offline.enabled=false to use reward_fn)",
                r3.offline.reward,
                r3.reward_fn,
            )
        try:
            self.mix = build_mix(weights, **kwargs)
        except ValueError as err:
            raise UserError(f"r3.reward_fn={r3.reward_fn!r}: {err}") from err
        self.weights = weights

    @torch.no_grad()
    def score(self, images: Tensor, samples: Sequence[R3Sample]) -> Tensor:
        """(N,) rewards of (N, 3, H, W) images in [0, 1].

        Raises:
            NonFiniteRewards: When a reward returns NaN for some sample (the run stops: exit code 2).
        """
        if not len(samples):
            return torch.zeros(0)
        batch = RewardBatch(
            prompts=[s.prompt for s in samples],
            images=images.cpu(),
            metadata=[dict(s.metadata) for s in samples],
        )
        scores = torch.as_tensor(self.mix.score(batch).scores, dtype=torch.float32).cpu()
        if not torch.isfinite(scores).all():
            raise NonFiniteRewards(
                f"the reward failed for {int((~torch.isfinite(scores)).sum())} of {len(samples)} samples; a failed "
                "score is never replaced by 0 (check the reward server or judge)"
            )
        return scores
