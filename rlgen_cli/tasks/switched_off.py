"""Command-line settings of a feature whose switch is off: ``algo.ema.decay=0.99`` with the EMA off,
``guard.action=rollback`` without monitors; and those another choice leaves unread
(``tasks/unread_options.py``: a window option the window kind does not read, another loss's option).
Each would do nothing, so ``rlgen train`` refuses it (exit 2) naming the switch or the choice.

Only the command line's overrides are checked. An option's preset values for a feature it leaves off
(``conf/algo/grpo.yaml``'s EMA warm-up, used once ``algo.ema.enabled=true``) are not choices the user made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlgen_cli.errors import UserError
from rlgen_cli.tasks.common import command_line_overrides
from rlgen_cli.tasks.unread_options import section_at, unread_problem

__all__ = ["SWITCHES", "Switch", "refuse_switched_off"]


@dataclass(frozen=True)
class Switch:
    """Keys of ``section`` that act only while ``is_on(section)``.

    Attributes:
        section: The dotted path of the section (``algo.ema``).
        gated: The keys the switch gates; empty: every key but the switch's own.
        switch_keys: The keys that turn it on (never refused).
        is_on: Whether the validated section has the feature on.
        off: How this run turns it off, and what turns it on, for the message.
    """

    section: str
    gated: tuple[str, ...]
    switch_keys: tuple[str, ...]
    is_on: Callable[[Any], bool]
    off: str

    def gates(self, key: str) -> bool:
        """Whether ``key`` (relative to the section, first component) is one this switch gates."""
        if key in self.switch_keys:
            return False
        return not self.gated or key in self.gated


GARDO_GATE = (
    "proxy_reward", "auxiliary_rewards", "gate_fraction", "gate_fraction_min", "gate_fraction_max",
    "gate_fraction_rate", "gate_window",
)  # fmt: skip
RENDEZVOUS = ("machine_rank", "main_process_ip", "main_process_port")
R3_TEXT_LOSS = ("ce_weight", "kl_weight_text", "format_weight")  # format_weight shapes the text reward only
R3_IMAGE_LOSS = ("mse_weight", "kl_weight_image")
R3_SDE_FORM = ("sde_kind", "eta_schedule")  # how an SDE step is taken: unread when no stage takes one
R3_SDE = ("enable_sde_gen", "enable_sde_edit")

SWITCHES = (
    Switch("algo.ema", (), ("enabled",), lambda s: s.enabled, "algo.ema.enabled=false (add algo.ema.enabled=true)"),
    Switch("algo.flash", (), ("enabled",), lambda s: s.enabled, "algo.flash.enabled=false (add algo.flash.enabled=true)"),
    Switch(
        "logging.wandb", (), ("enabled",), lambda s: s.enabled,
        "logging.wandb.enabled=false (add logging.wandb.enabled=true)",
    ),
    Switch(
        "guard", (), ("monitors",), lambda s: s.enabled,
        "the guard is off: guard.monitors is empty (add +guard.monitors.REWARD=WEIGHT, docs/guard.md)",
    ),
    Switch(
        "algo.gardo", GARDO_GATE, ("kl_gate",), lambda s: s.kl_gate,
        "algo.gardo.kl_gate=false (add algo.gardo.kl_gate=true)",
    ),
    Switch(
        "algo.gardo", ("feature_model",), ("diversity",), lambda s: s.diversity,
        "algo.gardo.diversity=false (add algo.gardo.diversity=true)",
    ),
    Switch(
        "algo.token", ("vllm_gpu_memory_utilization",), ("engine",), lambda s: s.engine == "vllm",
        "algo.token.engine=hf (add algo.token.engine=vllm)",
    ),
    Switch(
        "launcher", RENDEZVOUS, ("name",), lambda s: s.name != "local",
        "launcher=local runs one process here (add launcher=accelerate or launcher=multinode)",
    ),
    Switch(
        "r3", R3_TEXT_LOSS, ("tune_text_cot",), lambda s: s.tune_text_cot,
        "r3.tune_text_cot=false trains no text (add r3.tune_text_cot=true)",
    ),
    Switch(
        "r3", R3_IMAGE_LOSS, ("tune_image_cot",), lambda s: s.tune_image_cot,
        "r3.tune_image_cot=false trains no image (add r3.tune_image_cot=true)",
    ),
    Switch(
        "r3", ("noise_level_gen",), ("enable_sde_gen",), lambda s: s.enable_sde_gen,
        "r3.enable_sde_gen=false draws generated images by ODE (add r3.enable_sde_gen=true)",
    ),
    Switch(
        "r3", ("noise_level_edit", "max_sde_timestep_idx_for_edit"), ("enable_sde_edit",),
        lambda s: s.enable_sde_edit, "r3.enable_sde_edit=false draws edited images by ODE (add r3.enable_sde_edit=true)",
    ),
    Switch(
        "r3", R3_SDE_FORM, R3_SDE, lambda s: s.enable_sde_gen or s.enable_sde_edit,
        "r3.enable_sde_gen=false and r3.enable_sde_edit=false draw every image by ODE (add either =true)",
    ),
)  # fmt: skip
"""Every feature whose settings the command line may set while it is off."""


def _switch_problem(key: str, cfg: Any) -> str | None:
    """Why an override of ``key`` does nothing in ``cfg`` (a switch that is off), or None."""
    for switch in SWITCHES:
        prefix = f"{switch.section}."
        if not key.startswith(prefix) or not switch.gates(key[len(prefix) :].split(".")[0]):
            continue
        section = section_at(cfg, switch.section)
        if section is not None and not switch.is_on(section):
            return switch.off
    return None


def refuse_switched_off(cfg: Any) -> None:
    """Refuse each command-line override of a setting whose feature is off, or that another choice leaves
    unread, in the validated ``cfg``.

    Raises:
        UserError: Naming the override, the switch that is off or the choice, and how to make it count.
    """
    for override in command_line_overrides():
        if override.is_delete():
            continue
        key = override.key_or_group
        why = _switch_problem(key, cfg) or unread_problem(key, cfg)
        if why is not None:
            raise UserError(f"{override.input_line} does nothing in this run: {why}; or drop the override")
