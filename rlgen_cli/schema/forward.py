"""Schema section of the forward-process recipes (``recipe=flow_forward``): ``algo.forward``.

DiffusionNFT (Zheng et al. 2025) and Advantage Weighted Matching (Xue et al. 2025) train on clean rollout
samples noised forward, so they need no SDE log-probabilities: rollouts may use any solver. The section
sits inside ``AlgoConfig`` like ``algo.pref`` and ``algo.token``; other recipes ignore it. Defaults are
DiffusionNFT's; ``conf/algo/awm.yaml`` sets AWM's. Choices are ``Literal`` types read by the config pass
(``schema/choices.py``), numbers are checked by ``schema/ranges.py``, and :func:`check_forward_steps`
(run by the recipe) relates the σ draws to ``model.num_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from rlgen_cli.errors import require
from rlgen_cli.schema.ranges import BELOW_ONE, COUNT, FRACTION, NON_NEGATIVE, POSITIVE

ForwardLoss = Literal["nft", "awm", "dgpo"]
RolloutSolver = Literal["dpm2", "euler", "sde"]
TimestepSampling = Literal["subset", "stratified", "truncated"]
DGPOReference = Literal["base", "old"]
TimestepDraw = Literal["per_sample", "per_microbatch"]
AWMWeighting = Literal["uniform", "t", "t2", "ghuber"]


@dataclass
class OldPolicyConfig:
    """The old policy v_old trails the trained one, refreshed after every epoch:
    ``θ_old ← d·θ_old + (1 − d)·θ`` with ``d = 0`` for the first ``flat_steps`` optimizer steps, then
    ``min(rate·(step − flat_steps), max_decay)``. DiffusionNFT's decay_type 1 = (0, 1e-3, 0.5), 2 = (75,
    7.5e-3, 0.999), 0 = max_decay 0 (the old policy is the current one); AWM's KL-EMA = (0, 1e-3, 0.3)."""

    flat_steps: Annotated[int, NON_NEGATIVE] = 0
    """Optimizer steps during which the old policy is replaced by the current one after each epoch."""
    rate: Annotated[float, NON_NEGATIVE] = 1e-3
    """Growth of the decay per optimizer step after ``flat_steps``."""
    max_decay: Annotated[float, BELOW_ONE] = 0.5
    """Upper bound of the decay, in [0, 1)."""


@dataclass
class ForwardConfig:
    loss: Annotated[str, ForwardLoss] = "nft"
    """``nft`` (DiffusionNFT: positive / negative implicit policies), ``awm`` (advantage-weighted
    flow matching) or ``dgpo`` (group-level DPO; σ and ε shared within each prompt's group)."""
    solver: Annotated[str, RolloutSolver] = "dpm2"
    """Rollout solver: ``dpm2`` (deterministic DPM-Solver++ 2M, DiffusionNFT's), ``euler`` (the Euler
    ODE), or ``sde`` (the configured ``sampler`` step at its noise level; AWM samples stochastically with
    SA-Solver upstream, which rlgen does not ship)."""
    sample_with_old: bool = True
    """Roll out with the old policy (DiffusionNFT) instead of the trained one (AWM)."""
    timestep_sampling: Annotated[str, TimestepSampling] = "subset"
    """Which rollout σ each sample trains on, drawn afresh per sample and inner epoch: ``subset``
    (int(T·timestep_fraction) distinct σ of the T, DiffusionNFT) or ``stratified`` (one σ in each of
    ``num_timesteps`` strata of the indices [1, int(T·timestep_fraction)], AWM) or ``truncated``
    (``num_timesteps`` distinct σ of the indices [0, int(T·timestep_fraction)], DGPO)."""
    timestep_draw: Annotated[str, TimestepDraw] = "per_sample"
    """Whose draw those σ are: ``per_sample`` (every sample its own, from its own stream: the σ of one
    micro-batch spread out, less variance between micro-batches) or ``per_microbatch`` (the micro-batch's
    first sample draws, every sample trains on those σ: AWM's script). Same expectation. DGPO reads
    neither (each group shares its σ) and refuses ``per_microbatch``."""
    timestep_fraction: Annotated[float, FRACTION] = 0.99
    """``subset``: share of the T rollout σ trained; ``stratified`` / ``truncated``: the indices drawn
    from end at int(T·fraction)."""
    num_timesteps: Annotated[int, COUNT] = 6
    """``stratified`` / ``truncated``: σ trained per sample (AWM's ``train_timesteps``, DGPO's
    ``num_train_timesteps``)."""
    nft_beta: Annotated[float, POSITIVE] = 1.0
    """DiffusionNFT's β > 0: v⁺ = (1 − β)·v_old + β·v_θ, v⁻ = (1 + β)·v_old − β·v_θ (upstream 1.0; 0.1 for
    OCR and multi-reward)."""
    adaptive_weight: bool = True
    """DiffusionNFT: divide each x₀-space error by its own detached mean absolute value (upstream)."""
    weighting: Annotated[str, AWMWeighting] = "ghuber"
    """AWM's per-sample weighting ρ(e) of the flow-matching error: ``uniform``, ``t`` (σ·e), ``t2``
    (σ²·e) or ``ghuber`` (σ·((e + δ)^p − δ^p)/p, upstream)."""
    ghuber_power: Annotated[float, POSITIVE] = 0.25
    """AWM: the generalised Huber power p."""
    advantage_max: Annotated[float, POSITIVE] = 1.0
    """AWM: advantages (clipped to ±algo.adv_clip_max) are rescaled to ±advantage_max."""
    old_weight: Annotated[float, NON_NEGATIVE] = 0.0
    """AWM: weight of mean((v_θ − v_old)²), the pull towards the old policy (upstream ``ema_beta`` 1)."""
    dgpo_beta: Annotated[float, POSITIVE] = 100.0
    """DGPO's preference strength β > 0: group weight σ((β/G)·Σ A_i·(e_θ,i − e_ref,i)) (upstream 100)."""
    dgpo_reference: Annotated[str, DGPOReference] = "base"
    """DGPO's reference e_ref: ``base`` (the base model, LoRA disabled; upstream) or ``old`` (the old
    policy, upstream's ``use_ema_ref``)."""
    dgpo_clip_range: Annotated[float, NON_NEGATIVE] = 0.0
    """DGPO: PPO-style clip c against the old policy (upstream 1e-2): an error whose ratio
    exp(e_old − e_θ) passed 1 + c (A > 0) or 1 − c (A ≤ 0) is detached; 0 turns it off."""
    old: OldPolicyConfig = field(default_factory=OldPolicyConfig)

    def reads_old_policy(self) -> bool:
        """Whether anything reads the old policy, so that ``old`` does something: the rollouts
        (``sample_with_old``) or the loss (:data:`OLD_POLICY_READERS`); the refresh alone changes no
        weight (``recipes/flow_forward.py``, ``recipes/flow_dgpo.py``)."""
        by_loss = {
            "nft": True,
            "awm": self.old_weight > 0,
            "dgpo": self.dgpo_reference == "old" or self.dgpo_clip_range > 0,
        }
        return self.sample_with_old or by_loss[self.loss]

    def __post_init__(self) -> None:
        require(
            self.loss != "dgpo" or self.timestep_draw == "per_sample",
            f"algo.forward.timestep_draw={self.timestep_draw} is not read by algo.forward.loss=dgpo: DGPO "
            "shares the σ and ε of each prompt's group (drawn from the group's stream, whatever the "
            "micro-batch), which its group weight needs. Drop the override (algo.forward.timestep_draw="
            "per_sample); per_microbatch is AWM's draw (algo=awm)",
        )


FORWARD_LOSS_OPTIONS = {
    "nft": ("nft_beta", "adaptive_weight", "timestep_draw"),
    "awm": ("weighting", "ghuber_power", "advantage_max", "old_weight", "timestep_draw"),
    "dgpo": ("dgpo_beta", "dgpo_reference", "dgpo_clip_range"),
}
"""The ``algo.forward`` options that only some losses read, by loss (``recipes/flow_forward.py``:
``loss_weights``, ``forward_loss``, ``train_micro_batch``; DGPO's update, ``recipes/flow_dgpo.py``). Every
loss reads the others, ``num_timesteps`` and ``old`` as :data:`TIMESTEP_SAMPLING_OPTIONS` and
:meth:`ForwardConfig.reads_old_policy` say. Only a command-line override of another loss's option is
refused (``tasks/unread_options.py``): a preset's values of it (``algo=awm algo.forward.loss=nft`` keeps
AWM's ``old_weight``) are no one's choice."""

TIMESTEP_SAMPLING_OPTIONS = {
    "subset": ("timestep_fraction",),
    "stratified": ("timestep_fraction", "num_timesteps"),
    "truncated": ("timestep_fraction", "num_timesteps"),
}
"""The ``algo.forward`` options each ``timestep_sampling`` reads (``recipes/forward_draws.py``)."""

AWM_WEIGHTING_OPTIONS = {"uniform": (), "t": (), "t2": (), "ghuber": ("ghuber_power",)}
"""The ``algo.forward`` options each AWM ``weighting`` reads (``algos/awm.py: weigh``)."""

OLD_POLICY_READERS = {
    "nft": "always reads it (v⁺ and v⁻ are built from it)",
    "awm": "reads it only with algo.forward.old_weight > 0",
    "dgpo": "reads it only with algo.forward.dgpo_reference=old or algo.forward.dgpo_clip_range > 0",
}
"""When each loss reads the old policy (besides rollouts with ``algo.forward.sample_with_old``)."""


def check_forward_steps(forward: ForwardConfig, num_steps: int) -> None:
    """The σ a sample trains on must exist in a rollout of ``model.num_steps`` steps."""
    if forward.timestep_sampling == "subset":
        require(
            int(num_steps * forward.timestep_fraction) >= 1,
            f"algo.forward.timestep_fraction={forward.timestep_fraction} trains int({num_steps} × "
            f"{forward.timestep_fraction}) = 0 of model.num_steps={num_steps} σ; raise either",
        )
    elif forward.timestep_sampling == "truncated":
        top = int(num_steps * forward.timestep_fraction)
        require(
            top < num_steps and forward.num_timesteps <= top + 1,
            f"algo.forward.timestep_sampling=truncated draws algo.forward.num_timesteps="
            f"{forward.num_timesteps} distinct σ of the indices [0, int(T·fraction)] = [0, {top}] of "
            f"model.num_steps={num_steps}; keep timestep_fraction < 1 and num_timesteps ≤ {min(top, num_steps - 1) + 1}",
        )
    else:
        require(
            num_steps >= 2 and int(num_steps * forward.timestep_fraction) >= 1,
            f"algo.forward.timestep_sampling=stratified draws from the σ indices [1, int(T·fraction)]: "
            f"model.num_steps={num_steps} with timestep_fraction={forward.timestep_fraction} leaves none; "
            "use model.num_steps ≥ 2 and a larger fraction",
        )
