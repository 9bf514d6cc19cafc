"""``openai_judge`` and ``flowgrpo_remote`` against small loopback servers speaking those protocols."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle

import numpy as np
import pytest
import torch
from aiohttp import web
from PIL import Image

from rlgen_cli.errors import UserError
from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.remote import RemoteRewardError, parse_qwenvl, parse_unifiedreward
from rlgen_cli.server.runner import BackgroundServer
from tests.server.helpers import constant_images

FAST = {"backoff_s": 0.01}


def _fake_judge(seen: list[dict], fail_first: int = 0) -> web.Application:
    """An OpenAI-compatible judge: answers from the caption (``score N`` → N; ``garbage`` → no score)."""
    state = {"calls": 0}

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-judge", "object": "model"}]})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        state["calls"] += 1
        if state["calls"] <= fail_first:
            return web.json_response({"error": "overloaded"}, status=500)
        image_part, text_part = body["messages"][-1]["content"]
        url = image_part["image_url"]["url"]
        assert url.startswith("data:image/jpeg;base64,")
        assert Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).format == "JPEG"
        text = text_part["text"]
        caption = (
            text.split("[", 1)[1].split("]", 1)[0] if "Final Score" in text else text.split("Prompt: ")[1]
        )
        value = caption.split("score ")[1].split()[0] if "score " in caption else None
        if value is None:
            answer = "I am not sure what to say."
        elif "Final Score" in text:
            answer = f"The image is fine.\nFinal Score: {value}"
        else:
            answer = f"<think>ok</think><Score>{value}</Score>"
        return web.json_response(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
        )

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def test_parsers():
    assert parse_unifiedreward("blah\nFinal Score: 4.5") == pytest.approx(0.9)
    assert parse_qwenvl("<Score> 3 </Score>") == pytest.approx(0.6)
    assert parse_qwenvl("<Score>2</Score> on reflection <Score>5</Score>") == pytest.approx(
        1.0
    )  # the last one
    for parse, text in [(parse_unifiedreward, "no score here"), (parse_qwenvl, "<Score>9</Score>")]:
        with pytest.raises(ValueError):
            parse(text)


def test_openai_judge_scores_balances_and_counts_failures():
    seen: list[dict] = []
    with BackgroundServer(_fake_judge(seen, fail_first=1)) as a, BackgroundServer(_fake_judge(seen)) as b:
        urls = [a.url + "/v1", b.url + "/v1"]
        judge = build_reward("openai_judge", endpoints=urls, max_tokens=64, timeout_s=10, **FAST)
        batch = RewardBatch(
            prompts=["a cat score 4", "a dog score 5", "garbage"], images=torch.rand(3, 3, 16, 16)
        )
        with pytest.raises(RemoteRewardError, match="unparsable judge answer"):
            judge.score(batch)
        template = "Prompt: {prompt}\nAnswer as <Score>X</Score>."
        lenient = build_reward(
            "openai_judge",
            endpoints=urls,
            on_failure="nan",
            parser="qwenvl",
            prompt_template=template,
            **FAST,
        )
        result = lenient.score(batch)
    assert result.scores[:2].tolist() == pytest.approx([0.8, 1.0]) and torch.isnan(result.scores[2])
    assert result.details["judge_answer"][0].endswith("<Score>4</Score>")
    stats = lenient.stats()
    assert stats["parse_failures"] == 1 and stats["nan_samples"] == 1
    assert (
        judge.stats()["http_5xx"] == 1 and judge.stats()["retries"] >= 1
    )  # the first server's 500 was retried
    assert {body["model"] for body in seen} == {"fake-judge"}  # looked up through GET /v1/models
    assert all(body["temperature"] == 0.0 for body in seen) and seen[0]["max_tokens"] == 64
    assert sum(e["requests"] >= 1 for e in judge.stats()["endpoints"].values()) == 2


class _Evil:
    def __reduce__(self):
        return (os.getpid, ())


def _fake_flowgrpo(seen: list[dict], fail_first: int = 0, evil: bool = False) -> web.Application:
    """A Flow-GRPO-style GenEval server: pickled JPEG batches in, pickled scores out; 500 + traceback on error."""
    state = {"calls": 0}

    async def score(request: web.Request) -> web.Response:
        data = pickle.loads(await request.read())  # the test server trusts its own client
        seen.append(data)
        state["calls"] += 1
        if state["calls"] <= fail_first:
            return web.Response(status=500, text="Traceback (most recent call last): ...")
        if evil:
            return web.Response(body=pickle.dumps({"scores": [_Evil()]}))
        means = [
            np.asarray(Image.open(io.BytesIO(jpeg)), dtype=np.float64).mean() / 255 for jpeg in data["images"]
        ]
        n = len(means)
        reply = {
            "scores": [np.float64(m) for m in means],
            "rewards": [float(m > 0.5) for m in means],
            "strict_rewards": [0.0] * n,
            "group_rewards": {"single_object": list(np.array(means))},
            "group_strict_rewards": {"single_object": [0.0] * n},
        }
        return web.Response(body=pickle.dumps(reply))

    app = web.Application()
    app.router.add_post("/", score)
    return app


def test_flowgrpo_remote_needs_the_pickle_opt_in():
    with pytest.raises(UserError, match="allow_pickle"):
        build_reward("flowgrpo_remote", endpoints=["http://127.0.0.1:1"])


def test_flowgrpo_remote_round_trip_with_retry_on_500():
    seen: list[dict] = []
    values = [0.2, 0.7, 0.9]
    metadata = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}]} for _ in values]
    with BackgroundServer(_fake_flowgrpo(seen, fail_first=1)) as server:
        reward = build_reward(
            "flowgrpo_remote",
            endpoints=[server.url],
            allow_pickle=True,
            batch_size=2,
            only_strict=False,
            **FAST,
        )
        result = reward.score(
            RewardBatch(prompts=["a cat"] * 3, images=constant_images(values, 16), metadata=metadata)
        )
    assert result.scores.tolist() == pytest.approx(values, abs=0.01)
    assert result.details["rewards"].tolist() == [0.0, 1.0, 1.0]
    assert result.details["group_rewards/single_object"].tolist() == pytest.approx(values, abs=0.01)
    assert reward.stats()["http_5xx"] == 1 and reward.stats()["retries"] == 1
    assert seen[-1]["meta_datas"] == metadata[2:] and seen[-1]["only_strict"] is False
    assert all(isinstance(jpeg, bytes) for jpeg in seen[-1]["images"])
    assert json.dumps(seen[-1]["meta_datas"])  # plain data, as the upstream server expects


def test_flowgrpo_reply_cannot_run_code():
    with BackgroundServer(_fake_flowgrpo([], evil=True)) as server:
        reward = build_reward("flowgrpo_remote", endpoints=[server.url], allow_pickle=True, retries=1, **FAST)
        with pytest.raises(
            RemoteRewardError, match="refusing to load posix.getpid|refusing to load os.getpid"
        ):
            reward.score(RewardBatch(prompts=["x"], images=torch.rand(1, 3, 8, 8)))
    assert reward.stats()["bad_replies"] == 2
