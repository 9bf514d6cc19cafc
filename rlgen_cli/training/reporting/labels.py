"""What a run is called: its overrides, the sweep it belongs to, and what tells runs apart.

Hydra writes every run's command-line overrides to ``RUN_DIR/.hydra/overrides.yaml`` and its mode (a
single run or one job of a ``-m`` sweep) to ``RUN_DIR/.hydra/hydra.yaml``. The W&B run name, the sweep
group, the per-job header and the legends of ``rlgen plot`` are read from there (and, for runs started
without Hydra, from ``resolved.yaml``), so a launched worker names its run exactly as the controller
would.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

HYDRA_DIR = ".hydra"
MAX_NAME = 128  # W&B's limit for run names and groups
MAX_LEGEND_KEYS = 3  # differing resolved.yaml keys shown in a legend when the overrides say nothing
_UNSET = "∅"  # an override one run has and another has not
_BOOKKEEPING = ("run_dir", "resume", "resume_unverified")  # differ between runs, train the same
_WHERE_METRICS_GO = "logging."  # logging.wandb.enabled=true, logging.tensorboard=…: not what trains


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None


def read_resolved(run_dir: Path) -> Any:
    """The run's ``resolved.yaml`` as plain data (None when missing or unreadable)."""
    return _read_yaml(Path(run_dir) / "resolved.yaml")


def run_overrides(run_dir: Path) -> list[str]:
    """The run's command-line overrides without Hydra's own (``hydra.run.dir=…``, ``hydra/launcher=…``);
    empty when the run directory has no ``.hydra/overrides.yaml``."""
    found = _read_yaml(Path(run_dir) / HYDRA_DIR / "overrides.yaml")
    if not isinstance(found, list):
        return []
    return [str(o) for o in found if not str(o).lstrip("+~").startswith(("hydra.", "hydra/"))]


def override_key(override: str) -> str:
    """``+algo.lr=1e-4`` → ``algo.lr``; ``~experiment`` → ``experiment``."""
    return override.split("=", 1)[0].lstrip("+~")


def names_the_run(key: str) -> bool:
    """Whether an override or setting ``key`` says what the run trains: not a logging switch
    (``logging.wandb.enabled``) nor bookkeeping (``resume``), which name nothing a reader compares."""
    return not key.startswith(_WHERE_METRICS_GO) and key.split(".")[-1] not in _BOOKKEEPING


def naming_overrides(run_dir: Path) -> list[str]:
    """:func:`run_overrides` that say what the run trains (:func:`names_the_run`)."""
    return [o for o in run_overrides(run_dir) if names_the_run(override_key(o))]


def run_name(run_dir: Path) -> str:
    """``EXPERIMENT key=value …``: the chosen experiment first, then the other overrides but logging
    switches and bookkeeping (:func:`names_the_run`); the run directory's name when there are none. At most :data:`MAX_NAME` characters."""
    overrides = naming_overrides(run_dir)
    experiment = [o.split("=", 1)[1] for o in overrides if override_key(o) == "experiment" and "=" in o]
    rest = [o for o in overrides if override_key(o) != "experiment"]
    name = " ".join(experiment[-1:] + rest) or Path(run_dir).resolve().name
    return name if len(name) <= MAX_NAME else name[: MAX_NAME - 1] + "…"


def sweep_dir(run_dir: Path) -> Path | None:
    """The sweep directory of a ``-m`` job (the parent of its run directory), None for a single run."""
    hydra = _read_yaml(Path(run_dir) / HYDRA_DIR / "hydra.yaml")
    mode = hydra.get("hydra", {}).get("mode") if isinstance(hydra, dict) else None
    return Path(run_dir).resolve().parent if str(mode).upper() == "MULTIRUN" else None


def sweep_group(run_dir: Path) -> str | None:
    """The W&B group of a sweep job: its sweep directory, relative to the working directory when inside
    it (the tail when longer than :data:`MAX_NAME`); None for a single run."""
    found = sweep_dir(run_dir)
    if found is None:
        return None
    try:
        text = str(found.relative_to(Path(os.getcwd()).resolve()))
    except ValueError:
        text = str(found)
    return text if len(text) <= MAX_NAME else "…" + text[-(MAX_NAME - 1) :]


def differing(settings: Mapping[Any, Mapping[str, str]]) -> dict[Any, list[str]]:
    """Per run, ``key=value`` of each key whose value is not the same in every run (in first-seen key
    order; a key a run lacks shows as ``∅``); empty lists when nothing differs."""
    keys = list(dict.fromkeys(k for values in settings.values() for k in values))
    varying = [k for k in keys if len({values.get(k, _UNSET) for values in settings.values()}) > 1]
    return {run: [f"{k}={values.get(k, _UNSET)}" for k in varying] for run, values in settings.items()}


def _flatten(node: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict):
        out: dict[str, str] = {}
        for key, value in node.items():
            out |= _flatten(value, f"{prefix}{key}.")
        return out
    return {prefix[:-1]: str(node)}


def group_choices(run_dir: Path) -> dict[str, str]:
    """The option each config group of the run composed from (``model`` → ``tiny_sd3``), chosen on the
    command line or by an experiment; Hydra's own groups left out, unset groups (no experiment) too."""
    hydra = _read_yaml(Path(run_dir) / HYDRA_DIR / "hydra.yaml")
    runtime = hydra.get("hydra", {}).get("runtime", {}) if isinstance(hydra, dict) else {}
    choices = runtime.get("choices") if isinstance(runtime, dict) else None
    if not isinstance(choices, dict):
        return {}
    return {str(k): str(v) for k, v in choices.items() if v is not None and not str(k).startswith("hydra")}


def _override_settings(runs: Sequence[Path]) -> dict[Path, dict[str, str]]:
    """Per run, ``key → value`` of every key some run overrides: the run's own override, else what the
    run composed for it (the group option an experiment chose, the resolved value), so a model chosen
    through ``experiment=`` shows as that model and not as unset."""
    overrides = {
        run: {override_key(o): o.split("=", 1)[1] if "=" in o else "deleted" for o in naming_overrides(run)}
        for run in runs
    }
    keys = {key for values in overrides.values() for key in values}
    settings = {}
    for run, values in overrides.items():
        missing = keys - set(values)
        composed = (
            {**_flatten(_read_yaml(run / "resolved.yaml") or {}), **group_choices(run)} if missing else {}
        )
        settings[run] = {**values, **{k: composed[k] for k in sorted(missing) if k in composed}}
    return settings


def legend_labels(run_dirs: Sequence[Path]) -> dict[Path, str]:
    """A legend entry per run: the overrides that differ between the runs (a run without one of them
    shows what it composed instead); else up to :data:`MAX_LEGEND_KEYS` differing keys of their
    ``resolved.yaml``; else the directory name. Runs whose entries would coincide get their directory
    name added."""
    runs = [Path(d) for d in run_dirs]
    if len(runs) < 2:
        return {run: run_name(run) for run in runs}
    labels = differing(_override_settings(runs))
    if not any(labels.values()):
        resolved = {run: _flatten(_read_yaml(run / "resolved.yaml") or {}) for run in runs}
        for values in resolved.values():
            for key in [k for k in values if not names_the_run(k)]:
                del values[key]
        labels = {run: pairs[:MAX_LEGEND_KEYS] for run, pairs in differing(resolved).items()}
    named = {run: " ".join(labels[run]) or run.name for run in runs}
    counts: dict[str, int] = {}
    for label in named.values():
        counts[label] = counts.get(label, 0) + 1
    return {run: label if counts[label] == 1 else f"{label} ({run.name})" for run, label in named.items()}


# -- how a reward reads --------------------------------------------------------------------------------
def reward_names(metrics: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The rewards of the mix that ``metrics`` logged (``[prefix]reward/<name>/mean``)."""
    head = f"{prefix}reward/"
    return [
        key[len(head) : -len("/mean")]
        for key in metrics
        if key.startswith(head) and key.endswith("/mean") and key.count("/") == head.count("/") + 1
    ]


def readable_key(metrics: Mapping[str, Any], prefix: str = "") -> tuple[str, Any] | None:
    """``([prefix]reward/<reward>/<detail>/mean, its ReadableDetail)`` when the run's only reward
    provides a detail that reads better than its score (JPEG compressibility: the size in kB); None
    otherwise (a mix, or a reward without one)."""
    from rlgen_cli.rewards.jpeg import READABLE

    names = reward_names(metrics, prefix)
    if len(names) != 1 or names[0] not in READABLE:
        return None
    readable = READABLE[names[0]]
    key = f"{prefix}reward/{names[0]}/{readable.detail}/mean"
    return (key, readable) if key in metrics else None


def readable_reward(metrics: Mapping[str, Any]) -> str:
    """What follows the rewards on a console line when the run's reward has a readable detail
    (:func:`readable_key`): ``  1.5 kB/img``, ``  1.5 kB/img (eval 1.48)`` when the line holds an
    evaluation, ``  eval 1.48 kB/img`` for an evaluation alone; empty otherwise."""
    train, evaluation = readable_key(metrics), readable_key(metrics, "eval/")
    if train is None and evaluation is None:
        return ""
    unit = (train or evaluation)[1].unit
    if train is None:
        return f"  eval {float(metrics[evaluation[0]]):.3g} {unit}"
    shown = f"  {float(metrics[train[0]]):.3g} {unit}"
    return shown + (f" (eval {float(metrics[evaluation[0]]):.3g})" if evaluation else "")
