"""The world size is checked, not assumed: every launched worker compares the processes the launch started
with the ones the composed config asked for, and a mismatch stops the run with exit code 2 naming the
numbers and the file that caused them. A user's CPU accelerate YAML (``distributed_type: MULTI_CPU``,
``use_cpu: true``) really starts its processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlgen_cli.launch import commands
from rlgen_cli.launch.commands import launch_command, launch_env
from rlgen_cli.launch.world import REFUSAL_FILE, world_mismatch
from rlgen_cli.schema.run import LauncherConfig

# what `accelerate config` writes for two CPU processes on one machine
MULTI_CPU = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_machines": 1,
    "num_processes": 2, "mixed_precision": "no", "machine_rank": 0, "use_cpu": True, "debug": False,
}  # fmt: skip


def _cpu_yaml(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump({**MULTI_CPU, **changes}))
    return path


def _two(config_file: Path | None = None) -> LauncherConfig:
    return LauncherConfig(
        name="accelerate", num_processes=2, config_file=None if config_file is None else str(config_file)
    )


# -- the check itself ----------------------------------------------------------------------------------
def test_a_launch_that_agrees_passes(tmp_path: Path):
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert world_mismatch(_two(), env, tmp_path / "resolved.yaml") is None


@pytest.mark.parametrize(
    ("env", "found"),
    [
        ({}, "the launch started 1 process:"),  # what accelerate's simple launcher gives: no WORLD_SIZE
        ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_WORLD_SIZE": "4"}, "the launch started 4 processes"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "this worker got rank 2, outside 0 … 1"),
    ],
)
def test_a_launch_that_differs_names_both_numbers_and_the_file(tmp_path: Path, env: dict, found: str):
    resolved = tmp_path / "resolved.yaml"
    message = world_mismatch(_two(), env, resolved)
    assert message is not None and found in message, message
    assert message.startswith(f"{resolved} asks for 2 processes in all"), message
    path = _cpu_yaml(tmp_path)
    with_file = world_mismatch(_two(path), env, resolved)
    assert with_file is not None and with_file.startswith(f"launcher.config_file={path}"), with_file


# -- a CPU accelerate YAML starts the processes it names -------------------------------------------------
@pytest.mark.parametrize("changes", [{}, {"distributed_type": "MULTI_GPU"}, {"use_cpu": False}])
def test_a_cpu_yaml_is_launched_as_gloo_ranks_on_the_cpu(tmp_path: Path, changes: dict):
    path = _cpu_yaml(tmp_path, **changes)
    argv = launch_command(_two(path), tmp_path / "resolved.yaml")
    assert argv[argv.index("--config_file") + 1] == str(path.resolve())
    assert "--multi_gpu" in argv and argv[argv.index("--num_processes") + 1] == "2"
    assert launch_env(_two(path))["ACCELERATE_USE_CPU"] == "true"


def test_a_gpu_yaml_is_left_to_its_distributed_type(tmp_path: Path):
    path = _cpu_yaml(tmp_path, distributed_type="MULTI_GPU", use_cpu=False)
    argv = launch_command(_two(path), tmp_path / "resolved.yaml")
    assert "--multi_gpu" not in argv and "ACCELERATE_USE_CPU" not in launch_env(_two(path))


# -- real launches -------------------------------------------------------------------------------------
def _resolved(tmp_path: Path, cli, *overrides: str) -> Path:
    """The composed config of a two-process run, as the controller writes it (``--cfg job``: nothing runs)."""
    code, out = cli(
        "train", "--cfg", "job", "--resolve", "launcher=accelerate", "launcher.num_processes=2", *overrides
    )
    assert code == 0, out
    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved.yaml").write_text(out)
    return run / "resolved.yaml"


def test_a_worker_started_alone_refuses_a_two_process_config(cli, tmp_path: Path):
    resolved = _resolved(tmp_path, cli)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-m", "rlgen_cli.launch.worker", str(resolved)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "asks for 2 processes in all" in done.stderr and "the launch started 1 process" in done.stderr
    assert "launch started 1 process" in (resolved.parent / REFUSAL_FILE).read_text()


def _four_process_config(tmp_path: Path, cli) -> Path:
    return _resolved(
        tmp_path, cli, "launcher.num_processes=4", "algo.sample_batch_size=2", "algo.train_batch_size=2"
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_refuses_on_its_own_before_meeting_its_peers(cli, tmp_path: Path, rank: int):
    """Every rank of a two-process launch refuses a four-process config by itself: it needs no peer (none
    is started here, so a rank that tried to form the process group would wait for rank 0 until the
    timeout) and exits 2 with its own line."""
    resolved = _four_process_config(tmp_path, cli)
    launch = {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "rlgen_cli.launch.worker", str(resolved)],
        env={**os.environ, **launch, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    line = f"rlgen worker (rank {rank}): {resolved} asks for 4 processes in all"
    assert line in done.stderr and "the launch started 2 processes" in done.stderr, done.stderr


def test_a_real_wrong_launch_stops_with_the_refusal(cli, tmp_path: Path):
    """Two real gloo ranks for a config that asks for four. The launcher stops the other rank as soon as
    one exits, so how many ranks print their line before that is a race: at least one does, every line
    printed names both numbers, and the launch fails."""
    resolved = _four_process_config(tmp_path, cli)
    argv = launch_command(_two(), resolved)  # the command of a two-process launch, on a four-process config
    done = subprocess.run(
        argv, env={**os.environ, **launch_env(_two())}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    refusals = [line for line in done.stderr.splitlines() if line.startswith("rlgen worker (rank")]
    assert refusals and all("asks for 4 processes" in r and "started 2" in r for r in refusals), done.stderr
    assert "asks for 4 processes" in (resolved.parent / REFUSAL_FILE).read_text()


def test_the_controller_reports_a_refusal_with_exit_2(cli, tmp_path: Path, monkeypatch):
    """The old command for a MULTI_CPU file (no --multi_gpu: accelerate starts ONE process) now stops with
    exit code 2 and the reason, instead of training on one process."""
    path = _cpu_yaml(tmp_path)

    def old_command(launcher, resolved):
        return [a for a in launch_command(launcher, resolved) if a != "--multi_gpu"]

    monkeypatch.setattr(commands, "launch_command", old_command)
    run = tmp_path / "run"
    code, out = cli(
        "train",
        "launcher=accelerate",
        "launcher.num_processes=2",
        f"launcher.config_file={path}",
        f"hydra.run.dir={run}",
    )
    assert code == 2, out
    assert f"launcher.config_file={path}" in out and "the launch started 1 process" in out, out
    assert not (run / "metrics.jsonl").exists() and not (run / REFUSAL_FILE).exists()


@pytest.mark.slow  # ~1 min: a real two-process epoch
def test_a_multi_cpu_yaml_trains_on_two_processes(cli, tmp_path: Path):
    from tests.distributed.test_ddp_equivalence import GEOMETRY

    path = _cpu_yaml(tmp_path)
    run = tmp_path / "run"
    code, out = cli(
        "train",
        *GEOMETRY,
        "launcher=accelerate",
        "launcher.num_processes=2",
        f"launcher.config_file={path}",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    log = (run / "run.log").read_text()
    assert "worker rank 0 of 2 processes" in log, log
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["global_step"] == 2
