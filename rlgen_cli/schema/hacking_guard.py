"""Schema of the reward-hacking guard (``guard:`` on every flow training run; docs/guard.md).

The guard watches *held-out* rewards — ordinary registered rewards the policy is not trained on — on the
images of every evaluation, flags an evaluation where the trained reward rose while the held-out metric
fell by more than ``margin`` over ``window`` evaluations, the drop beyond ``noise_k`` and the rise
beyond ``rise_k`` standard errors of the evaluation's own noise, and then warns, stops or rolls back
to the best checkpoint by the held-out metric (``training/control/hacking_guard.py`` holds the rule and its formula).
No monitors: no guard, and nothing of it runs.

Checked here, at the config boundary (exit code 2): what the guard's own fields allow and what it needs
from the rest of the run (evaluations, a KL weight to raise, a launcher whose weights can be reloaded).
Monitor names and their kwargs are checked against the reward registry by the task
(``training/control/hacking_guard.py``: :func:`~rlgen_cli.training.control.hacking_guard.require_known_monitors`), as ``reward.kwargs`` are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from rlgen_cli.errors import require
from rlgen_cli.schema.choices import ENGINE_LAUNCHERS, GuardAction
from rlgen_cli.schema.ranges import ANY, COUNT, FRACTION, NON_NEGATIVE, at_least

__all__ = ["GuardConfig", "check_guard"]


@dataclass
class GuardConfig:
    monitors: Annotated[dict[str, float], ANY] = field(default_factory=dict)
    """Held-out rewards {name: weight}, scored on every evaluation's images (the test prompts, fixed
    noise); the held-out metric is Σ weight · mean score. Registered reward names, as in
    ``reward.weights``; the same name as a trained reward with other kwargs is allowed (ShapesEval:
    strict accuracy while training on partial credit). Empty = no guard."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Per-monitor constructor arguments {name: {arg: value}}, typed as ``reward.kwargs`` are."""
    window: Annotated[int, COUNT] = 3
    """W: evaluations the rule looks back over (the current one and the W before it)."""
    margin: Annotated[float, NON_NEGATIVE] = 0.05
    """δ: how far, in the held-out metric's units, it must fall below its best of the window to flag."""
    noise_k: Annotated[float, NON_NEGATIVE] = 3.0
    """k: standard errors of the evaluation's own noise (from the spread over its prompts) that the
    held-out drop must exceed as well as δ; with ``rise_k`` = 1 it flags 0.5–3 % of 40-evaluation runs
    on pure noise with W = 3 (tests/training/test_guard_noise.py). 0 = δ alone."""
    rise_k: Annotated[float, NON_NEGATIVE] = 1.0
    """k_r: standard errors the trained reward's rise over the window must exceed (1: beyond its own
    noise; 0 = any rise)."""
    action: Annotated[str, GuardAction] = "warn"
    """On a flagged evaluation: ``warn`` (log it), ``stop`` (end the run after this epoch, saving as
    after a last epoch), ``rollback`` (load ``checkpoints/best_heldout``'s weights, EMA and optimizer
    state, scale the learning rate and KL weight, continue)."""
    rollback_lr_scale: Annotated[float, FRACTION] = 0.5
    """A rollback multiplies ``algo.lr`` (and the optimizer's learning rate) by this, each time."""
    rollback_kl_scale: Annotated[float, at_least(1)] = 1.0
    """A rollback multiplies ``algo.kl_weight`` by this, each time (1 = unchanged; flow_grpo only, and
    only with ``algo.kl_weight`` > 0)."""
    max_rollbacks: Annotated[int, NON_NEGATIVE] = 3
    """Rollbacks allowed; a flag after that many stops the run instead."""

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kwargs) - set(self.monitors))
        require(not unknown, f"guard.kwargs names rewards not in guard.monitors: {unknown}")
        require(
            not self.monitors or any(w != 0 for w in self.monitors.values()),
            f"guard.monitors={dict(self.monitors)} has only zero weights; give a monitor a non-zero weight",
        )


def check_guard(cfg: Any) -> None:
    """What the guard needs from the rest of a flow run ``cfg`` (a ``FlowRunConfig``).

    Raises:
        UserError: Naming the keys and the fix.
    """
    guard = cfg.guard
    if not guard.enabled:
        return
    require(
        cfg.eval_every > 0,
        "guard.monitors are scored at evaluations, and eval_every=0 never evaluates: set eval_every=N",
    )
    require(
        cfg.data.eval_num_prompts != 1,
        "the guard estimates an evaluation's noise from the spread over its prompts, and "
        "data.eval_num_prompts=1 evaluates one: set data.eval_num_prompts ≥ 2 (0 = the whole test split)",
    )
    if guard.action != "rollback":
        return
    require(
        cfg.recipe != "flow_forward",
        "guard.action=rollback restores the trained weights but not recipe=flow_forward's old policy, "
        "which samples the rollouts: use guard.action=warn or stop with this algorithm",
    )
    pref = cfg.algo.pref if cfg.recipe == "flow_pref" else None
    if pref is not None and pref.loss == "dpo":
        require(
            pref.ref_update_step == 0,
            "guard.action=rollback restores the trained weights but not online DPO's reference copy "
            f"(algo.pref.ref_update_step={pref.ref_update_step}), which samples the rollouts: use "
            "guard.action=warn or stop with online DPO, or algo.pref.ref_update_step=0 (offline DPO)",
        )
    gardo = getattr(cfg.algo, "gardo", None)  # GARDO's switches: flow_grpo's and flow_forward's algorithms
    if gardo is not None:
        require(
            gardo.refresh_every == 0,
            "guard.action=rollback restores the trained weights but not the reference that "
            f"algo.gardo.refresh_every={gardo.refresh_every} refreshes, which the KL anchors the policy to: "
            "use guard.action=warn or stop with it, or algo.gardo.refresh_every=0",
        )
    require(
        cfg.launcher.name not in ENGINE_LAUNCHERS,  # an engine's shards cannot be reloaded mid-run
        f"guard.action=rollback reloads weights and optimizer state mid-run, which launcher="
        f"{cfg.launcher.name} shards: use launcher=accelerate (DDP) or local, or guard.action=warn or stop",
    )
    if guard.rollback_kl_scale != 1:
        kl_weight = getattr(cfg.algo, "kl_weight", 0.0)
        require(
            cfg.recipe == "flow_grpo" and kl_weight > 0,
            f"guard.rollback_kl_scale={guard.rollback_kl_scale} scales algo.kl_weight, which recipe="
            f"{cfg.recipe} with algo.kl_weight={kl_weight} does not train with: set algo.kl_weight > 0 "
            "(flow_grpo) or leave guard.rollback_kl_scale=1 and lower the learning rate instead",
        )
