"""GARDO's three pieces (He et al., 2025, "GARDO: Reinforcing Diffusion Models without Reward Hacking").

Each piece is a switch of its own under ``algo.gardo`` (docs/algorithms.md, GARDO):

* **uncertainty-gated KL** — the KL to the reference applies only to the samples whose reward is
  uncertain. Uncertainty is the disagreement between the trained (proxy) reward and auxiliary reward
  models, measured on ranks over the whole batch: ``u = rank_proxy − mean(rank_aux)`` with rank 1 the
  highest score (:func:`rank_disagreement`). The samples whose ``u`` lies above the ``1 − f`` percentile of
  the non-negative ``u`` are gated (:func:`uncertainty_gate`); ``f`` adapts from batch to batch
  (:class:`GateFraction`). The KL term is then the mean over the gated samples (:func:`gated_mean`);
* **periodic reference refresh** — the reference becomes the online policy every K epochs
  (:func:`refresh_due`; the policy's ``trainable.refresh_reference``);
* **diversity-aware advantage shaping** — each sample's distance to its nearest neighbour in its group,
  in an image encoder's feature space (cosine, :func:`nearest_neighbour_distance`), divided by the group's
  mean of those distances, multiplies the advantages of the samples at or above their group's mean
  reward; the others keep theirs (:func:`diversity_scale`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


def descending_ranks(values: Tensor) -> Tensor:
    """(N,) float ranks of ``values`` (N,): 1 for the largest, N for the smallest; ties keep their order."""
    order = torch.sort(values, descending=True, stable=True).indices
    ranks = torch.empty(len(values), dtype=torch.float64)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    return ranks


def rank_disagreement(proxy: Tensor, auxiliary: Sequence[Tensor]) -> Tensor:
    """(N,) uncertainty: the proxy reward's rank minus the mean of the auxiliary rewards' ranks."""
    if not auxiliary:
        raise ValueError("rank_disagreement needs at least one auxiliary reward")
    aux = torch.stack([descending_ranks(a) for a in auxiliary]).mean(0)
    return descending_ranks(proxy) - aux


@dataclass
class GateFraction:
    """The fraction of samples the KL gate may pass, adapted from batch to batch: starts at ``base``; a
    batch whose mean non-negative uncertainty exceeds every one of the last ``window`` batches' raises it
    by ``rate`` (×(1 + rate)), one below all of them lowers it (×(1 − rate)); clamped to [low, high]."""

    base: float = 0.1
    low: float = 0.02
    high: float = 0.2
    rate: float = 0.1
    window: int = 20
    fraction: float = 0.1
    history: list[float] = field(default_factory=list)

    def update(self, uncertainty: Tensor) -> float:
        """Fold in this batch's non-negative uncertainties; returns the fraction to gate with."""
        level = uncertainty[uncertainty >= 0].double().mean().item()
        if not self.history:
            self.fraction = self.base
        elif level > max(self.history):
            self.fraction *= 1 + self.rate
        elif level < min(self.history):
            self.fraction *= 1 - self.rate
        self.fraction = min(max(self.fraction, self.low), self.high)
        self.history = [*self.history, level][-self.window :]
        return self.fraction

    def state_dict(self) -> dict[str, object]:
        return {"fraction": self.fraction, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.fraction = float(state["fraction"])  # type: ignore[arg-type]
        self.history = [float(v) for v in state["history"]]  # type: ignore[union-attr]


def uncertainty_gate(uncertainty: Tensor, fraction: float) -> Tensor:
    """(N,) bool: the samples whose uncertainty lies above the ``100·(1 − fraction)`` percentile (linear
    interpolation) of the batch's non-negative uncertainties."""
    nonneg = uncertainty[uncertainty >= 0].double()
    threshold = torch.quantile(nonneg, 1.0 - fraction)
    return uncertainty.double() > threshold


def gated_mean(per_sample: Tensor, gate: Tensor, when_none: str = "zero") -> Tensor:
    """The mean of ``per_sample`` (B,) over the gated samples; with none gated, 0 (``when_none="zero"``,
    Flow-GRPO's code) or the mean over all (``"all"``, DiffusionNFT's code)."""
    if gate.any():
        return per_sample[gate].mean()
    if when_none == "all":
        return per_sample.mean()
    return per_sample.sum() * 0.0  # keeps the graph and dtype


def nearest_neighbour_distance(features: Tensor, group_ids: Tensor) -> Tensor:
    """(N,) each sample's cosine distance ``1 − cos`` (cosine clipped to [−1, 1]) to the nearest other
    member of its group; features (N, D), group_ids (N,). Every group needs two members or more."""
    unit = torch.nn.functional.normalize(features.double(), dim=-1)
    distances = torch.empty(len(features), dtype=torch.float64)
    for group in torch.unique(group_ids):
        members = (group_ids == group).nonzero().squeeze(1)
        if len(members) < 2:
            raise ValueError(f"group {int(group)} has one member; diversity needs two per group")
        d = 1.0 - (unit[members] @ unit[members].T).clamp(-1.0, 1.0)
        d.fill_diagonal_(float("inf"))
        distances[members] = d.min(dim=1).values
    return distances


def diversity_scale(rewards: Tensor, distances: Tensor, group_ids: Tensor) -> Tensor:
    """(N,) advantage multipliers: ``d_i / mean_group(d)`` for a sample whose reward is not below its
    group's mean, 1 for one below it. A group whose members all coincide (mean distance 0) has no
    diversity to reward: its multipliers are 1."""
    scale = torch.ones(len(rewards), dtype=torch.float64)
    rewards = rewards.double()
    for group in torch.unique(group_ids):
        members = (group_ids == group).nonzero().squeeze(1)
        mean_distance = distances[members].mean()
        if mean_distance <= 0:
            continue
        above = rewards[members] >= rewards[members].mean()
        scale[members[above]] = distances[members[above]] / mean_distance
    return scale


def refresh_due(epoch: int, every: int) -> bool:
    """Whether the reference becomes the online policy before ``epoch``'s update: every ``every`` epochs
    after the first (``every`` 0: never)."""
    return every > 0 and epoch > 0 and epoch % every == 0


def gated_kl_weights(gate: Tensor, when_none: str = "zero") -> Tensor:
    """(B,) float64 weights ``w`` with ``mean(w·kl) == gated_mean(kl, gate, when_none)``: a loss that averages
    a per-sample KL over its batch then averages it over the gated samples only."""
    gated = int(gate.sum())
    if gated == 0:
        return torch.full((len(gate),), 1.0 if when_none == "all" else 0.0, dtype=torch.float64)
    return gate.double() * (len(gate) / gated)


def gated_velocity_kl(v: Tensor, v_ref: Tensor, gate: Tensor) -> Tensor:
    """DiffusionNFT's gated KL: per sample ``mean((v − v_ref)²)`` over its dims, averaged over the gated
    samples — over all of them when none is gated, as upstream's NFT code does. v, v_ref (B, ...)."""
    per_sample = (v - v_ref.detach()).pow(2).flatten(1).mean(1)
    return gated_mean(per_sample, gate.to(per_sample.device), when_none="all")
