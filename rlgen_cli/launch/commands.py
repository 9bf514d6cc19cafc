"""The controller side of a launch: from ``conf/launcher/*`` to an ``accelerate launch`` command line.

The controller composes the config once, writes ``resolved.yaml`` into the run directory and runs
``accelerate launch … -m rlgen_cli.launch.worker RUN_DIR/resolved.yaml``; the workers read that file
and never call Hydra. Engine settings (DeepSpeed ZeRO stages, FSDP) come from packaged accelerate
config files in ``launch/configs/``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from rlgen_cli.schema.errors import UserError
from rlgen_cli.schema.flow import LauncherConfig

CONFIGS = Path(__file__).resolve().parent / "configs"
WORKER_MODULE = "rlgen_cli.launch.worker"
# launchers whose engine is an optional dependency: the package it needs, and how to install it
ENGINE_PACKAGES = {
    "deepspeed_zero2": ("deepspeed", "DS_BUILD_OPS=0 pip install deepspeed"),
    "deepspeed_zero3": ("deepspeed", "DS_BUILD_OPS=0 pip install deepspeed"),
}


def engine_config(name: str) -> Path | None:
    """The packaged accelerate config of launcher ``name`` (None for plain DDP)."""
    path = CONFIGS / f"{name}.yaml"
    return path if path.is_file() else None


def launch_command(launcher: LauncherConfig, resolved: Path) -> list[str]:
    """``accelerate launch`` argv for ``launcher`` running the worker on ``resolved``."""
    main_ip = launcher.main_process_ip or os.environ.get("MASTER_ADDR", "127.0.0.1")
    main_port = launcher.main_process_port or int(os.environ.get("MASTER_PORT", "29500"))
    machine_rank = launcher.machine_rank if launcher.machine_rank is not None else _env_machine_rank()
    argv = [sys.executable, "-m", "accelerate.commands.launch"]
    config = engine_config(launcher.name)
    if config is not None:
        argv += ["--config_file", str(config)]
    total = launcher.num_processes * launcher.num_machines
    if total > 1 and config is None:
        # --multi_gpu also gives N gloo ranks on CPU (--cpu would silently run ONE process)
        argv.append("--multi_gpu")
    elif total == 1 and config is None and not torch.cuda.is_available():
        argv.append("--cpu")
    argv += [
        "--num_processes", str(total), "--num_machines", str(launcher.num_machines),
        "--machine_rank", str(machine_rank), "--main_process_ip", main_ip, "--main_process_port", str(main_port),
        "--mixed_precision", launcher.mixed_precision, "-m", WORKER_MODULE, str(resolved),
    ]  # fmt: skip
    return argv


def _env_machine_rank() -> int:
    """SLURM-friendly: ``SLURM_NODEID`` / ``NODE_RANK`` / ``MACHINE_RANK``, else 0."""
    for key in ("MACHINE_RANK", "NODE_RANK", "SLURM_NODEID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def require_engine(launcher: LauncherConfig) -> None:
    """A clear error, before any worker starts, when the launcher's engine is not installed."""
    package, install = ENGINE_PACKAGES.get(launcher.name, (None, ""))
    if package is not None and importlib.util.find_spec(package) is None:
        raise UserError(f"launcher={launcher.name} needs {package}, which is not installed: {install}")


def run_launch(launcher: LauncherConfig, resolved: Path) -> int:
    """Run the workers and return their exit code (the controller's own exit code follows it)."""
    require_engine(launcher)
    argv = launch_command(launcher, resolved)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        return subprocess.run(argv, env=env, check=False).returncode
    except FileNotFoundError as err:
        raise UserError(
            f"cannot start the workers ({err}); is accelerate installed in this environment?"
        ) from err
