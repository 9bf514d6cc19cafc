"""GARDO on the flow recipes (``algo.gardo``; the maths in ``algos/gardo.py``, docs/algorithms.md).

:class:`GardoHooks` holds what lasts between epochs (the adaptive gate fraction, the feature encoder) and
gives Flow-GRPO and DiffusionNFT their three switches: :meth:`~GardoHooks.refresh_if_due` before an
epoch's update, :meth:`~GardoHooks.kl_gate` and :meth:`~GardoHooks.shape` on the gathered batch (global
order, so every process count computes the same gate and the same advantages). Features are computed
rollout batch by rollout batch: those batches are the same on any process count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.algos import gardo
from rlgen_cli.errors import UserError
from rlgen_cli.schema.gardo import GardoConfig


class GardoHooks:
    """GARDO's state for one run; build it with :meth:`for_run` (None when every switch is off)."""

    def __init__(self, cfg: GardoConfig, device: Any) -> None:
        self.cfg = cfg
        self.device = device
        self.fraction = gardo.GateFraction(
            base=cfg.gate_fraction,
            low=cfg.gate_fraction_min,
            high=cfg.gate_fraction_max,
            rate=cfg.gate_fraction_rate,
            window=cfg.gate_window,
            fraction=cfg.gate_fraction,
        )
        self._encoder: Any = None

    @classmethod
    def for_run(cls, run: Any) -> GardoHooks | None:
        """The hooks of ``run.cfg.algo.gardo``, checked against what the run loaded (exit 2); the config's
        own cross-section checks ran before (``GardoConfig.require_valid``)."""
        cfg, algo = run.cfg, run.cfg.algo
        switches = algo.gardo
        if not (switches.kl_gate or switches.refresh_every or switches.diversity):
            return None
        if (switches.kl_gate or switches.refresh_every) and run.start_epoch > 0:
            raise UserError(
                "algo.gardo.kl_gate / refresh_every keep state a checkpoint does not carry (the gate "
                "fraction, the refreshed reference); start the run afresh or turn them off to resume"
            )
        if switches.refresh_every and run.dist.sharded:  # also a user's accelerate config with ZeRO-3
            raise UserError(
                "algo.gardo.refresh_every copies whole weights into the reference, which a sharded launcher "
                "(fsdp, deepspeed_zero3) splits over processes; use launcher=accelerate or local"
            )
        if switches.refresh_every and not hasattr(run.policy.trainable, "refresh_reference"):
            raise UserError(
                f"algo.gardo.refresh_every: model.family={cfg.model.family} keeps its reference its own way "
                "and cannot refresh it; set algo.gardo.refresh_every=0"
            )
        return cls(switches, run.device)

    def refresh_if_due(self, run: Any, epoch: int) -> float:
        """Make the reference the online policy when ``epoch`` is due; 1.0 when it did, else 0.0."""
        if not gardo.refresh_due(epoch, self.cfg.refresh_every):
            return 0.0
        run.policy.trainable.refresh_reference()
        return 1.0

    def kl_gate(self, components: dict[str, Tensor]) -> tuple[Tensor | None, dict[str, float]]:
        """(N,) bool over the gathered batch: the samples whose KL counts (None with the gate off), and
        the gate's metrics."""
        if not self.cfg.kl_gate:
            return None, {}
        uncertainty = gardo.rank_disagreement(
            components[self.cfg.proxy_reward], [components[name] for name in self.cfg.auxiliary_rewards]
        )
        fraction = self.fraction.update(uncertainty)
        gate = gardo.uncertainty_gate(uncertainty, fraction)
        return gate, {"gardo/gate_fraction": fraction, "gardo/gated_share": gate.double().mean().item()}

    def features(self, images: Tensor, batch_size: int) -> Tensor | None:
        """(N, D) image embeddings of this process's rollouts, ``batch_size`` at a time (None with
        diversity off)."""
        if not self.cfg.diversity:
            return None
        if self._encoder is None:
            from rlgen_cli.rewards.clip import ClipReward

            self._encoder = ClipReward("clipscore", self.cfg.feature_model, device=str(self.device))
        with torch.no_grad():
            parts = [
                self._encoder.image_embeddings(images[i : i + batch_size])
                for i in range(0, len(images), batch_size)
            ]
        return torch.cat(parts).float()

    def shape(
        self, advantages: Tensor, rewards: Tensor, features: Tensor | None, group_ids: Tensor, clip_max: float
    ) -> tuple[Tensor, dict[str, float]]:
        """Advantages (N,) of the gathered batch times the diversity multipliers (then clipped to
        ±clip_max again, as upstream clamps after shaping); unchanged with diversity off."""
        if features is None:
            return advantages, {}
        distances = gardo.nearest_neighbour_distance(features, group_ids)
        scale = gardo.diversity_scale(rewards, distances, group_ids)
        shaped = (advantages.double() * scale).clamp(-clip_max, clip_max).to(advantages.dtype)
        return shaped, {"gardo/diversity_scale_max": scale.max().item()}

    def gathered_features(self, run: Any, rollouts: Any, order: Tensor) -> Tensor | None:
        """(N, D) features of the whole batch in global order (None with diversity off)."""
        features = self.features(rollouts.images, run.cfg.algo.sample_batch_size)
        if features is None:
            return None
        return run.dist.gather(features.to(run.device)).cpu()[order]

    def on_batch(
        self,
        run: Any,
        epoch: int,
        rollouts: Any,
        order: Tensor,
        mine: Tensor,
        advantages: Tensor,
        components: dict[str, Tensor],
        rewards: Tensor,
        group_ids: Tensor,
    ) -> tuple[Tensor, Tensor | None, dict[str, float]]:
        """Everything GARDO does between Flow-GRPO's advantages and its update of ``epoch``: the gathered
        ``advantages`` (N,) shaped by diversity, this process's KL gate (``mine``: its places in the
        global batch; None with the gate off), the reference refreshed when due; and the metrics.
        ``order`` puts gathered rows in global order; ``rewards`` (N,) is the weighted reward in it and
        ``group_ids`` (N,) the groups (``GroupSampler.group_keys``)."""
        features = self.gathered_features(run, rollouts, order)
        advantages, stats = self.shape(advantages, rewards, features, group_ids, run.cfg.algo.adv_clip_max)
        gate, gate_stats = self.kl_gate(components)
        stats = {**stats, **gate_stats, "gardo/refreshed": self.refresh_if_due(run, epoch)}
        return advantages, None if gate is None else gate[mine], stats

    def for_forward(
        self,
        run: Any,
        epoch: int,
        rollouts: Any,
        order: Tensor,
        components: dict[str, Tensor],
        group_ids: Tensor,
        rewards: Tensor,
    ) -> tuple[Callable[[Tensor], Tensor], Tensor | None, dict[str, float]]:
        """DiffusionNFT's side of :meth:`on_batch`: the shaping as a function of the gathered advantages
        (applied before they become loss weights; it fills the returned metrics), this process's KL gate
        (``rollouts.positions`` are its places in the global batch) and the refresh."""
        features = self.gathered_features(run, rollouts, order)
        stats: dict[str, float] = {}

        def shape(advantages: Tensor) -> Tensor:
            shaped, shape_stats = self.shape(
                advantages, rewards, features, group_ids, run.cfg.algo.adv_clip_max
            )
            stats.update(shape_stats)
            return shaped

        gate, gate_stats = self.kl_gate(components)
        stats.update({**gate_stats, "gardo/refreshed": self.refresh_if_due(run, epoch)})
        return shape, None if gate is None else gate[rollouts.positions], stats
