"""What a resumed run may change in its config, and the refusal of every other change.

A checkpoint holds the state of one training computation; resuming it under another config would mix
two. Some changes are silently without effect (an optimizer's learning rate and weight decay come back
from the checkpoint under a constant schedule), others silently change the run (a LoRA α rescales the
adapter, EMA switched off resumes from the EMA weights, another algorithm starts from state it never
saved). So the resolved config is compared with the checkpoint's ``config.yaml`` key by key, and a resume
whose config differs outside :data:`MAY_CHANGE` stops before anything is loaded, naming each difference.

What may change is what a run observes or where it runs, not what it computes: logging, evaluation and
checkpoint cadence, the device and file locations, the rendezvous address. Beyond that:

* ``epochs`` and ``time_limit_minutes`` (a run extended, or given more time) where the caller says the
  learning-rate schedule does not depend on them (a constant schedule);
* the process count (``launcher.num_processes`` × ``num_machines``), as long as an optimizer step covers
  as many micro-batches as before: ``algo.gradient_accumulation_steps`` counts them over all processes,
  and its ``null`` means one per process, so it is compared as that number. A run saved with ``null`` on
  N processes resumes on another count with ``algo.gradient_accumulation_steps=N``.

A change made on purpose is named in ``resume_changes`` (a key or a section), and then taken, except
where a resume cannot honour it (:data:`NEVER_CHANGE`): the optimizer brings back its own learning rate
and weight decay, the LoRA's shape and scale belong to the saved weights, the EMA is part of the saved
state, and another recipe or model family would start from state the checkpoint does not hold.

Keys only one side has are not compared: a checkpoint of an older rlgen lacks settings added since (they
take their defaults), and a setting removed since has no effect.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlgen_cli.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["MAY_CHANGE", "NEVER_CHANGE", "check_resume_config", "config_differences"]

MAY_CHANGE = (
    "resume", "resume_unverified", "resume_changes", "run_dir", "device", "progress", "logging",
    "eval_every", "save_every", "keep_last", "images_every", "eval_before", "eval_heldout", "eval_report",
    "data.test", "data.eval_num_prompts", "data.eval_images_per_prompt", "model.eval_num_steps",
    "model.path", "model.local_files_only",
    "launcher.name", "launcher.config_file", "launcher.machine_rank", "launcher.main_process_ip",
    "launcher.main_process_port",
)  # fmt: skip
"""Settings (and sections, with everything under them) a resumed run may change freely."""
SCHEDULE_LENGTH = ("epochs", "time_limit_minutes")
"""May change where the learning-rate schedule does not depend on them."""
PROCESS_COUNT = ("launcher.num_processes", "launcher.num_machines")
"""May change: the micro-batches per optimizer step are compared instead."""
ACCUMULATION = "algo.gradient_accumulation_steps"
NEVER_CHANGE = ("recipe", "model.family", "model.lora", "algo.ema", "algo.lr", "algo.weight_decay")
"""Settings a resume cannot honour, even when named in ``resume_changes``."""


def flat(config: DictConfig) -> dict[str, Any]:
    """The resolved config as ``{"a.b.c": leaf}`` (lists are leaves)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(config, resolve=True), "")
    return out


def _per_step(flat_config: dict[str, Any]) -> dict[str, Any]:
    """``flat_config`` with a null ``algo.gradient_accumulation_steps`` replaced by the micro-batches per
    optimizer step it means: one per process."""
    if ACCUMULATION in flat_config and flat_config[ACCUMULATION] is None:
        processes = flat_config.get("launcher.num_processes", 1) * flat_config.get("launcher.num_machines", 1)
        return {**flat_config, ACCUMULATION: processes}
    return flat_config


def config_differences(
    saved: DictConfig, current: DictConfig, null_accumulation_per_process: bool = True
) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every key both configs hold with different values (the
    micro-batches per optimizer step compared as a number, ``null`` resolved by the process count, unless
    the recipe's steps do not depend on the process count: ``null_accumulation_per_process=False``)."""
    old, new = flat(saved), flat(current)
    if null_accumulation_per_process:
        old, new = _per_step(old), _per_step(new)
    return [
        (key, old[key], new[key]) for key in sorted(old.keys() & new.keys()) if not _same(old[key], new[key])
    ]


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _covered(key: str, allowed: tuple[str, ...]) -> bool:
    return any(key == name or key.startswith(f"{name}.") for name in allowed)


def check_resume_config(
    checkpoint: Path,
    saved: DictConfig,
    current: DictConfig,
    schedule_uses_length: bool,
    null_accumulation_per_process: bool = True,
) -> None:
    """Refuse to resume ``checkpoint`` (whose config is ``saved``) under ``current`` where they differ in a
    setting that changes what training computes (see the module docstring).

    Args:
        checkpoint: The checkpoint's folder, named in the error.
        saved: Its ``config.yaml``.
        current: This run's config.
        schedule_uses_length: Whether this run's learning-rate schedule depends on ``epochs`` /
            ``time_limit_minutes`` (a decaying or per-step schedule does; a constant one does not).
        null_accumulation_per_process: Whether a null ``algo.gradient_accumulation_steps`` means one
            micro-batch per process (False for a recipe whose optimizer step is the same on any process
            count, which refuses the setting: DPO / SFT, pretraining).

    Raises:
        UserError: Naming every refused difference and how to proceed.
    """
    named = tuple(OmegaConf.select(current, "resume_changes", default=None) or ())
    never = [
        name
        for name in named
        if _covered(name, NEVER_CHANGE) or any(_covered(k, (name,)) for k in NEVER_CHANGE)
    ]
    if never:
        raise UserError(
            f"resume_changes names {never}, which a resume cannot honour ({', '.join(NEVER_CHANGE)}: the "
            "optimizer brings back its own learning rate and weight decay, the LoRA and the EMA are part of "
            "the saved state, another recipe or family starts from state the checkpoint does not hold); "
            "start a new run to change them"
        )
    allowed = MAY_CHANGE + PROCESS_COUNT + (() if schedule_uses_length else SCHEDULE_LENGTH)
    differences = config_differences(saved, current, null_accumulation_per_process)
    refused = [d for d in differences if not _covered(d[0], allowed + named)]
    for key, old, new in differences:
        if _covered(key, named):
            log.warning("resume from %s changes %s: %r → %r (resume_changes)", checkpoint, key, old, new)
    if not refused:
        return
    listed = "; ".join(f"{key}: {old!r} → {new!r}" for key, old, new in refused)
    why = {
        "epochs": "the learning-rate schedule spans epochs",
        "time_limit_minutes": "the learning-rate schedule spans the time limit",
        ACCUMULATION: "the micro-batches per optimizer step, over all processes; null means one per "
        "process, so on another process count pass the checkpoint's number explicitly",
    }
    reasons = sorted({why[key] for key, _, _ in refused if key in why})
    raise UserError(
        f"resume from {checkpoint}: this run's config differs from the checkpoint's in settings that change "
        f"what training computes: {listed}"
        + (f" ({'; '.join(reasons)})" if reasons else "")
        + f". A resumed run continues the same training: resume with the checkpoint's values (they are in "
        f"{Path(checkpoint) / 'config.yaml'}), name a change you mean in resume_changes (e.g. "
        f"'resume_changes=[{refused[0][0]}]'), or start a new run in another run_dir. A resume may change "
        f"without naming: {', '.join(MAY_CHANGE)}"
    )
