"""Failover under a real crash: one of two servers is SIGKILLed while a client streams batches.

Server A is a separate worker process (``python -m rlgen_cli.server.runner``, what ``server.workers``
starts), so killing it resets its in-flight connections like a crashed GPU worker; server B runs in this
process. Every sample must still be scored exactly, with the retries and failovers counted; once both
are down, scoring fails with a clear error (or counted NaN), never zeros.
"""

from __future__ import annotations

import json
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
from rlgen_cli.rewards.remote import RemoteReward, RemoteRewardError
from tests.server.helpers import http

REWARD = "jpeg_compressibility"
BATCH = 32
KILL_AFTER_REQUESTS = 12  # A has served this many requests when it is killed
BATCHES_AFTER_KILL = 10


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A reward-server worker process on a free port; killed (if still alive) after the test."""
    port = _free_port()
    spec = tmp_path / "worker.json"
    settings = {"port": port, "max_wait_ms": 0, "shutdown_timeout_s": 1}
    spec.write_text(json.dumps({"rewards": {REWARD: {}}, "settings": settings, "log_level": "WARNING"}))
    proc = subprocess.Popen([sys.executable, "-m", "rlgen_cli.server.runner", str(spec)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http("GET", url + "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, f"worker exited with {proc.returncode}"
            assert time.monotonic() < deadline, "worker did not start within 60 s"
            time.sleep(0.1)
        yield proc, url
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _batch(step: int) -> RewardBatch:
    g = torch.Generator().manual_seed(step)
    amplitude = torch.rand(BATCH, 1, 1, 1, generator=g)
    images = (0.5 + amplitude * (torch.rand(BATCH, 3, 16, 16, generator=g) - 0.5)).clamp(0, 1)
    return RewardBatch(prompts=[f"s{step}-{i}" for i in range(BATCH)], images=images)


def _kill_when_busy(client: RemoteReward, proc: subprocess.Popen, url: str, killed: threading.Event) -> None:
    """SIGKILL the worker once it has served ``KILL_AFTER_REQUESTS`` requests of the stream."""
    deadline = time.monotonic() + 60
    while client.stats()["endpoints"][url]["requests"] < KILL_AFTER_REQUESTS and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.kill()
    killed.set()


def test_a_server_killed_mid_stream_loses_no_sample_and_all_down_is_a_clear_error(worker, serve):
    proc, url_a = worker
    local = build_reward(REWARD)
    server_b = serve({REWARD: build_reward(REWARD)})
    urls = [url_a, server_b.url]
    client = RemoteReward(
        REWARD,
        endpoints=urls,
        batch_size=4,
        max_concurrency=4,
        retries=3,
        backoff_s=0.01,
        health_interval_s=60,
    )
    killed = threading.Event()
    killer = threading.Thread(target=_kill_when_busy, args=(client, proc, url_a, killed), daemon=True)
    killer.start()
    steps_before = steps_after = 0
    for step in range(400):
        if killed.is_set():
            steps_after += 1
        else:
            steps_before += 1
        batch = _batch(step)
        result = client.score(batch)
        assert torch.equal(result.scores, local.score(batch).scores), f"batch {step}"
        if steps_after >= BATCHES_AFTER_KILL:
            break
    killer.join(timeout=10)
    assert proc.wait(timeout=10) != 0 and steps_before >= 1 and steps_after >= BATCHES_AFTER_KILL
    stats = client.stats()
    assert stats["connection_errors"] >= 1 and stats["retries"] >= 1 and stats["failovers"] >= 1
    assert stats.get("nan_samples", 0) == 0 and stats.get("failed_samples", 0) == 0
    assert stats["endpoints"][url_a]["healthy"] is False and stats["endpoints"][url_a]["failures"] >= 1
    assert stats["endpoints"][server_b.url]["healthy"] is True
    print(f"\nbefore kill {steps_before} batches, after {steps_after}; stats {stats}")
    assert stats["ok"] == (steps_before + steps_after) * BATCH // 4

    server_b.stop()  # now every server is down
    batch = _batch(999)
    with pytest.raises(RemoteRewardError, match="no score after 4 attempts.*Check that the reward servers"):
        client.score(batch)
    lenient = RemoteReward(REWARD, endpoints=urls, batch_size=8, retries=1, on_failure="nan", backoff_s=0.01)
    scores = lenient.score(batch).scores
    assert torch.isnan(scores).all() and not (scores == 0).any()
    assert lenient.stats()["nan_samples"] == BATCH and lenient.stats()["failed_samples"] == BATCH
