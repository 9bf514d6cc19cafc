"""What the remote clients refuse before sending: images the wire would change (non-finite, outside
[0, 1], not float) and metadata that is not JSON data; and what they refuse in a reply."""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
import torch
from aiohttp import web

from rlgen_cli.rewards import RewardBatch
from rlgen_cli.rewards.remote import FlowGrpoRemoteReward, RemoteReward, RemoteRewardError, protocols, wire
from rlgen_cli.server.runner import BackgroundServer
from tests.server.helpers import MeanReward, constant_images

FAST = {"backoff_s": 0.01, "health_interval_s": 60.0, "retries": 0}
FORMATS = ("raw", "msgpack", "json")


def _clients(url: str) -> list:
    """One client per way images travel: the three rlgen wire formats and Flow-GRPO's pickle."""
    rlgen = [RemoteReward("mean", endpoints=url, wire_format=fmt, **FAST) for fmt in FORMATS]
    flowgrpo = FlowGrpoRemoteReward(endpoints=url, allow_pickle=True, retries=0, backoff_s=0.01)
    return [*rlgen, flowgrpo]


def _serve_mean(serve) -> tuple[MeanReward, str]:
    reward = MeanReward()
    return reward, serve({"mean": reward}, flowgrpo_protocol=True).url


# ----------------------------------------------------------------------------- non-finite pixels
def test_non_finite_pixels_are_refused_before_sending_naming_the_samples(serve):
    reward, url = _serve_mean(serve)
    images = constant_images([0.1, 0.2, 0.3, 0.4])
    images[0, :, :2] = float("nan")
    images[2, 1, 3, 3] = float("inf")
    for client in _clients(url):
        with pytest.raises(ValueError, match=r"non-finite pixel values \(NaN or inf\) in samples \[0, 2\]"):
            client.score(RewardBatch(prompts=["a", "b", "c", "d"], images=images))
    assert reward.calls == []  # nothing reached the server: no finite score for a NaN image


# ----------------------------------------------------------------------------- out-of-range pixels
def test_images_outside_0_1_are_refused_naming_the_range_and_the_fix(serve):
    reward, url = _serve_mean(serve)
    images = constant_images([0.0, 0.5, 1.0]) * 2 - 1  # [-1, 1], as a decoder hands them out
    for client in _clients(url):
        with pytest.raises(ValueError, match=r"values in \[-1, 1\].*samples \[0\].*\(x \+ 1\) / 2"):
            client.score(RewardBatch(prompts=["a", "b", "c"], images=images))
    assert reward.calls == []


def test_a_few_ulps_outside_0_1_are_in_range_and_scored_as_the_bounds(serve):
    reward, url = _serve_mean(serve)
    eps = torch.finfo(torch.float32).eps
    images = constant_images([0.0, 1.0])
    images[0] -= 2 * eps  # what (x + 1) / 2 or a VAE decode may leave: rounds to 0 and 255 anyway
    images[1] += 2 * eps
    for client in _clients(url):
        scores = client.score(RewardBatch(prompts=["a", "b"], images=images)).scores
        assert scores.tolist() == [0.0, 1.0]
    assert reward.calls


def test_the_tolerance_follows_the_dtype_and_never_lets_a_pixel_change():
    assert wire.range_tolerance(torch.float32) < 1e-6 and wire.range_tolerance(torch.float64) < 1e-12
    half_step = 0.5 / 255  # bfloat16's ε is 2⁻⁷: its next value above 1 quantises to 257, not 255
    assert wire.range_tolerance(torch.bfloat16) == half_step == wire.range_tolerance(torch.float16)
    above_one = torch.ones(1, 3, 4, 4, dtype=torch.bfloat16) + 2**-7
    with pytest.raises(ValueError, match=r"values in \[1\.008, 1\.008\]"):
        wire.check_pixels(above_one, "mean")


def test_integer_pixels_are_refused_with_the_conversion():
    with pytest.raises(ValueError, match=r"got torch.uint8; convert uint8 pixels with x.float\(\) / 255"):
        wire.check_pixels(torch.zeros(1, 3, 4, 4, dtype=torch.uint8), "mean")


# ----------------------------------------------------------------------------- metadata
class _Opaque:
    pass


NOT_JSON = {  # metadata value: the refusal's fragment
    "a_set": ({"include": {"cat"}}, r"metadata\[1\]\['include'\] is a set, which JSON does not carry"),
    "bytes": ({"blob": b"\x00"}, r"metadata\[1\]\['blob'\] is a bytes"),
    "int_key": ({"counts": {3: "cat"}}, r"metadata\[1\]\['counts'\] has keys \[3\] that are not strings"),
    "nan": ({"scale": [1.0, float("nan")]}, r"metadata\[1\]\['scale'\]\[1\] is nan: JSON has no NaN or inf"),
    "object": ({"x": _Opaque()}, r"metadata\[1\]\['x'\] is a _Opaque"),
}


@pytest.mark.parametrize("case", list(NOT_JSON))
def test_metadata_json_cannot_carry_is_refused_before_sending(serve, case):
    reward, url = _serve_mean(serve)
    value, message = NOT_JSON[case]
    batch = RewardBatch(prompts=["a", "b"], images=constant_images([0.1, 0.2]), metadata=[{}, value])
    for client in _clients(url):
        with pytest.raises(ValueError, match=message):
            client.score(batch)
    assert reward.calls == []


def test_metadata_of_tensors_numpy_and_tuples_travels_as_its_plain_values():
    meta = [{"n": torch.tensor(3), "xs": np.arange(2), "t": (1, "a"), "f": np.float32(0.5), "none": None}]
    assert wire.metadata_to_jsonable(meta) == [{"n": 3, "xs": [0, 1], "t": [1, "a"], "f": 0.5, "none": None}]


# ----------------------------------------------------------------------------- malformed replies
def _replying(status: int, body: bytes, content_type: str) -> web.Application:
    """A server that answers every POST with ``body`` (a reward server gone wrong)."""

    async def answer(_request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type=content_type)

    app = web.Application()
    app.router.add_post("/{tail:.*}", answer)
    app.router.add_get("/healthz", answer)
    return app


BAD_NATIVE = {  # reply to two images: the refusal
    "short_detail": (
        {"scores": [0.5, 0.5], "details": {"tag": ["a"]}},
        "details['tag'] with 1 entries for 2",
    ),
    "detail_not_a_list": (
        {"scores": [0.5, 0.5], "details": {"n": 3}},
        "details['n'] with a int for 2 images",
    ),
    "details_not_a_map": ({"scores": [0.5, 0.5], "details": [1, 2]}, "details is a list, not a map"),
}


@pytest.mark.parametrize("case", list(BAD_NATIVE))
def test_a_reply_whose_details_do_not_match_the_images_is_a_bad_reply(case):
    reply, message = BAD_NATIVE[case]
    with BackgroundServer(_replying(200, json.dumps(reply).encode(), "application/json")) as server:
        client = RemoteReward("mean", endpoints=server.url, wire_format="json", **FAST)
        with pytest.raises(RemoteRewardError, match=re.escape(message)):
            client.score(RewardBatch(prompts=["a", "b"], images=constant_images([0.1, 0.2])))
    assert client.stats()["bad_replies"] == 1


BAD_FLOWGRPO = {  # reply to one image: the refusal
    "none_reward": ({"scores": [1.0], "rewards": [None]}, "'rewards' holds None, not a number"),
    "group_not_a_list": (
        {"scores": [1.0], "group_rewards": {"x": 5}},
        "\"group_rewards['x']\" must be a list",
    ),
    "groups_not_a_dict": (
        {"scores": [1.0], "group_rewards": [5]},
        "must be a dict of per-tag lists, got list",
    ),
    "short_rewards": ({"scores": [1.0], "rewards": [1.0, 0.0]}, "'rewards' has 2 entries for 1 images"),
    "none_score": ({"scores": [None]}, "'scores' holds None, not a number"),
    "not_a_dict": ([1.0], "no 'scores' in list reply"),
}


@pytest.mark.parametrize("case", list(BAD_FLOWGRPO))
def test_a_malformed_flowgrpo_reply_is_a_wire_error_that_on_failure_applies_to(case):
    reply, message = BAD_FLOWGRPO[case]
    with pytest.raises(wire.WireError, match=re.escape(message)):
        protocols.flowgrpo_reply(1)(pickle.dumps(reply), "")
    with BackgroundServer(_replying(200, pickle.dumps(reply), "application/octet-stream")) as server:
        client = FlowGrpoRemoteReward(endpoints=server.url, allow_pickle=True, on_failure="nan", retries=0)
        scores = client.score(RewardBatch(prompts=["a"], images=constant_images([0.1]))).scores
    assert torch.isnan(scores).all() and client.stats()["bad_replies"] == 1
