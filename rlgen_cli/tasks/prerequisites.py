"""Everything a verb will need, checked before it builds or loads any model, and reported together.

``rlgen train | sample | eval | serve-reward`` collect every missing prerequisite — a prompt file, a
checkpoint or resume target, a model's weights (a local path, or a hub id that is not cached while the
hub is offline or does not answer), a reward's settings (GenEval's ``detector_path``), files and packages
(``rewards/requirements.py``), a reward server that does not answer — and stop with exit code 2 listing
all of them with what to fetch or set, so one run of the command shows everything to fix, in seconds.

A reward is checked by building it (every constructor is cheap and loads nothing: the weights load on
the first score), which runs the same constructor validation ``rlgen plan`` reports, and then by its
``requirements()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rlgen_cli.errors import UserError

__all__ = [
    "Prerequisites", "checkpoint_problems", "data_problems", "model_problems", "resume_problems",
    "reward_problems",
]  # fmt: skip


class Prerequisites:
    """Collects what is missing; :meth:`require` stops the command when anything is."""

    def __init__(self) -> None:
        self.missing: list[str] = []

    def add(self, problems: Iterable[str]) -> Prerequisites:
        self.missing.extend(problems)
        return self

    def require(self) -> None:
        """Raise one :class:`UserError` naming every missing prerequisite (nothing when none is)."""
        if len(self.missing) == 1:
            raise UserError(self.missing[0])
        if self.missing:
            listed = "\n".join(f"  {i}. {problem}" for i, problem in enumerate(self.missing, 1))
            raise UserError(f"{len(self.missing)} prerequisites are missing (no model was loaded):\n{listed}")


def _problem(check: Callable[[], Any], prefix: str = "") -> list[str]:
    """``[]`` when ``check()`` passes, else its error as a problem (a user error or a constructor's
    ValueError / OSError / ImportError, each of which says what to set)."""
    try:
        check()
    except (UserError, ValueError, OSError, ImportError) as err:
        return [f"{prefix}{err}"]
    return []


def data_problems(cfg: Any, run_dir: Path, splits: Iterable[str]) -> list[str]:
    """Each prompt file of ``splits`` that is missing or does not parse (``common.require_data``), and of
    ``eval_heldout`` when the config sets it: a flow run's setup reads that split whatever the verb."""
    from rlgen_cli.tasks.common import require_data

    splits = tuple(splits)
    if getattr(cfg, "eval_heldout", None) and "eval_heldout" not in splits:
        splits += ("eval_heldout",)
    return [p for split in splits for p in _problem(lambda split=split: require_data(cfg, run_dir, (split,)))]


def checkpoint_problems(path: str | None, key: str, require_manifest: bool = False) -> list[str]:
    """``path`` (the value of ``key``) is a complete checkpoint: its files there with their saved sizes
    (and, with ``require_manifest``, a manifest that records them)."""
    if path is None:
        return []
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    return _problem(
        lambda: open_checkpoint(path, require_manifest=require_manifest), prefix=f"{key}={path}: "
    )


def resume_problems(cfg: Any) -> list[str]:
    """An explicit ``resume=PATH`` is a complete checkpoint with a manifest, or one without it when
    ``resume_unverified=true`` (``auto`` finds one, or starts afresh)."""
    resume = getattr(cfg, "resume", None)
    if resume in (None, "auto"):
        return []
    return checkpoint_problems(
        resume, "resume", require_manifest=not getattr(cfg, "resume_unverified", False)
    )


def model_problems(cfg: Any) -> list[str]:
    """The weights each model of the run loads are there (:func:`model_sections`): a local directory, or,
    with the hub offline (or ``local_files_only``), a cached hub repository. Tiny and ``random_init``
    models read none."""
    from rlgen_cli.rewards.requirements import ModelSource
    from rlgen_cli.vlm.assets import model_source

    problems = []
    for key, model in model_sections(cfg):
        if model.tiny or model.weights == "random_init" or not model.path:
            continue
        if model.family == "shapes":  # a packaged (builtin:shapes_base) or saved ShapesUNet, never the hub
            from rlgen_cli.models.shapes import resolve_model_dir

            problems += _problem(lambda model=model: resolve_model_dir(model.path))
            continue
        path = model_source(model.path)  # builtin:NAME = a model shipped with rlgen (the ShapesQA base)
        problem = ModelSource(f"{key}.path", path, local_files_only=model.local_files_only).problem()
        problems += [] if problem is None else [problem]
    return problems


def model_sections(cfg: Any) -> list[tuple[str, Any]]:
    """``(config key, model section)`` of every model the run builds: ``model``, or a unified policy's
    parts under ``r3.policy``."""
    from rlgen_cli.schema.r3 import is_r3

    if not is_r3(cfg.model):
        return [("model", cfg.model)]
    roles = ("bagel",) if cfg.model.family == "r3_bagel" else ("text", "generator", "editor")
    return [(f"r3.policy.{role}", getattr(cfg.r3.policy, role)) for role in roles]


def reward_problems(cfg: Any, servers: bool = True) -> list[str]:
    """Every reward the run scores with: a served one answers (``servers``), a local one builds (its
    settings are complete) and what its first score will load is there."""
    from rlgen_cli.rewards.registry import REWARDS, build_reward
    from rlgen_cli.rewards.remote import client as remote
    from rlgen_cli.rewards.requirements import missing_requirements
    from rlgen_cli.tasks.common import reward_server_problems, rewards_of

    weights, kwargs, _ = rewards_of(cfg)
    problems = reward_server_problems(cfg) if servers else []
    for name in weights:
        if getattr(REWARDS.get(name), "__module__", None) == remote.__name__:
            continue  # its server was checked above
        try:  # the constructor checks the reward's settings and loads nothing
            reward = build_reward(name, **kwargs.get(name, {}))
        except (UserError, ValueError, OSError, ImportError) as err:
            problems.append(str(err))
            continue
        problems += missing_requirements(reward)
    return problems
