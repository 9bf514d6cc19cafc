"""``rlgen serve-reward server.workers=2``: two real worker processes, one per port, each answering
``/healthz`` and scoring; a worker killed with SIGKILL is reported by the parent, which stops the other
and exits non-zero (128 + 9, as a shell reports a SIGKILL)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.remote import RemoteReward
from rlgen_cli.server.runner import exit_status
from tests.server.helpers import http

REWARD = "jpeg_compressibility"
STARTUP_S = 120  # two fresh interpreters importing torch on a loaded 2-core machine


def _two_free_ports() -> int:
    """A port P with P and P + 1 both free on 127.0.0.1 (``server.workers=2`` listens on both)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _answers(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200
    except OSError:
        return False


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


class Group:
    """The ``rlgen serve-reward`` parent process and its collected console output."""

    def __init__(self, port: int) -> None:
        cmd = [
            sys.executable, "-m", "rlgen_cli.cli", "serve-reward", f"reward={REWARD}",
            f"server.port={port}", "server.workers=2", "server.host=127.0.0.1",
        ]  # fmt: skip
        # its own session: the cleanup below reaches the workers too, whatever the test left running
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=os.environ | {"NO_COLOR": "1", "OMP_NUM_THREADS": "1"},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def worker_pids(self) -> dict[int, int]:
        """{port: pid} from the parent's ``worker i: pid N, port P`` lines."""
        found = re.findall(r"worker \d+: pid (\d+), port (\d+)", self.output)
        return {int(port): int(pid) for pid, port in found}

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)


@pytest.fixture
def group() -> Iterator[tuple[Group, int]]:
    port = _two_free_ports()
    started = Group(port)
    try:
        yield started, port
    finally:
        started.close()


def _wait(condition, timeout: float, group: Group, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s; output:\n{group.output}"
        time.sleep(0.1)


def test_two_workers_answer_and_a_killed_one_stops_the_group(group):
    parent, port = group
    ports = [port, port + 1]

    def up_or_dead() -> bool:
        return all(_answers(p) for p in ports) or parent.proc.poll() is not None

    _wait(up_or_dead, STARTUP_S, parent, "both workers answering")
    assert parent.proc.poll() is None, parent.output
    pids = parent.worker_pids()
    assert sorted(pids) == ports and len(set(pids.values())) == 2, parent.output
    assert all(_parent_pid(pid) == parent.proc.pid for pid in pids.values())  # the parent's own children

    images = torch.rand(3, 3, 16, 16)
    batch = RewardBatch(prompts=["a", "b", "c"], images=images)
    expected = build_reward(REWARD).score(batch).scores
    for p in ports:  # each port scores by itself, exactly as the reward does in this process
        assert torch.equal(RemoteReward(REWARD, ports=[p]).score(batch).scores, expected), p

    os.kill(pids[port + 1], signal.SIGKILL)
    assert parent.proc.wait(timeout=60) == 128 + signal.SIGKILL, parent.output
    parent.close()  # every line read
    assert (
        f"worker 1 (pid {pids[port + 1]}, port {port + 1}) was killed by SIGKILL; stopping the other workers"
        in parent.output
    )
    assert f"[pid {pids[port]}]: shutting down: finishing in-flight requests" in parent.output  # gracefully
    assert not any(_answers(p) for p in ports)
    for pid in pids.values():  # no worker left behind: both reaped by the parent
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_exit_status_in_words_and_as_a_shell_code():
    assert exit_status(0) == ("exited with code 0", 0)
    assert exit_status(3) == ("exited with code 3", 3)
    assert exit_status(-signal.SIGKILL) == ("was killed by SIGKILL", 137)
    assert exit_status(-signal.SIGSEGV) == ("was killed by SIGSEGV", 139)
