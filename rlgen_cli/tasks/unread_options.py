"""Command-line settings another choice of the run leaves unread: a window option its kind or sliding
strategy does not read, an ``algo.forward`` option of another loss, the CFG gradient without a CFG
branch, log-probability settings of a recipe that uses none. Each would do nothing; :func:`unread_problem`
says why, and ``tasks/switched_off.py`` refuses the override (exit 2).

Only the command line's overrides are checked: the option presets set values their choice leaves
unread (``conf/algo/grpo.yaml``'s ``cfg_grad`` under a model without CFG, ``conf/algo/awm.yaml``'s
``old_weight`` under ``algo.forward.loss=nft``), and those are no one's choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlgen_cli.schema.algo import SLIDING_STRATEGY_OPTIONS, WINDOW_OPTIONS
from rlgen_cli.schema.families import family_spec
from rlgen_cli.schema.forward import (
    AWM_WEIGHTING_OPTIONS,
    FORWARD_LOSS_OPTIONS,
    OLD_POLICY_READERS,
    TIMESTEP_SAMPLING_OPTIONS,
)

__all__ = ["LOGPROB_UNUSED", "NOT_SAMPLED", "section_at", "unread_problem"]


def section_at(cfg: Any, path: str) -> Any:
    """The validated section at ``path``, or None where this recipe's schema has none."""
    node = cfg
    for name in path.split("."):
        node = getattr(node, name, None)
        if node is None:
            return None
    return node


def _option(key: str, section: str) -> str | None:
    """The first component of ``key`` below ``section`` (``algo.window.size`` → ``size``), or None."""
    return key.removeprefix(f"{section}.").split(".")[0] if key.startswith(f"{section}.") else None


def _unread_by_choice(
    option: str, key: str, value: str, table: dict[str, tuple[str, ...]], kinds: str
) -> str | None:
    """Why ``option`` does nothing under ``key=value`` (a key of ``table``): other values of ``table``
    read it, this one does not; None where it reads it or ``table`` lists it under no value."""
    readers = [name for name, options in table.items() if option in options]
    if not readers or value in readers:
        return None
    own = ", ".join(table[value]) or f"none of the {kinds}' options"
    return f"{key}={value} reads {own}; {option} is read by the {kinds} {', '.join(readers)}"


def _window_problem(key: str, cfg: Any) -> str | None:
    """``algo.window.OPTION`` that this run's window kind, or its sliding strategy, does not read."""
    window, option = section_at(cfg, "algo.window"), _option(key, "algo.window")
    if window is None or option is None or option == "kind":
        return None
    why = _unread_by_choice(option, "algo.window.kind", window.kind, WINDOW_OPTIONS, "kinds")
    if why is None and window.kind == "sliding":
        strategy = window.strategy
        why = _unread_by_choice(
            option, "algo.window.strategy", strategy, SLIDING_STRATEGY_OPTIONS, "strategies"
        ) or _motion_problem(option, window)
    return why


MOTION_OPTIONS = (
    "shift_every",
    "roll_back",
    "min_shift_every",
    "max_shift_every",
    "exp_decay_rate",
    "exp_decay_start",
)
"""The sliding options that say when the window moves (``sde.window._shift_intervals``, ``_sliding_start``)."""


def _motion_problem(option: str, window: Any) -> str | None:
    """A sliding option of when the window moves, where it never moves (``stride=0``: one position), or
    ``shift_every`` under ``decay`` with both bounds set (it only fills a null bound)."""
    if window.strategy == "random" or option not in MOTION_OPTIONS:
        return None
    if window.stride == 0:
        return "algo.window.stride=0 never moves the window, so when it moves is not read (add algo.window.stride ≥ 1)"
    bounds_set = window.min_shift_every is not None and window.max_shift_every is not None
    if option == "shift_every" and window.strategy == "decay" and bounds_set:
        return (
            "algo.window.strategy=decay interpolates between algo.window.max_shift_every and "
            "min_shift_every, both set; shift_every only fills a null one (drop either bound)"
        )
    return None


def _range_problem(key: str, cfg: Any) -> str | None:
    """``algo.window.range`` of a ``random_window`` of size 0, which is no window (``sde/window.py``)."""
    window = section_at(cfg, "algo.window")
    if key != "algo.window.range" or window is None or window.kind != "random_window" or window.size:
        return None
    return (
        "algo.window.size=0 makes every step stochastic (plain Flow-GRPO): there is no window to place "
        "(add algo.window.size > 0)"
    )


def _forward_problem(key: str, cfg: Any) -> str | None:
    """``algo.forward.OPTION`` that this run's loss, σ sampling or AWM weighting does not read, or
    ``algo.forward.old`` where nothing reads the old policy."""
    forward, option = section_at(cfg, "algo.forward"), _option(key, "algo.forward")
    if forward is None or option is None:
        return None
    if option == "old" and not forward.reads_old_policy():
        return (
            f"nothing reads the old policy: algo.forward.loss={forward.loss} {OLD_POLICY_READERS[forward.loss]}, "
            "and algo.forward.sample_with_old=false rolls out with the trained policy (add either)"
        )
    choices = [
        ("algo.forward.loss", forward.loss, FORWARD_LOSS_OPTIONS, "losses"),
        ("algo.forward.timestep_sampling", forward.timestep_sampling, TIMESTEP_SAMPLING_OPTIONS, "samplings"),
        ("algo.forward.weighting", forward.weighting, AWM_WEIGHTING_OPTIONS, "weightings"),
    ]
    return next((why for choice in choices if (why := _unread_by_choice(option, *choice)) is not None), None)


def _cfg_grad_problem(key: str, cfg: Any) -> str | None:
    """``algo.cfg_grad`` where no classifier-free-guidance branch runs (``models/base.py: cfg_gradient``
    acts only where a family combines two predictions)."""
    model = section_at(cfg, "model")
    if key != "algo.cfg_grad" or model is None or not hasattr(model, "guidance_scale"):
        return None
    if not family_spec(model.family).negative_branch:
        return (
            f"model.family={model.family} is guidance-distilled: the guidance scale is an input embedding, and "
            "its velocity is one prediction, with no unconditional CFG branch whose gradient algo.cfg_grad picks"
        )
    if model.guidance_scale <= 1.0:
        return (
            f"model.guidance_scale={model.guidance_scale} runs no unconditional CFG branch, the one whose gradient "
            "algo.cfg_grad picks (add model.guidance_scale > 1)"
        )
    return None


def _branch_problem(key: str, cfg: Any) -> str | None:
    """``algo.shared_initial_noise`` under ``algo.branch=shared_prefix``, which shares the noise anyway."""
    if (
        key != "algo.shared_initial_noise"
        or getattr(section_at(cfg, "algo"), "branch", None) != "shared_prefix"
    ):
        return None
    return (
        "algo.branch=shared_prefix already starts every sample of a group from the same noise (the group's "
        "one ODE prefix)"
    )


NOT_SAMPLED = {
    "vlm_sft": {
        "model.vlm.completion_cap": "recipe=vlm_sft samples no completions (it trains on the dataset's "
        "conversations; its evaluation answers within model.vlm.eval_max_new_tokens)",
    },
}
"""Per recipe, the rollout settings it never reads, since it does not roll out."""

LOGPROB_KEYS = ("sampler.logprob_reduce", "sampler.logprob_form")
LOGPROB_UNUSED = {
    "flow_pref": "recipe=flow_pref uses no SDE log-probability: DPO and SFT train the flow-matching error "
    "of forward-noised samples, and its sampling keeps only each sample's x₀",
    "flow_forward": "recipe=flow_forward uses no SDE log-probability: it trains on forward-noised clean "
    "samples, and algo.forward.solver=sde keeps only each rollout's x₀",
}
"""Per recipe that computes no log-probability it uses, why :data:`LOGPROB_KEYS` do nothing there; they
shape the GRPO family's (``recipe=flow_grpo``)."""


def _recipe_problem(key: str, cfg: Any) -> str | None:
    """A setting this run's recipe never reads (:data:`NOT_SAMPLED`, :data:`LOGPROB_UNUSED`)."""
    recipe = getattr(cfg, "recipe", "")
    if key in LOGPROB_KEYS and recipe in LOGPROB_UNUSED:
        return LOGPROB_UNUSED[recipe]
    return NOT_SAMPLED.get(recipe, {}).get(key)


CHECKS: tuple[Callable[[str, Any], str | None], ...] = (
    _window_problem,
    _range_problem,
    _forward_problem,
    _cfg_grad_problem,
    _branch_problem,
    _recipe_problem,
)


def unread_problem(key: str, cfg: Any) -> str | None:
    """Why an override of ``key`` does nothing under the choices of the validated ``cfg``, or None."""
    return next((why for check in CHECKS if (why := check(key, cfg)) is not None), None)
