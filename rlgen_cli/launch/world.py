"""What a launched worker checks before it runs: that the launch started the processes the config asked for.

``accelerate launch`` decides from its flags and config file how many processes to start, and a setting
it reads differently from rlgen (``distributed_type: MULTI_CPU`` starts ONE process without mpirun)
would otherwise train silently on fewer processes than asked. Every worker compares the world size and
rank the launch gave it (``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE``; none set = one process) with
the composed config (``launcher.num_processes × launcher.num_machines``, which a ``launcher.config_file``'s
``num_processes`` must already equal) and refuses to run on a mismatch. Every rank sees the same launch,
so every rank refuses; the controller then reports the reason with exit code 2
(:func:`write_refusal` / :func:`read_refusal`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rlgen_cli.schema.run import LauncherConfig

REFUSAL_FILE = "worker_refused.txt"
"""In the run directory: why the workers refused to run (read by the controller, then removed)."""


def world_mismatch(launcher: LauncherConfig, env: Mapping[str, str], resolved: Path) -> str | None:
    """Why this worker must not run (the launch's processes differ from what ``resolved`` asked for), or
    None when they agree. ``env``: the worker's environment."""
    started = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    per_machine = int(env.get("LOCAL_WORLD_SIZE", str(launcher.num_processes)))
    asked = launcher.world_size
    if started == asked and 0 <= rank < asked and per_machine == launcher.num_processes:
        return None
    cause = _cause(launcher, resolved)
    if started != asked:
        found = f"the launch started {started} process{'es' if started != 1 else ''}"
    elif not 0 <= rank < asked:
        found = f"this worker got rank {rank}, outside 0 … {asked - 1}"
    else:
        found = f"this machine started {per_machine} processes, not launcher.num_processes={launcher.num_processes}"
    return (
        f"{cause} asks for {asked} process{'es' if asked != 1 else ''} in all (launcher.num_processes="
        f"{launcher.num_processes} × launcher.num_machines={launcher.num_machines}), but {found}: the run "
        f"would train on other processes than the config says. {_fix(launcher)}"
    )


def _cause(launcher: LauncherConfig, resolved: Path) -> str:
    """The file whose settings made the launch: the user's accelerate / DeepSpeed config, else the run's."""
    if launcher.config_file:
        return f"launcher.config_file={launcher.config_file} was launched with {resolved}, which"
    return str(resolved)


def _fix(launcher: LauncherConfig) -> str:
    if launcher.config_file:
        return (
            f"Check distributed_type and num_processes in {launcher.config_file} (accelerate starts one process "
            "for NO, and for MULTI_CPU without mpirun unless rlgen launches it), or drop launcher.config_file"
        )
    return "Start the run with `rlgen train`, which launches launcher.num_processes × launcher.num_machines workers"


def write_refusal(run_dir: Path, message: str) -> None:
    """Leave ``message`` for the controller (every rank writes the same text; the last write wins)."""
    (run_dir / REFUSAL_FILE).write_text(message + "\n", encoding="utf-8")


def read_refusal(run_dir: Path) -> str | None:
    """The workers' refusal of this launch (then removed), or None when they did not refuse."""
    path = run_dir / REFUSAL_FILE
    if not path.is_file():
        return None
    message = path.read_text(encoding="utf-8").strip()
    path.unlink(missing_ok=True)
    return message


def clear_refusal(run_dir: Path) -> None:
    """Forget a refusal left by an earlier launch into the same run directory."""
    (run_dir / REFUSAL_FILE).unlink(missing_ok=True)
