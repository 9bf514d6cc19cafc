"""The controller side of a launch: from ``conf/launcher/*`` to an ``accelerate launch`` command line.

The controller composes the config once, writes ``resolved.yaml`` into the run directory and runs
``accelerate launch … -m rlgen_cli.launch.worker RUN_DIR/resolved.yaml``; the workers read that file
and never call Hydra. Engine settings (DeepSpeed ZeRO stages, FSDP) come from packaged accelerate
config files in ``launch/configs/``.

Your own file, ``launcher.config_file=PATH`` (with launcher=accelerate or multinode), goes to
``accelerate launch`` as it would by hand: an accelerate config (YAML, or JSON with ``distributed_type``)
as ``--config_file``, a DeepSpeed config (any other JSON) as ``--use_deepspeed --deepspeed_config_file``.
rlgen's launcher settings stay in charge and are passed as flags; where the file sets the same thing
differently the run stops before any worker starts, exit code 2, naming both values (nothing is
overridden silently):

* process count: the file's ``num_processes`` (accelerate counts all machines) against
  ``launcher.num_processes × launcher.num_machines``; also ``num_machines`` and ``mixed_precision``;
* ``machine_rank``, ``main_process_ip``, ``main_process_port``: compared only when launcher.* sets them;
  otherwise the file's values are used (before MASTER_ADDR / MASTER_PORT / the machine-rank variables);
* ``distributed_type: MULTI_CPU`` (or ``use_cpu: true``) over several processes: accelerate would start
  ONE process for it (MULTI_CPU needs mpirun), so rlgen launches the workers as it does on CPUs without a
  file — N gloo ranks through ``--multi_gpu`` — and keeps them on the CPU (``ACCELERATE_USE_CPU``);
* DeepSpeed settings rlgen owns: ``gradient_accumulation_steps`` must be 1 or ``auto`` (rlgen accumulates
  itself), ``train_micro_batch_size_per_gpu`` must equal ``algo.train_batch_size``,
  ``gradient_clipping`` ``algo.max_grad_norm``, ``fp16``/``bf16`` ``launcher.mixed_precision``; the
  optimizer and its schedule are rlgen's (no ``optimizer`` / ``scheduler`` sections). The same checks
  cover a DeepSpeed JSON, the one an accelerate config names (``deepspeed_config.deepspeed_config_file``)
  and the DeepSpeed keys of an accelerate config's own ``deepspeed_config`` section
  (``gradient_accumulation_steps``, ``gradient_clipping``);
* an engine (DeepSpeed, FSDP) reduces the gradients itself: ``launcher.exact_reduction=true`` is refused
  with such a file, and its default (null) resolves to off.

fp16 (``launcher.mixed_precision=fp16``) on CPUs is refused before any worker starts: accelerate has no
fp16 autocast there and would run fp32.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlgen_cli.errors import UserError
from rlgen_cli.launch.world import clear_refusal, read_refusal
from rlgen_cli.schema.run import LauncherConfig, launch_file_engine, read_launch_settings

CONFIGS = Path(__file__).resolve().parent / "configs"
WORKER_MODULE = "rlgen_cli.launch.worker"
# launchers whose engine is an optional dependency: the package it needs, and how to install it
ENGINE_PACKAGES = {
    "deepspeed_zero2": ("deepspeed", "DS_BUILD_OPS=0 pip install deepspeed"),
    "deepspeed_zero3": ("deepspeed", "DS_BUILD_OPS=0 pip install deepspeed"),
}
# the keys of an accelerate config's ``deepspeed_config`` section that accelerate hands to DeepSpeed as
# DeepSpeed's own settings of the same name (the others choose the ZeRO stage, offloading, …)
INLINE_DEEPSPEED_KEYS = ("gradient_accumulation_steps", "gradient_clipping")


def engine_config(name: str) -> Path | None:
    """The packaged accelerate config of launcher ``name`` (None for plain DDP)."""
    path = CONFIGS / f"{name}.yaml"
    return path if path.is_file() else None


@dataclass(frozen=True)
class LaunchFile:
    """A user's ``launcher.config_file``: an accelerate config or a DeepSpeed config, as read."""

    path: Path
    kind: str  # "accelerate" | "deepspeed"
    settings: dict[str, Any]

    @property
    def deepspeed(self) -> dict[str, Any] | None:
        """The DeepSpeed settings it carries: the whole DeepSpeed JSON, the JSON an accelerate config names
        (``deepspeed_config.deepspeed_config_file``), or None."""
        if self.kind == "deepspeed":
            return self.settings
        nested = self._deepspeed_section.get("deepspeed_config_file")
        return None if nested is None else read_launch_file(str(nested)).settings

    @property
    def inline_deepspeed(self) -> dict[str, Any]:
        """The DeepSpeed settings an accelerate config sets in its own ``deepspeed_config`` section
        (:data:`INLINE_DEEPSPEED_KEYS`), which accelerate passes on to DeepSpeed; empty for none."""
        section = self._deepspeed_section
        return {key: section[key] for key in INLINE_DEEPSPEED_KEYS if section.get(key) is not None}

    @property
    def _deepspeed_section(self) -> dict[str, Any]:
        section = self.settings.get("deepspeed_config") if self.kind == "accelerate" else None
        return section if isinstance(section, dict) else {}

    @property
    def wants_cpu(self) -> bool:
        """An accelerate config asking for CPU processes (``distributed_type: MULTI_CPU`` or ``use_cpu``)."""
        return self.kind == "accelerate" and (
            str(self.settings.get("distributed_type", "")).upper() == "MULTI_CPU"
            or self.settings.get("use_cpu") is True
        )

    @property
    def engine(self) -> str | None:
        """``deepspeed`` / ``fsdp`` when the file turns that engine on, else None."""
        return launch_file_engine(self.kind, self.settings)

    @property
    def uses_deepspeed(self) -> bool:
        return self.engine == "deepspeed"


def read_launch_file(spec: str) -> LaunchFile:
    """Read ``launcher.config_file``: JSON with ``distributed_type`` / ``compute_environment`` or YAML is an
    accelerate config, any other JSON a DeepSpeed config (``schema/run.py``: :func:`read_launch_settings`).

    Raises:
        UserError: The file is missing, unparsable or not a mapping.
    """
    return LaunchFile(*read_launch_settings(spec))


def launch_file_conflicts(
    launcher: LauncherConfig, file: LaunchFile, algo: dict[str, Any] | None = None
) -> list[str]:
    """Every setting ``file`` gives a value that differs from rlgen's, one sentence each naming both values
    and the fix (empty when they agree). ``algo``: the run's ``algo`` section, for the DeepSpeed checks."""
    name = f"launcher.config_file ({file.path.name})"
    found: list[str] = []
    if file.kind == "accelerate":
        wanted = {
            "num_processes": (launcher.world_size, "launcher.num_processes × launcher.num_machines"),
            "num_machines": (launcher.num_machines, "launcher.num_machines"),
            "mixed_precision": (launcher.mixed_precision, "launcher.mixed_precision"),
            "machine_rank": (launcher.machine_rank, "launcher.machine_rank"),
            "main_process_ip": (launcher.main_process_ip, "launcher.main_process_ip"),
            "main_process_port": (launcher.main_process_port, "launcher.main_process_port"),
        }
        for key, (ours, our_key) in wanted.items():
            theirs = file.settings.get(key)
            if key == "mixed_precision" and (theirs is False or theirs == "no"):
                theirs = "fp32"  # accelerate's word for it ("no"; unquoted in YAML, the boolean false)
            if theirs is not None and ours is not None and str(theirs) != str(ours):
                found.append(
                    f"{name} sets {key}: {theirs} but {our_key} is {ours}: {_agree(key, theirs, launcher)}"
                )
    if file.deepspeed is not None:
        found += _deepspeed_conflicts(name, file.deepspeed, launcher, algo or {})
    if file.inline_deepspeed:
        found += _deepspeed_conflicts(
            f"{name} deepspeed_config", file.inline_deepspeed, launcher, algo or {}, inline=True
        )
    if launcher.exact_reduction is True and file.engine is not None:
        found.append(
            f"{name} runs {file.engine}, which reduces the gradients inside its engine, and "
            "launcher.exact_reduction=true needs them in rlgen's hands: pass launcher.exact_reduction=false "
            "(or leave it unset), or drop the engine from the file"
        )
    return found


def _agree(key: str, theirs: Any, launcher: LauncherConfig) -> str:
    """How to make launcher.* agree with the file's ``key``, or drop it from the file."""
    if key == "num_processes":
        per_machine = int(theirs) / launcher.num_machines
        fix = (
            f"pass launcher.num_processes={int(per_machine)}"
            if per_machine.is_integer()
            else f"make launcher.num_processes × launcher.num_machines = {theirs}"
        )
        return (
            f"{fix} (accelerate counts the processes of all machines) or remove num_processes from the file"
        )
    return f"pass launcher.{key}={theirs} or remove {key} from the file"


def _deepspeed_conflicts(
    name: str, ds: dict[str, Any], launcher: LauncherConfig, algo: dict[str, Any], inline: bool = False
) -> list[str]:
    """The DeepSpeed settings rlgen sets itself, where ``ds`` gives them another value. ``inline``: ``ds``
    is an accelerate config's ``deepspeed_config`` section (where the fix is to remove the key)."""
    let_rlgen = "remove it from deepspeed_config" if inline else 'set it to "auto"'
    found = [
        f'{name} has a DeepSpeed "{section}" section: rlgen builds the optimizer (AdamW from algo.lr, '
        f"algo.weight_decay, …) and its learning-rate schedule; remove the section"
        for section in ("optimizer", "scheduler")
        if section in ds
    ]
    accumulation = ds.get("gradient_accumulation_steps")
    if accumulation not in (None, "auto", 1):
        found.append(
            f"{name} sets gradient_accumulation_steps: {accumulation}; rlgen accumulates micro-batches itself "
            "(algo.gradient_accumulation_steps): "
            + (
                "set it to 1 or remove it from deepspeed_config"
                if inline
                else 'set it to 1 or "auto" in the file'
            )
        )
    micro = algo.get("train_batch_size")
    numeric = {  # DeepSpeed key → (rlgen's value, rlgen's key)
        "train_micro_batch_size_per_gpu": (micro, "algo.train_batch_size"),
        "train_batch_size": (
            None if micro is None else micro * launcher.world_size,
            "algo.train_batch_size × processes",
        ),
        "gradient_clipping": (
            None if algo.get("max_grad_norm") is None else max(float(algo["max_grad_norm"]), 0.0),
            "algo.max_grad_norm",
        ),
    }
    for key, (ours, our_key) in numeric.items():
        theirs = ds.get(key)
        if theirs in (None, "auto") or ours is None:
            continue
        if not _is_number(theirs) or not math.isclose(float(theirs), float(ours)):
            found.append(
                f"{name} sets {key}: {theirs} but {our_key} is {ours}: {let_rlgen} (rlgen fills it) "
                f"or pass {our_key.split(' ')[0]}=…"
            )
    for precision in ("fp16", "bf16"):
        enabled = (ds.get(precision) or {}).get("enabled")
        chosen = launcher.mixed_precision == precision
        if enabled in (True, False) and enabled != chosen:
            found.append(
                f"{name} sets {precision}.enabled: {str(enabled).lower()} but launcher.mixed_precision is "
                f'{launcher.mixed_precision}: set it to "auto" or pass launcher.mixed_precision='
                f"{precision if enabled else 'fp32'}"
            )
    return found


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool)


def launch_command(launcher: LauncherConfig, resolved: Path) -> list[str]:
    """``accelerate launch`` argv for ``launcher`` running the worker on ``resolved``."""
    user = read_launch_file(launcher.config_file) if launcher.config_file else None
    from_file = set() if user is None or user.kind != "accelerate" else set(user.settings)
    # accelerate launch, without its traceback when a worker refused (the refusal says why)
    argv = [sys.executable, "-m", "rlgen_cli.launch.accelerate_quietly"]
    config = engine_config(launcher.name)
    if user is not None and user.kind == "deepspeed":
        argv += ["--use_deepspeed", "--deepspeed_config_file", str(user.path)]
    elif user is not None:
        argv += ["--config_file", str(user.path)]
    elif config is not None:
        argv += ["--config_file", str(config)]
    total = launcher.world_size
    if total > 1 and config is None and (user is None or user.wants_cpu):
        # --multi_gpu also gives N gloo ranks on CPU (--cpu, and a file's MULTI_CPU without mpirun, would
        # silently run ONE process)
        argv.append("--multi_gpu")
    elif total == 1 and config is None and user is None and not torch.cuda.is_available():
        argv.append("--cpu")
    argv += ["--num_processes", str(total), "--num_machines", str(launcher.num_machines)]
    # launcher.* when set, else the file's value, else the environment's
    if launcher.machine_rank is not None or "machine_rank" not in from_file:
        rank = launcher.machine_rank if launcher.machine_rank is not None else _env_machine_rank()
        argv += ["--machine_rank", str(rank)]
    if launcher.main_process_ip is not None or "main_process_ip" not in from_file:
        argv += ["--main_process_ip", launcher.main_process_ip or os.environ.get("MASTER_ADDR", "127.0.0.1")]
    if launcher.main_process_port is not None or "main_process_port" not in from_file:
        port = launcher.main_process_port or int(os.environ.get("MASTER_PORT", "29500"))
        argv += ["--main_process_port", str(port)]
    argv += ["--mixed_precision", launcher.accelerate_mixed_precision, "-m", WORKER_MODULE, str(resolved)]
    return argv


def launch_env(launcher: LauncherConfig) -> dict[str, str]:
    """What the workers' environment gets on top of the controller's: one CPU thread each unless the
    caller set ``OMP_NUM_THREADS``, and CPU devices when the user's accelerate file asks for them."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    user = read_launch_file(launcher.config_file) if launcher.config_file else None
    if user is not None and user.wants_cpu:
        env["ACCELERATE_USE_CPU"] = "true"  # what accelerate's own --cpu would export
    return env


def _env_machine_rank() -> int:
    """SLURM-friendly: ``SLURM_NODEID`` / ``NODE_RANK`` / ``MACHINE_RANK``, else 0."""
    for key in ("MACHINE_RANK", "NODE_RANK", "SLURM_NODEID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def require_engine(launcher: LauncherConfig, user: LaunchFile | None = None) -> None:
    """A clear error, before any worker starts, when the launcher's engine (or that of the user's launch
    file) is not installed."""
    package, install = ENGINE_PACKAGES.get(launcher.name, (None, ""))
    if user is not None and user.uses_deepspeed:
        package, install = ENGINE_PACKAGES["deepspeed_zero2"]
    if package is not None and importlib.util.find_spec(package) is None:
        via = (
            f"launcher.config_file={launcher.config_file}"
            if user is not None
            else f"launcher={launcher.name}"
        )
        raise UserError(f"{via} needs {package}, which is not installed: {install}")


def check_launch_file(launcher: LauncherConfig, resolved: Path) -> LaunchFile | None:
    """The user's launch file, read and reconciled with the run's config (``resolved``); None without one.

    Raises:
        UserError: Listing every setting the file gives another value than rlgen's (exit code 2).
    """
    if not launcher.config_file:
        return None
    from omegaconf import OmegaConf

    user = read_launch_file(launcher.config_file)
    algo = OmegaConf.to_container(OmegaConf.load(resolved).get("algo") or {}, resolve=True)
    conflicts = launch_file_conflicts(launcher, user, algo)
    if conflicts:
        raise UserError("the launch file disagrees with rlgen's settings:\n  " + "\n  ".join(conflicts))
    return user


def require_autocast_here(launcher: LauncherConfig, resolved: Path, user: LaunchFile | None) -> None:
    """Before any worker starts: fp16 is refused where the workers would run on CPUs (``device: cpu`` in
    ``resolved``, no CUDA here, or a user's file asking for CPU processes), as each worker would refuse it."""
    if launcher.mixed_precision != "fp16":
        return
    from omegaconf import OmegaConf

    from rlgen_cli.training.distributed.dist import require_autocast_device

    device = str(OmegaConf.load(resolved).get("device", "auto"))
    cpu = device == "cpu" or not torch.cuda.is_available() or (user is not None and user.wants_cpu)
    require_autocast_device(launcher.mixed_precision, cpu)


def run_launch(launcher: LauncherConfig, resolved: Path) -> int:
    """Run the workers and return their exit code (the controller's own exit code follows it)."""
    user = check_launch_file(launcher, resolved)
    require_autocast_here(launcher, resolved, user)
    require_engine(launcher, user)
    argv = launch_command(launcher, resolved)
    clear_refusal(resolved.parent)
    try:
        code = subprocess.run(argv, env={**os.environ, **launch_env(launcher)}, check=False).returncode
    except FileNotFoundError as err:
        raise UserError(
            f"cannot start the workers ({err}); is accelerate installed in this environment?"
        ) from err
    refusal = read_refusal(resolved.parent)  # a worker's exit code 2 arrives as accelerate's 1
    if code != 0 and refusal is not None:
        raise UserError(refusal)
    return code
