"""Load on a real loopback server: thousands of ``jpeg_compressibility`` requests at concurrency 16.

Every score must come back, in order, equal to the in-process score of the same image (the wire is PNG,
lossless after the uint8 quantisation the JPEG reward applies anyway). The default run sends 2000 requests
(two images each); ``test_load_many`` (slow) sends 10 000.
"""

from __future__ import annotations

import time

import pytest
import torch

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.remote import RemoteReward
from tests.server.helpers import http, metric

CONCURRENCY = 16
IMAGES_PER_REQUEST = 2


def _images(n: int, size: int = 24, seed: int = 0) -> torch.Tensor:
    """``n`` small images whose JPEG sizes differ from their neighbours': noise of shuffled amplitude."""
    g = torch.Generator().manual_seed(seed)
    amplitude = torch.linspace(0.0, 1.0, n)[torch.randperm(n, generator=g)].view(n, 1, 1, 1)
    grey = torch.rand(n, 1, 1, 1, generator=g)
    return (grey + amplitude * (torch.rand(n, 3, size, size, generator=g) - 0.5)).clamp(0, 1)


def _run_load(serve, n_requests: int, budget_s: float) -> None:
    local = build_reward("jpeg_compressibility")
    server = serve({"jpeg_compressibility": local}, max_wait_ms=2, max_batch=64)
    client = RemoteReward(
        "jpeg_compressibility",
        endpoints=[server.url],
        batch_size=IMAGES_PER_REQUEST,
        max_concurrency=CONCURRENCY,
        retries=0,
    )
    n = n_requests * IMAGES_PER_REQUEST
    batch = RewardBatch(prompts=[f"p{i}" for i in range(n)], images=_images(n))
    expected = local.score(batch)
    began = time.perf_counter()
    got = client.score(batch)
    elapsed = time.perf_counter() - began

    assert got.scores.shape == (n,) and not torch.isnan(got.scores).any()
    assert torch.equal(got.scores, expected.scores)  # every score, in order, bit-identical
    assert torch.equal(got.details["jpeg_kb"], expected.details["jpeg_kb"])
    neighbours_differ = (expected.scores[1:] != expected.scores[:-1]).float().mean().item()
    assert neighbours_differ > 0.9  # so a reordered or misplaced chunk would show
    stats = client.stats()
    assert stats["requests"] == stats["ok"] == n_requests and stats.get("failures", 0) == 0
    status, text = http("GET", server.url + "/metrics")
    assert status == 200
    assert metric(text, 'rlgen_requests_total{route="/v1/score",status="200"}') == n_requests
    assert metric(text, 'rlgen_images_total{reward="jpeg_compressibility"}') == n
    assert elapsed < budget_s, f"{n_requests} requests took {elapsed:.1f}s"
    print(f"\n{n_requests} requests ({n} images) at concurrency {CONCURRENCY}: {elapsed:.2f}s")


def test_load_2000_requests_at_concurrency_16(serve):
    _run_load(serve, n_requests=2000, budget_s=25)


@pytest.mark.slow
def test_load_many(serve):
    _run_load(serve, n_requests=10_000, budget_s=150)
