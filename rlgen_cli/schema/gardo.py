"""``algo.gardo``: GARDO's three switches on Flow-GRPO and DiffusionNFT (``algos/gardo.py``,
docs/algorithms.md). All off by default; each works alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from rlgen_cli.errors import UserError
from rlgen_cli.schema.ranges import COUNT, FRACTION, NON_NEGATIVE


@dataclass
class GardoConfig:
    kl_gate: bool = False
    """Apply the KL to the reference only to the samples whose reward is uncertain: the proxy reward's
    rank minus the mean rank of the auxiliary rewards, over the whole batch, above its adaptive percentile
    (needs ``algo.kl_weight`` > 0, ``proxy_reward`` and ``auxiliary_rewards``)."""
    proxy_reward: str | None = None
    """The reward of ``reward.weights`` whose uncertainty gates the KL (upstream: the trained reward)."""
    auxiliary_rewards: list[str] = field(default_factory=list)
    """Rewards of ``reward.weights`` the proxy's ranks are compared with (upstream: aesthetic and
    imagereward); a weight of 0 scores them without training on them."""
    gate_fraction: Annotated[float, FRACTION] = 0.1
    """Starting share of samples the gate passes (the top of the non-negative uncertainties)."""
    gate_fraction_min: Annotated[float, FRACTION] = 0.02
    """Lowest share the adaptive fraction may reach."""
    gate_fraction_max: Annotated[float, FRACTION] = 0.2
    """Highest share the adaptive fraction may reach."""
    gate_fraction_rate: Annotated[float, NON_NEGATIVE] = 0.1
    """Relative change of the fraction when a batch's mean uncertainty leaves the window's range."""
    gate_window: Annotated[int, COUNT] = 20
    """Epochs of mean uncertainty the fraction is compared with."""
    refresh_every: Annotated[int, NON_NEGATIVE] = 0
    """Make the reference the online policy before every K-th epoch (LoRA: a frozen copy of the adapter;
    full FT: the frozen copy); 0 = never (needs ``algo.kl_weight`` > 0)."""
    diversity: bool = False
    """Multiply the advantages of samples at or above their group's mean reward by their nearest-neighbour
    feature distance within the group over the group's mean distance (``feature_model``)."""
    feature_model: str = "openai/clip-vit-large-patch14"
    """CLIP model (hub id or directory) whose image embeddings measure diversity (upstream: DINOv3
    ViT-L/16, ``timm/vit_large_patch16_dinov3.lvd1689m``)."""

    def __post_init__(self) -> None:
        if not 0 < self.gate_fraction_min <= self.gate_fraction <= self.gate_fraction_max < 1:
            raise UserError(
                "algo.gardo needs 0 < gate_fraction_min ≤ gate_fraction ≤ gate_fraction_max < 1; got "
                f"{self.gate_fraction_min}, {self.gate_fraction}, {self.gate_fraction_max}"
            )
        if self.gate_fraction_rate < 0 or self.gate_window < 1 or self.refresh_every < 0:
            raise UserError(
                "algo.gardo.gate_fraction_rate must be ≥ 0, gate_window ≥ 1 and refresh_every ≥ 0; got "
                f"{self.gate_fraction_rate}, {self.gate_window}, {self.refresh_every}"
            )

    def require_valid(self, kl_weight: float, rewards: list[str], forward_loss: str | None = None) -> None:
        """What the switches need of the rest of the run's config, checked before any model loads (exit 2
        through the CLI); ``forward_loss`` is ``algo.forward.loss`` on the forward-process recipe."""
        if (self.kl_gate or self.refresh_every) and kl_weight <= 0:
            raise UserError(
                "algo.gardo.kl_gate and algo.gardo.refresh_every shape the KL to the reference, which "
                "algo.kl_weight=0 turns off; set algo.kl_weight > 0 or turn them off"
            )
        if self.kl_gate and forward_loss == "dgpo":
            raise UserError(
                "algo.gardo.kl_gate is not wired into DGPO's group loss; use algo=nft or algo=awm, or turn "
                "algo.gardo.kl_gate off"
            )
        if not self.kl_gate:
            return
        named = [self.proxy_reward, *self.auxiliary_rewards]
        if self.proxy_reward is None or not self.auxiliary_rewards:
            raise UserError(
                "algo.gardo.kl_gate needs algo.gardo.proxy_reward=NAME and algo.gardo.auxiliary_rewards=[...] "
                "(rewards of reward.weights; upstream compares the trained reward with aesthetic and imagereward)"
            )
        missing = [name for name in named if name not in rewards]
        if missing:
            raise UserError(
                f"algo.gardo names rewards not in reward.weights: {missing}; reward.weights has {rewards}. "
                "Add them (+reward.weights.NAME=0 scores a reward without training on it)"
            )
