"""The reward server over real HTTP on 127.0.0.1: scores, errors, auth, limits, micro-batching, metrics."""

from __future__ import annotations

import base64
import math
import threading
import time

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.base import RewardResult
from rlgen_cli.rewards.remote import RemoteReward, RequestRefusedError, wire
from rlgen_cli.server.state import STATE
from tests.server.helpers import MeanReward, constant_images, http, metric


def _png_b64(image: torch.Tensor) -> str:
    return wire.image_to_b64(image)


def test_scores_over_http_equal_local_scores(serve):
    jpeg = build_reward("jpeg_compressibility")
    server = serve({"jpeg_compressibility": jpeg})
    images = torch.rand(5, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    batch = RewardBatch(prompts=[f"p{i}" for i in range(5)], images=images)
    local = jpeg.score(batch)
    options = [({}, "raw"), ({"binary": False}, "json"), ({"binary": True}, "msgpack"),
               ({"wire_format": "json"}, "json"), ({"wire_format": "msgpack"}, "msgpack"),
               ({"wire_format": "raw", "binary": False}, "raw")]  # fmt: skip
    for kwargs, fmt in options:
        client = RemoteReward("jpeg_compressibility", endpoints=[server.url], batch_size=2, **kwargs)
        assert client.wire_format == fmt
        remote = client.score(batch)
        assert torch.equal(remote.scores, local.scores), kwargs
        assert torch.allclose(remote.details["jpeg_kb"], local.details["jpeg_kb"])
    with pytest.raises(UserError, match="wire_format='png' is not valid"):
        RemoteReward("jpeg_compressibility", endpoints=[server.url], wire_format="png")


def test_every_wire_format_gives_the_same_scores_for_any_channels_and_sizes(serve):
    server = serve({"mean": MeanReward()})
    grey = RewardBatch(prompts=["a", "b"], images=constant_images([0.2, 0.7], size=6)[:, :1])
    odd = RewardBatch(
        prompts=["c"], images=torch.rand(1, 3, 5, 9, generator=torch.Generator().manual_seed(1))
    )
    for batch in (grey, odd):
        quantised = torch.round(batch.images * 255) / 255
        want = quantised.mean(dim=(1, 2, 3))
        for fmt in ("raw", "msgpack", "json"):
            got = RemoteReward("mean", endpoints=[server.url], wire_format=fmt).score(batch).scores
            assert torch.allclose(got, want, atol=1e-6), (fmt, got, want)


class _ChannelProbe:
    """Score = Σ_c (c + 1)·mean(channel c) + 10·C: any change to the channels handed over shows."""

    name = "probe"

    def score(self, batch: RewardBatch) -> RewardResult:
        images = batch.images.to(torch.float64)
        weights = torch.arange(1, images.shape[1] + 1, dtype=torch.float64)
        scores = (images.mean(dim=(2, 3)) * weights).sum(dim=1) + 10 * images.shape[1]
        return RewardResult(scores=scores.to(torch.float32))


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_every_channel_count_scores_the_same_served_as_in_process(serve, channels):
    probe, jpeg = _ChannelProbe(), build_reward("jpeg_compressibility")
    server = serve({"probe": probe, "jpeg_compressibility": jpeg})
    noise = torch.rand(3, channels, 12, 10, generator=torch.Generator().manual_seed(channels))
    batch = RewardBatch(prompts=["a", "b", "c"], images=torch.round(noise * 255) / 255)
    local_probe = probe.score(batch).scores
    for fmt in ("raw", "msgpack", "json"):
        served = RemoteReward("probe", endpoints=[server.url], wire_format=fmt).score(batch).scores
        assert torch.allclose(served, local_probe, atol=1e-5), (fmt, served, local_probe)
        client = RemoteReward("jpeg_compressibility", endpoints=[server.url], wire_format=fmt)
        if channels in (1, 3):  # the JPEG rewards score grey and RGB images
            assert torch.equal(client.score(batch).scores, jpeg.score(batch).scores), fmt
        else:  # and refuse the others, in-process and served alike
            with pytest.raises(ValueError, match=r"C in \{1, 3\}"):
                jpeg.score(batch)
            with pytest.raises(RequestRefusedError, match=r"422.*C in \{1, 3\}"):
                client.score(batch)


class _DtypeRecorder(MeanReward):
    """MeanReward on pixels in [0, 1] that records the dtype of every batch it gets."""

    def __init__(self, name: str, accepts_uint8: bool):
        super().__init__(name)
        self.accepts_uint8, self.dtypes = accepts_uint8, []

    def score(self, batch: RewardBatch):
        self.dtypes.append(batch.images.dtype)
        images = batch.images / 255.0 if batch.images.dtype == torch.uint8 else batch.images
        return super().score(RewardBatch(batch.prompts, images=images))


def test_uint8_pixels_reach_a_reward_that_accepts_them_unconverted(serve):
    takes_uint8, takes_float = _DtypeRecorder("u8", True), _DtypeRecorder("f32", False)
    server = serve({"u8": takes_uint8, "f32": takes_float})
    batch = RewardBatch(prompts=["a", "b"], images=constant_images([0.2, 0.6]))
    for fmt in ("raw", "msgpack", "json"):
        scores = {
            name: RemoteReward(name, endpoints=[server.url], wire_format=fmt).score(batch).scores
            for name in ("u8", "f32")
        }
        assert torch.allclose(scores["u8"], scores["f32"]) and torch.allclose(
            scores["u8"], torch.tensor([0.2, 0.6])
        )
    assert takes_uint8.dtypes == [torch.uint8] * 3
    assert takes_float.dtypes == [torch.float32] * 3


def test_rewards_healthz_and_mixed_sizes(serve):
    server = serve({"mean": MeanReward()})
    status, body = http("GET", server.url + "/healthz")
    assert status == 200 and body["status"] == "ok"
    status, body = http("GET", server.url + "/v1/rewards")
    assert [r["name"] for r in body["rewards"]] == ["mean"] and "raw" in body["wire_formats"]
    assert body["rewards"][0]["meta"]["class"].endswith("MeanReward") and body["limits"]["max_batch"] == 64
    images = [_png_b64(torch.full((3, 8, 8), 0.2)), _png_b64(torch.full((3, 16, 4), 0.6))]
    status, body = http(
        "POST", server.url + "/v1/score", {"reward": "mean", "images": images, "prompts": ["a", "b"]}
    )
    assert status == 200
    assert [round(s, 2) for s in body["scores"]] == [0.2, 0.6] and body["details"]["tag"] == ["a", "b"]


def test_json_errors_name_the_problem(serve):
    server = serve({"mean": MeanReward()})
    url, good = server.url + "/v1/score", _png_b64(torch.zeros(3, 4, 4))
    cases = [
        ({"reward": "nope", "images": [good], "prompts": ["a"]}, 404, "hosts: mean"),
        ({"reward": "mean", "images": [good, "!!not-base64!!"], "prompts": ["a", "b"]}, 400, "images[1] is not valid base64"),
        ({"reward": "mean", "images": [good, base64.b64encode(b"hello").decode()], "prompts": ["a", "b"]}, 415, "images[1] is not a PNG or JPEG file (it starts with b'hello')"),
        ({"reward": "mean", "images": [good, _png_b64(torch.zeros(3, 4, 4))[:-40]], "prompts": ["a", "b"]}, 400, "images[1] could not be decoded as PNG"),
        ({"reward": "mean", "images": [good, good], "prompts": ["a"]}, 400, "images has 2 entries but prompts has 1"),
        ({"reward": "mean", "images": [good], "prompts": ["a"], "metadata": [{}, {}]}, 400, "metadata has 2"),
        ({"images": [good], "prompts": ["a"]}, 400, "missing field 'reward'"),
        ({"reward": "mean", "images": [good], "prompts": [3]}, 400, "prompts[0]"),
    ]  # fmt: skip
    for payload, status, fragment in cases:
        got_status, body = http("POST", url, payload)
        assert (got_status, fragment in body["error"]) == (status, True), (payload, body)
    status, body = http("POST", url, b"{not json", {"Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in body["error"]
    status, body = http("GET", server.url + "/nowhere")
    assert status == 404 and "error" in body


def test_size_limits_and_auth(serve):
    server = serve({"mean": MeanReward()}, max_request_mb=0.01, max_image_pixels=100, token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    noise = _png_b64(torch.rand(3, 64, 64))  # ≈ 16 kB of PNG: above 0.01 MiB
    status, body = http(
        "POST", server.url + "/v1/score", {"reward": "mean", "images": [noise], "prompts": ["a"]}, auth
    )
    assert status == 413 and "max_request_mb" in body["error"]
    big = _png_b64(torch.zeros(3, 16, 16))
    status, body = http(
        "POST", server.url + "/v1/score", {"reward": "mean", "images": [big], "prompts": ["a"]}, auth
    )
    assert status == 413 and "images[0] is 16×16" in body["error"]
    payload = {"reward": "mean", "images": [_png_b64(torch.zeros(3, 8, 8))], "prompts": ["a"]}
    assert http("POST", server.url + "/v1/score", payload)[0] == 401
    assert http("POST", server.url + "/v1/score", payload, {"Authorization": "Bearer wrong"})[0] == 403
    assert http("GET", server.url + "/metrics")[0] == 401
    assert http("GET", server.url + "/healthz")[0] == 200
    assert http("POST", server.url + "/v1/score", payload, auth)[0] == 200
    client = RemoteReward("mean", endpoints=[server.url], token="s3cret")
    assert client.score(RewardBatch(prompts=["a"], images=torch.zeros(1, 3, 8, 8))).scores.tolist() == [0.0]


def test_concurrent_requests_are_micro_batched(serve):
    reward = MeanReward(sleep_s=0.05)
    server = serve({"mean": reward}, max_wait_ms=300, max_batch=64)
    values = [0.1, 0.3, 0.5, 0.7, 0.9, 0.2]
    results: dict[int, tuple] = {}

    def one(i: int) -> None:
        image = _png_b64(constant_images([values[i]])[0])
        results[i] = http(
            "POST", server.url + "/v1/score", {"reward": "mean", "images": [image], "prompts": [f"p{i}"]}
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, value in enumerate(values):  # each request got its own score
        status, body = results[i]
        assert status == 200 and math.isclose(body["scores"][0], round(value * 255) / 255, rel_tol=1e-6)
        assert body["details"]["tag"] == [f"p{i}"]
    assert max(reward.calls) > 1 and sum(reward.calls) == len(values)
    text = http("GET", server.url + "/metrics")[1]
    batches = metric(text, 'rlgen_batch_size_count{reward="mean"}')
    singles = metric(text, 'rlgen_batch_size_bucket{le="1",reward="mean"}')
    assert batches - singles >= 1  # at least one Reward.score call saw a batch > 1
    assert metric(text, 'rlgen_requests_total{route="/v1/score",status="200"}') == len(values)
    assert metric(text, 'rlgen_images_total{reward="mean"}') == len(values)


def test_nan_scores_are_null_and_counted(serve):
    server = serve({"mean": MeanReward(nan_below=0.5)})
    images = [_png_b64(im) for im in constant_images([0.2, 0.8])]
    status, body = http(
        "POST", server.url + "/v1/score", {"reward": "mean", "images": images, "prompts": ["a", "b"]}
    )
    assert status == 200 and body["scores"][0] is None and body["scores"][1] > 0.7
    assert metric(http("GET", server.url + "/metrics")[1], 'rlgen_nan_scores_total{reward="mean"}') == 1
    client = RemoteReward("mean", endpoints=[server.url])
    scores = client.score(RewardBatch(prompts=["a", "b"], images=constant_images([0.2, 0.8]))).scores
    assert math.isnan(scores[0]) and scores[1] > 0.7 and client.stats()["server_nan"] == 1


def test_reward_failure_is_a_json_500_and_counted(serve):
    server = serve({"mean": MeanReward(fail_first=1)})
    payload = {"reward": "mean", "images": [_png_b64(torch.zeros(3, 4, 4))], "prompts": ["a"]}
    status, body = http("POST", server.url + "/v1/score", payload)
    assert status == 500 and "transient failure" in body["error"]
    assert http("POST", server.url + "/v1/score", payload)[0] == 200
    text = http("GET", server.url + "/metrics")[1]
    assert metric(text, 'rlgen_errors_total{kind="scoring"}') == 1
    assert metric(text, 'rlgen_requests_total{route="/v1/score",status="500"}') == 1


def test_graceful_shutdown_completes_in_flight_request(serve):
    server = serve({"mean": MeanReward(sleep_s=0.6)})
    result: dict[str, tuple] = {}
    image = _png_b64(constant_images([0.4])[0])
    thread = threading.Thread(
        target=lambda: result.update(
            r=http("POST", server.url + "/v1/score", {"reward": "mean", "images": [image], "prompts": ["a"]})
        )
    )
    thread.start()
    metrics = server.app[STATE].metrics
    while metrics.in_flight.get() < 1:
        threading.Event().wait(0.01)
    server.stop()  # blocks until the in-flight request is answered and the batcher drained
    thread.join(timeout=10)
    status, body = result["r"]
    assert status == 200 and math.isclose(body["scores"][0], round(0.4 * 255) / 255, rel_tol=1e-6)


def test_a_request_that_fills_the_batch_is_scored_without_waiting(serve):
    reward = MeanReward()
    server = serve({"mean": reward}, max_wait_ms=10_000, max_batch=4)  # a partial batch would wait 10 s
    client = RemoteReward("mean", endpoints=[server.url], batch_size=4)
    began = time.perf_counter()
    scores = client.score(RewardBatch(prompts=["a"] * 4, images=constant_images([0.2, 0.4, 0.6, 0.8]))).scores
    assert time.perf_counter() - began < 5 and reward.calls == [4]
    assert torch.allclose(scores, torch.tensor([round(v * 255) / 255 for v in (0.2, 0.4, 0.6, 0.8)]))
