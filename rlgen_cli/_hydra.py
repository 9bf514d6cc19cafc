"""The single bridge from a verb's extra arguments to ``@hydra.main``.

Hydra reads only ``sys.argv``; the bridge swaps it for the verb's arguments and restores it afterwards,
so every Hydra feature (overrides, ``-m`` sweeps, ``hydra/launcher=…``, ``--cfg``, ``--info``,
``--config-dir``) works unchanged and a second call in the same process (tests) starts clean.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_USER_ERROR = 2


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


def run_hydra(task: Callable[[Any], Any], config_name: str, args: Sequence[str]) -> Any:
    """Run ``task`` under ``@hydra.main`` with ``args`` as the command line.

    A composition error (unknown key, wrong type, missing option) exits with code 2: Hydra has already
    printed its message, which names the key in full. The task itself turns user errors into exit 2.
    """
    import hydra

    from rlgen_cli.schema.store import register_schemas

    register_schemas()
    started = False

    def _task(cfg: Any) -> Any:
        nonlocal started
        started = True
        return task(cfg)

    main = hydra.main(version_base=None, config_path=str(conf_dir()), config_name=config_name)(_task)
    saved_argv = sys.argv
    sys.argv = [f"rlgen {config_name.replace('_', '-')}", *args]
    try:
        return main()
    except SystemExit as exit_:
        if exit_.code == 1 and not started and not os.environ.get("HYDRA_FULL_ERROR"):
            raise SystemExit(EXIT_USER_ERROR) from None
        raise
    finally:
        sys.argv = saved_argv
