"""Reward fingerprints: a server publishes what its rewards compute, and a client balancing over several
endpoints refuses to mix scores of one reward name hosted with other settings."""

from __future__ import annotations

import re

import pytest
import torch
from aiohttp import web

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.remote import FlowGrpoRemoteReward, RemoteReward, RequestRefusedError
from rlgen_cli.rewards.remote.transport import FingerprintMismatchError
from rlgen_cli.rewards.remote.wire import FINGERPRINT_HEADER
from rlgen_cli.server.fingerprint import fingerprint
from rlgen_cli.server.runner import BackgroundServer
from tests.server.helpers import http

REWARD = "jpeg_compressibility"


def _batch(n: int = 8) -> RewardBatch:
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)).repeat(n, 1, 1, 1)
    return RewardBatch(prompts=["p"] * n, images=images)


class _Scaled:
    """A reward's settings: where it runs (device) and what it computes (scale)."""

    name = "scaled"

    def __init__(self, device: str, scale: float = 2.0) -> None:
        self.device, self.scale = device, scale


def test_rewards_and_replies_carry_the_fingerprint_of_the_settings(serve):
    server = serve({REWARD: build_reward(REWARD, quality=5)})
    status, listing = http("GET", server.url + "/v1/rewards")
    (entry,) = listing["rewards"]
    assert status == 200 and entry["fingerprint"] == fingerprint(REWARD, build_reward(REWARD, quality=5))
    assert entry["config"]["quality"] == 5 and entry["config"]["class"].endswith("JpegReward")
    assert re.fullmatch(rf"{REWARD}:[0-9a-f]{{16}}:rlgen-\S+", entry["fingerprint"])
    assert fingerprint(REWARD, build_reward(REWARD, quality=95)) != entry["fingerprint"]
    on = {device: fingerprint("scaled", _Scaled(device)) for device in ("cpu", "cuda:1")}
    assert on["cpu"] == on["cuda:1"] != fingerprint("scaled", _Scaled("cpu", scale=3.0))  # where ≠ what

    client = RemoteReward(REWARD, endpoints=server.url, retries=0)
    client.score(_batch(2))
    assert client.stats()["pinned"] == entry["fingerprint"]  # from the reply's header


def test_endpoints_hosting_one_reward_with_other_settings_are_refused_naming_both(serve):
    servers = [serve({REWARD: build_reward(REWARD, quality=q)}) for q in (95, 5)]
    prints = [http("GET", s.url + "/v1/rewards")[1]["rewards"][0]["fingerprint"] for s in servers]
    urls = [s.url for s in servers]
    client = RemoteReward(REWARD, endpoints=urls, batch_size=1, max_concurrency=2, on_failure="nan")
    with pytest.raises(FingerprintMismatchError, match="host this reward with other settings") as refused:
        client.score(_batch())  # on_failure="nan" cannot hide it: a RequestRefusedError
    message = str(refused.value)
    assert all(url in message for url in urls) and all(repr(p) in message for p in prints)
    assert client.stats()["fingerprint_mismatches"] >= 1
    assert issubclass(FingerprintMismatchError, RequestRefusedError)

    same = [serve({REWARD: build_reward(REWARD, quality=5)}) for _ in range(2)]
    balanced = RemoteReward(REWARD, endpoints=[s.url for s in same], batch_size=1, max_concurrency=2)
    scores = balanced.score(_batch()).scores
    assert (
        torch.equal(scores, scores[:1].expand(8)) and balanced.stats().get("fingerprint_mismatches", 0) == 0
    )


def test_an_endpoint_without_a_fingerprint_beside_one_with_is_refused(serve):
    """A server that sends none (not rlgen, or an older one) cannot be told apart from a misconfigured one."""

    async def score(_request: web.Request) -> web.Response:
        return web.json_response({"scores": [0.0], "details": {}})

    app = web.Application()
    app.router.add_post("/v1/score", score)
    app.router.add_get("/healthz", score)
    real = serve({REWARD: build_reward(REWARD)})
    with BackgroundServer(app) as foreign:
        client = RemoteReward(REWARD, endpoints=[real.url, foreign.url], batch_size=1, max_concurrency=1)
        with pytest.raises(
            FingerprintMismatchError, match=r"serves none \(not an rlgen server, or an older one\)"
        ):
            client.score(_batch(4))


def test_the_flowgrpo_client_pins_the_fingerprint_too(serve):
    servers = [serve({REWARD: build_reward(REWARD, quality=q)}, flowgrpo_protocol=True) for q in (95, 5)]
    client = FlowGrpoRemoteReward(
        endpoints=[s.url for s in servers], allow_pickle=True, batch_size=1, retries=0
    )
    with pytest.raises(FingerprintMismatchError, match=FINGERPRINT_HEADER):
        client.score(_batch(4))
