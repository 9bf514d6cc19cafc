"""The single bridge from a verb's extra arguments to ``@hydra.main``.

Hydra reads only ``sys.argv``; the bridge swaps it for the verb's arguments and restores it afterwards,
so every Hydra feature (overrides, ``-m`` sweeps, ``hydra/launcher=…``, ``--cfg``, ``--info``,
``--config-dir``) works unchanged and a second call in the same process (tests) starts clean.

``rlgen train`` with no content choice runs the ShapesEval recipe: :func:`verb_overrides` adds
``experiment=shapes_nft`` there, so ``conf/train.yaml`` itself stays neutral (no time limit, no
evaluation before training, no epoch cap) and nothing of ShapesEval leaks into other compositions.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_USER_ERROR = 2

# Choosing any of these says what to train; a key override (algo.lr=…) or a launcher alone does not.
CONTENT_GROUPS = frozenset({"model", "algo", "reward", "data", "sampler", "experiment"})
# a verb's run when no content group is chosen (`rlgen plan` plans what `rlgen train` runs)
DEFAULT_RUNS = {"train": "experiment=shapes_nft", "plan": "experiment=shapes_nft"}


def conf_dir() -> Path:
    """The packaged ``conf/``: inside the wheel (rlgen_cli/conf) or beside the package in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"rlgen's conf/ directory was not found next to {here}; reinstall rlgen")


def config_groups() -> dict[str, list[str]]:
    """Every config group under ``conf/`` and its options (file stems), for ``rlgen ls`` and ``--help``."""
    root = conf_dir()
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(root.iterdir())
        if group.is_dir()
    }


def chosen_group(arg: str) -> str | None:
    """The config group an override chooses, adds or deletes (``model=flux``, ``+experiment=x``,
    ``~experiment``, ``data@x=y``); None for key overrides (``algo.lr=…``), flags and flag values."""
    if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
        return None
    group = arg.split("=", 1)[0].lstrip("+~").split("@", 1)[0]
    return group if group and "." not in group else None


# Flags and overrides that add config directories: an option may then live outside conf/.
_SEARCH_PATH_ARGS = ("--config-dir", "-cd", "--config-path", "-cp", "hydra.searchpath")
# Sweep values other than a comma list (glob(…), range(…), choice(…)), interpolations, quoting.
_NOT_PLAIN_OPTION = set("()[]{}$'\"")


def unknown_option_error(args: Sequence[str]) -> str | None:
    """What is wrong when an override chooses an option its config group under ``conf/`` lacks
    (``model=flux_dve``), with the closest names; None when every option exists. Hydra's own message
    lists every option of the group; this one names the few that were likely meant."""
    if any(arg.split("=", 1)[0] in _SEARCH_PATH_ARGS for arg in args):
        return None
    groups = config_groups()
    for arg in args:
        group = chosen_group(arg)
        if group not in groups or arg.startswith("~") or "=" not in arg:
            continue
        value = arg.split("=", 1)[1]
        if _NOT_PLAIN_OPTION & set(value):
            continue
        for option in (o.strip() for o in value.split(",")):  # a sweep: model=sd3,flux
            if option and option != "null" and option not in groups[group]:
                return _unknown_option_message(group, option, groups[group])
    return None


def _unknown_option_message(group: str, option: str, options: list[str]) -> str:
    close = difflib.get_close_matches(option, options, n=3, cutoff=0.6)
    guess = f" Did you mean {_either(close)}?" if close else ""
    return (
        f"{group}={option}: config group {group} has no option {option!r}.{guess} "
        f"(rlgen ls {group} lists all {len(options)})"
    )


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


def verb_overrides(config_name: str, args: Sequence[str]) -> list[str]:
    """The overrides Hydra composes for ``rlgen <verb> ARGS``: ``args``, preceded by the verb's default run
    when no argument chooses a content group. Tests compose through this too, so they see what users do."""
    default_run = DEFAULT_RUNS.get(config_name)
    if default_run is None or any(chosen_group(arg) in CONTENT_GROUPS for arg in args):
        return list(args)
    # beside the user's overrides: Hydra's parser takes them as one run of positionals, so one put before
    # a flag (`--cfg job algo.lr=…`) would leave the user's unrecognised
    first = next((i for i, arg in enumerate(args) if _is_override(arg)), len(args))
    return [*args[:first], default_run, *args[first:]]


def _is_override(arg: str) -> bool:
    """A positional Hydra override (``key=value``, ``+key=value``, ``~key``), not a flag or its value."""
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


def compose_verb(config_name: str, args: Sequence[str]) -> Any:
    """The config ``rlgen <verb> ARGS`` runs with (what ``--cfg job`` prints), composed without running."""
    from hydra import compose, initialize_config_dir

    from rlgen_cli.schema.store import register_schemas

    register_schemas(config_name)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name=config_name, overrides=verb_overrides(config_name, args))


def key_overrides(args: Sequence[str]) -> list[str]:
    """The keys that ``args`` set (``algo.lr=…``, ``+x.y=…``), not the config groups they choose."""
    return [
        arg.split("=", 1)[0].lstrip("+")
        for arg in args
        if "=" in arg and not arg.startswith(("-", "~", "hydra")) and chosen_group(arg) is None
    ]


def other_recipes_hint(config_name: str, args: Sequence[str]) -> str | None:
    """After a failed composition of ``rlgen train``: when an override names a setting the run's recipe
    does not have but other recipes do, say which (Hydra's message names only the schema class)."""
    if config_name != "train":
        return None
    from rlgen_cli.schema.recipes import TRAIN_SCHEMAS, declares, recipes_declaring

    keys = key_overrides(args)
    try:
        recipe = compose_verb(
            config_name, [a for a in args if a.split("=", 1)[0].lstrip("+") not in keys]
        ).recipe
    except Exception:  # the choices themselves do not compose: Hydra's message already says why
        return None
    for key in keys:
        others = recipes_declaring(key)
        if others and not declares(TRAIN_SCHEMAS[recipe], key):
            return (
                f"{key} is not a setting of this run's recipe ({recipe}, chosen by its algo/model): only the "
                f"{', '.join(others)} recipe{'s' if len(others) > 1 else ''} read it. Remove the override, or "
                f"choose an algo of {'those recipes' if len(others) > 1 else 'that recipe'} (rlgen ls algo)."
            )
    return None


def shown_config(config_name: str, args: Sequence[str]) -> Any | None:
    """The job config ``--cfg job`` (or ``--cfg all``) printed, composed again to be checked; None when
    ``args`` print none (a run, ``--cfg hydra``, ``--info``, ``--help``) or a sweep (``-m``: one config per
    job). ``run_dir`` (Hydra's output directory, unset when nothing runs) is left null."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    parsed = get_args_parser().parse_args(verb_overrides(config_name, args))
    if parsed.cfg not in ("job", "all") or parsed.multirun:
        return None
    overrides = list(parsed.overrides)
    if parsed.config_dir:  # what --config-dir adds, as the compose API takes it
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(parsed.config_dir)}]")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name=parsed.config_name or config_name, overrides=overrides)
    if "run_dir" in cfg:
        cfg.run_dir = None
    return cfg


def check_shown_config(task: Callable[[Any], Any], config_name: str, args: Sequence[str]) -> None:
    """After ``--cfg job``: the printed config passes the checks a run makes first (ranges, cross-field
    rules), run by the task's ``check_config`` (``tasks/common.py``), which exits 2 naming a bad value."""
    check = getattr(task, "check_config", None)
    if check is None:
        return
    try:
        cfg = shown_config(config_name, args)
    except Exception as err:  # noqa: BLE001  (Hydra printed it; say it went unchecked rather than fail)
        sys.stderr.write(f"note: the printed config was not checked: it did not compose again ({err})\n")
        return
    if cfg is not None:
        check(cfg)


def run_hydra(task: Callable[[Any], Any], config_name: str, args: Sequence[str]) -> Any:
    """Run ``task`` under ``@hydra.main`` with ``args`` as the command line.

    A composition error (unknown key, wrong type, missing option) exits with code 2: Hydra has already
    printed its message, which names the key in full. The task itself turns user errors into exit 2, and
    the config ``--cfg job`` prints is checked as a run would check it (:func:`check_shown_config`).
    """
    import hydra

    from rlgen_cli.schema.store import register_schemas

    typo = unknown_option_error(args)
    if typo:
        sys.stderr.write(typo + "\n")
        raise SystemExit(EXIT_USER_ERROR)
    register_schemas(config_name)
    started = False

    def _task(cfg: Any) -> Any:
        nonlocal started
        started = True
        return task(cfg)

    main = hydra.main(version_base=None, config_path=str(conf_dir()), config_name=config_name)(_task)
    saved_argv = sys.argv
    sys.argv = [f"rlgen {config_name.replace('_', '-')}", *verb_overrides(config_name, args)]
    try:
        result = main()
        if not started:  # Hydra printed a config (or help) instead of running the task
            check_shown_config(task, config_name, args)
        return result
    except SystemExit as exit_:
        if exit_.code == 1 and not started and not os.environ.get("HYDRA_FULL_ERROR"):
            hint = other_recipes_hint(config_name, args)
            if hint:
                sys.stderr.write(hint + "\n")  # after Hydra's own message, on the same stream
            raise SystemExit(EXIT_USER_ERROR) from None
        raise
    finally:
        sys.argv = saved_argv
