"""Per-tag metrics of Flow-GRPO's GenEval server: the −10 "other tag" sentinel never enters a mean.

The fake server below answers with the payload layout of the upstream server (reward-server,
``reward_server/gen_eval.py``, ``compute_geneval``): ``group_rewards`` and ``group_strict_rewards`` hold
one list per GenEval tag, each as long as the batch, with −10.0 wherever the image has another tag.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from aiohttp import web

from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.rewards.remote.protocols import flowgrpo_reply
from rlgen_cli.server.runner import BackgroundServer
from rlgen_cli.training.reporting.report import detail_summaries

TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def geneval_payload(tags: list[str], strict: list[float], scores: list[float]) -> dict:
    """The server's reply for images of ``tags`` with these strict verdicts and partial credits."""
    return {
        "scores": scores,
        "rewards": [0.0] * len(tags),  # only_strict=True: the lenient verdict is not computed
        "strict_rewards": strict,
        "group_rewards": {k: [0.0 if t == k else -10.0 for t in tags] for k in TAGS},
        "group_strict_rewards": {k: [s if t == k else -10.0 for t, s in zip(tags, strict)] for k in TAGS},
    }


def _server(payload: dict) -> web.Application:
    async def score(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=pickle.dumps(payload))

    app = web.Application()
    app.router.add_post("/", score)
    return app


def _score(payload: dict, tags: list[str]) -> dict:
    metadata = [{"tag": t, "include": [{"class": "cat", "count": 1}]} for t in tags]
    with BackgroundServer(_server(payload)) as server:
        mix = build_mix(
            {"flowgrpo_remote": 1.0},
            flowgrpo_remote={"endpoints": [server.url], "allow_pickle": True, "backoff_s": 0.01},
        )
        batch = RewardBatch(
            prompts=["p"] * len(tags), images=torch.rand(len(tags), 3, 16, 16), metadata=metadata
        )
        return mix.score(batch).details


def test_perfect_batch_has_per_tag_means_of_one():
    # 4 position images and 4 of other tags, all perfect: the naive mean of the position list
    # would be (4·1 + 4·(−10))/8 = −4.5.
    tags = ["position", "counting", "position", "colors", "position", "single_object", "position", "two_object"]  # fmt: skip
    details = _score(geneval_payload(tags, [1.0] * 8, [1.0] * 8), tags)
    assert details["flowgrpo_remote/tag"] == tags
    summary = detail_summaries(details, by_tag=True)
    assert summary["reward/flowgrpo_remote/group_strict_rewards/position/mean"] == 1.0
    assert summary["reward/flowgrpo_remote/group_strict_rewards/counting/mean"] == 1.0
    assert "reward/flowgrpo_remote/group_strict_rewards/color_attr/mean" not in summary  # no such image
    assert summary["reward/flowgrpo_remote/strict_rewards/tag/position"] == 1.0
    assert all(v >= 0 for v in summary.values())


def test_per_tag_means_count_only_their_own_images():
    tags = ["position", "position", "position", "counting"]
    strict = [1.0, 0.0, 0.0, 1.0]
    details = _score(geneval_payload(tags, strict, [1.0, 0.75, 0.5, 1.0]), tags)
    summary = detail_summaries(details, by_tag=True)
    assert summary["reward/flowgrpo_remote/group_strict_rewards/position/mean"] == pytest.approx(1 / 3)
    assert summary["reward/flowgrpo_remote/group_strict_rewards/counting/mean"] == 1.0
    assert summary["reward/flowgrpo_remote/strict_rewards/mean"] == 0.5  # all four images
    assert summary["reward/flowgrpo_remote/strict_rewards/tag/position"] == pytest.approx(1 / 3)
    assert details["flowgrpo_remote"].tolist() == [1.0, 0.75, 0.5, 1.0]


def test_sentinel_entries_parse_as_not_applicable():
    tags = ["counting", "position"]
    parse = flowgrpo_reply(2)
    scores, details = parse(pickle.dumps(geneval_payload(tags, [1.0, 0.0], [1.0, 0.5])), "")
    assert scores == [1.0, 0.5] and details["tag"] == tags
    assert details["group_strict_rewards/position"] == [None, 0.0]
    assert details["group_strict_rewards/counting"] == [1.0, None]
    assert details["group_strict_rewards/colors"] == [None, None]
