"""A server-wide budget: requests in flight together hold a bounded amount of memory.

Each request is bounded by itself (``max_request_mb``, ``max_decoded_mb``); these tests check the bound
across requests (``max_inflight_decoded_mb``, ``max_inflight_requests``): 16 concurrent cap-sized requests
to a loopback server keep its peak RSS growth within the budget + 10 % and are all scored correctly;
a request that cannot be admitted in ``admission_wait_s`` gets 503 with ``Retry-After``, and the remote
client's retries (honouring ``Retry-After``) still get every score.
"""

from __future__ import annotations

import gzip
import http.client as httpclient
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest

from rlgen_cli.rewards.remote import wire
from rlgen_cli.rewards.remote.transport import EndpointPool
from rlgen_cli.server.runner import return_large_frees_to_the_os
from tests.server.helpers import MeanReward, constant_images
from tests.server.test_limits import PeakRss

MIB = 1024 * 1024
SIDE = 1182  # one RGB image of 3·1182² = 4.19 MB: just under max_decoded_mb=4
BUDGET_MB = 96  # halves of 48 MiB: five bodies (2 × 4.19 MB each) read, two requests' pixels (5 × 4.19 MB)


def _raw_body(value: int) -> bytes:
    entry = {"shape": [3, SIDE, SIDE], "dtype": "uint8", "data": bytes([value]) * (3 * SIDE * SIDE)}
    return msgpack.packb({"reward": "mean", "images": [entry], "prompts": ["p"]}, use_bin_type=True)


def _score(port: int, body: bytes) -> tuple[int, dict]:
    """POST ``body``; the head and the body are sent apart (``request`` would copy the body into the head
    in this process, and the test measures this process)."""
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.putrequest("POST", "/v1/score")
        conn.putheader("Content-Type", wire.MSGPACK_TYPE)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        conn.send(body)
        response = conn.getresponse()
        data, ctype = response.read(), response.getheader("Content-Type", "")
    finally:
        conn.close()
    return response.status, msgpack.unpackb(data) if "msgpack" in ctype else json.loads(data)


def test_concurrent_cap_sized_requests_stay_within_the_inflight_budget(serve):
    # A reward that takes float pixels: each request holds its body, its parsed copy and a float batch.
    # In this process (the reward is a test double), the request bodies are built before measuring.
    server = serve(
        {"mean": MeanReward()},
        max_decoded_mb=4,
        max_request_mb=8,
        max_inflight_decoded_mb=BUDGET_MB,
        admission_wait_s=120,
    )
    return_large_frees_to_the_os()  # what every server process does at start (rlgen serve-reward)
    values = [10 * i + 5 for i in range(16)]
    bodies = [_raw_body(value) for value in values]
    assert _score(server.port, bodies[0])[0] == 200  # first-use costs (imports, torch) are not a request's
    with PeakRss(os.getpid()) as rss, ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda body: _score(server.port, body), bodies))
    print(f"\n16 concurrent 4 MiB requests: peak RSS +{rss.growth_mb:.1f} MB (budget {BUDGET_MB} MiB)")
    for value, (status, reply) in zip(values, replies):
        assert status == 200, reply
        assert reply["scores"] == pytest.approx([value / 255], abs=1e-6)
    assert rss.growth_mb <= 1.1 * BUDGET_MB * MIB / 1e6


def test_a_request_that_cannot_be_admitted_gets_503_with_retry_after_and_the_client_retries_it(serve):
    reward = MeanReward(sleep_s=0.5)
    server = serve({"mean": reward}, max_inflight_requests=1, admission_wait_s=0.05)
    body, ctype = wire.encode_request(
        "mean", wire.raw_entries(wire.quantize(constant_images([0.2]))), ["p"], binary=True
    )
    # backoffs 0.05, 0.1, 0.2, 0.4 s: all inside a cool-down of health_interval_s, not of Retry-After
    endpoints = EndpointPool([server.url], timeout_s=30, retries=4, backoff_s=0.05, health_interval_s=10)
    conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=30)
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(_post_raw, server.port, body, ctype)  # another client holds the only slot
        while not reward.calls:
            time.sleep(0.001)
        conn.request("POST", "/v1/score", body=body, headers={"Content-Type": ctype})
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 503 and response.getheader("Retry-After") == "1", error
        assert "server.max_inflight_requests=1" in error
        scores, _ = endpoints.request("/v1/score", body, {"Content-Type": ctype}, wire.decode_reply)
        assert busy.result() == 200
    assert endpoints.stats().get("http_5xx", 0) >= 1  # refused while the other request was scored ...
    assert scores == pytest.approx([round(0.2 * 255) / 255], abs=1e-6)  # ... then retried after Retry-After


def _post_raw(port: int, body: bytes, ctype: str) -> int:
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/score", body=body, headers={"Content-Type": ctype})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_a_gzip_msgpack_body_is_read_past_its_declared_length_and_bounded_after_inflating(serve):
    # a msgpack body is read into a buffer of its Content-Length, which counts the compressed bytes
    server = serve({"mean": MeanReward()}, max_request_mb=1)
    entry = {"shape": [3, 8, 8], "dtype": "uint8", "data": bytes([51]) * 192}
    headers = {"Content-Type": wire.MSGPACK_TYPE, "Content-Encoding": "gzip"}
    for n, expected in ((4, 200), (20_000, 413)):  # 20 000 entries inflate to ~4.6 MB from ~17 KB
        body = gzip.compress(msgpack.packb({"reward": "mean", "images": [entry] * n, "prompts": ["p"] * n}))
        conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/score", body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        assert response.status == expected, data[:300]
    assert b"server.max_request_mb" in data
