"""``launcher=multinode``: two "nodes" of one process each on loopback (two launches, machine_rank 0 and 1,
rendezvous at 127.0.0.1:free port, one shared run directory) give the same rewards, statistics and final
weights as one node with two processes (1×2 ≡ 2×1)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlgen_cli.launch.commands import launch_command
from rlgen_cli.schema.run import LauncherConfig
from tests.distributed.test_ddp_equivalence import GEOMETRY, _metrics, _weights

NODE_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _node(run: Path, rank: int, port: int) -> subprocess.Popen:
    """One node's ``rlgen train``: its own controller, which launches its one worker."""
    argv = [
        sys.executable, "-m", "rlgen_cli.cli", "train", "experiment=tiny_cpu", *GEOMETRY, "launcher=multinode",
        "launcher.num_processes=1", "launcher.num_machines=2", f"launcher.machine_rank={rank}",
        "launcher.main_process_ip=127.0.0.1", f"launcher.main_process_port={port}", f"hydra.run.dir={run}",
    ]  # fmt: skip
    # its own session, so a failed test can stop the node's launcher and worker together
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


@pytest.mark.slow  # three launches of two processes each: ~1-2 min on two cores
def test_two_nodes_of_one_process_equal_one_node_of_two(cli, tmp_path: Path):
    one_node, two_nodes = tmp_path / "1x2", tmp_path / "2x1"
    code, out = cli(
        "train", *GEOMETRY, "launcher=accelerate", "launcher.num_processes=2", f"hydra.run.dir={one_node}"
    )
    assert code == 0, out

    port = _free_port()
    nodes = [_node(two_nodes, rank, port) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=NODE_TIMEOUT_S)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for rank, (node, out) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank}:\n{out}"

    a, b = _metrics(one_node), _metrics(two_nodes)
    assert b["num_groups"] == 2 and b["trained_samples"] == 8  # both nodes' samples were gathered
    for key in ("reward/mean", "reward/std", "zero_std_ratio", "trained_samples", "policy_loss", "grad_norm"):
        assert a[key] == b[key], key
    wa, wb = _weights(one_node), _weights(two_nodes)
    assert wa.keys() == wb.keys() and len(wa) > 0
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=0)


# -- the command each node runs, without processes ----------------------------------------------------
def test_multinode_command_counts_every_machines_processes(tmp_path: Path):
    launcher = LauncherConfig(
        name="multinode",
        num_processes=4,
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=1234,
    )
    argv = launch_command(launcher, tmp_path / "resolved.yaml")

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag("--num_processes"), flag("--num_machines"), flag("--machine_rank")) == ("8", "2", "1")
    assert (flag("--main_process_ip"), flag("--main_process_port")) == ("10.0.0.1", "1234")
    assert "--multi_gpu" in argv and "--config_file" not in argv
    assert argv[-2:] == ["rlgen_cli.launch.worker", str(tmp_path / "resolved.yaml")]


@pytest.mark.parametrize("variable", ["MACHINE_RANK", "NODE_RANK", "SLURM_NODEID"])
def test_multinode_rank_and_address_come_from_the_environment(monkeypatch, tmp_path: Path, variable: str):
    for name in ("MACHINE_RANK", "NODE_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "3")
    monkeypatch.setenv("MASTER_ADDR", "node-0")
    monkeypatch.setenv("MASTER_PORT", "29600")
    argv = launch_command(
        LauncherConfig(name="multinode", num_processes=1, num_machines=4), tmp_path / "r.yaml"
    )
    assert argv[argv.index("--machine_rank") + 1] == "3"
    assert argv[argv.index("--main_process_ip") + 1] == "node-0"
    assert argv[argv.index("--main_process_port") + 1] == "29600"
