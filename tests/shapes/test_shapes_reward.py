"""The ``shapes_geneval`` reward: registry, modes, clutter penalty arithmetic, details, config, errors."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

import rlgen_cli.rewards.shapes  # noqa: F401  (registers shapes_geneval until rewards/__init__ imports it)
from rlgen_cli._hydra import conf_dir
from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.shapes import ShapesGenEvalReward, clutter_score
from rlgen_cli.shapes.prompts import build_splits
from rlgen_cli.shapes.render import render_batch

SINGLE = {
    "tag": "single_object",
    "include": [{"class": "circle", "count": 1}],
    "prompt": "a photo of a circle",
}
COUNT2 = {
    "tag": "counting",
    "include": [{"class": "square", "count": 2}],
    "exclude": [{"class": "square", "count": 3}],
    "prompt": "a photo of two squares",
}


def batch_of(painter, scenes: list[list], metas: list[dict]) -> RewardBatch:
    images = torch.stack([painter(objs) for objs in scenes])
    return RewardBatch(prompts=[m["prompt"] for m in metas], images=images, metadata=metas)


def test_clutter_score_arithmetic():
    assert clutter_score(1.0, 0) == 1.0
    assert clutter_score(0.5, 2) == pytest.approx(0.5 * math.exp(-1.0))  # 0.5·e^(−0.5·2) ≈ 0.1839
    assert clutter_score(0.8, 1, extra_penalty=0.0) == 0.8


def test_modes_on_hand_painted_images(painter):
    scenes = [
        [("circle", "red", 4, 4, 9)],  # exact
        [("circle", "red", 4, 4, 9), ("triangle", "blue", 20, 20, 8)],  # one extra
        [
            ("square", "green", 2, 2, 8),
            ("square", "white", 20, 2, 8),
            ("square", "blue", 2, 20, 8),
        ],  # 3 for 2
    ]
    batch = batch_of(painter, scenes, [SINGLE, SINGLE, COUNT2])
    clutter = build_reward("shapes_geneval", mode="clutter").score(batch)
    # partial: [1, 1 (GenEval ignores the triangle), 1 − |2 − 3|/2 = 0.5]; n_extra [0, 1, 1].
    # clutter: [1, e^−0.5 ≈ 0.6065, 0.5·e^−0.5 ≈ 0.3033].
    expected = torch.tensor([1.0, math.exp(-0.5), 0.5 * math.exp(-0.5)])
    assert torch.allclose(clutter.scores, expected)
    assert clutter.details["strict"].tolist() == [1.0, 0.0, 0.0]
    assert clutter.details["accuracy"].tolist() == [1.0, 1.0, 0.0]
    assert clutter.details["geneval_strict"].tolist() == [1.0, 1.0, 0.0]
    assert clutter.details["partial"].tolist() == [1.0, 1.0, 0.5]
    assert clutter.details["n_extra"].tolist() == [0.0, 1.0, 1.0]
    assert clutter.details["tag"] == ["single_object", "single_object", "counting"]
    assert clutter.details["reason"][0] == "" and "unrequested" in clutter.details["reason"][1]
    partial = build_reward("shapes_geneval", mode="partial").score(batch)
    assert partial.scores.tolist() == [1.0, 1.0, 0.5]
    strict = build_reward("shapes_geneval", mode="strict").score(batch)
    assert strict.scores.tolist() == [1.0, 0.0, 0.0] and strict.scores.dtype == torch.float32


def test_lenient_mode_pays_duplicates_that_partial_credit_and_strict_refuse(painter):
    scenes = [
        [("circle", "red", 4, 4, 9), ("circle", "blue", 20, 20, 8)],  # two circles for "a circle"
        [("square", "green", 2, 2, 8), ("square", "white", 20, 2, 8)],  # exactly two squares
        [("square", "green", 2, 2, 8), ("square", "white", 20, 2, 8), ("square", "blue", 2, 20, 8)],
    ]
    batch = batch_of(painter, scenes, [SINGLE, COUNT2, COUNT2])
    lenient = build_reward("shapes_geneval", mode="lenient").score(batch)
    # GenEval's binary rule looks at the first `count` circles only: the duplicate passes; the counting
    # prompt's exclude clause (3 squares) still fails the third image.
    assert lenient.scores.tolist() == [1.0, 1.0, 0.0]
    partial = build_reward("shapes_geneval", mode="partial").score(batch)
    assert partial.scores.tolist() == [0.0, 1.0, 0.5]  # count term 1 − |1 − 2|/1 = 0 for the duplicate
    assert lenient.details["strict"].tolist() == [0.0, 1.0, 0.0]


TWO = {
    "tag": "two_object",
    "include": [{"class": "triangle", "count": 1}, {"class": "square", "count": 1}],
    "prompt": "a photo of a triangle and a square",
}
COUNT3 = {
    "tag": "counting",
    "include": [{"class": "circle", "count": 3}],
    "exclude": [{"class": "circle", "count": 4}],
    "prompt": "a photo of three circles",
}
RIGHT_OF = {
    "tag": "position",
    "include": [
        {"class": "square", "count": 1},
        {"class": "triangle", "count": 1, "position": ["right of", 0]},
    ],
    "prompt": "a photo of a triangle right of a square",
}
RED = {
    "tag": "colors",
    "include": [{"class": "circle", "count": 1, "color": "red"}],
    "prompt": "a red circle",
}


def test_objects_mode_pays_an_attempted_object_above_a_missing_one(painter):
    scenes = [
        [("triangle", "red", 2, 2, 9), ("square", "blue", 20, 20, 8)],  # right
        [("triangle", "red", 2, 2, 9)],  # the square left out
        [("triangle", "red", 2, 2, 9), ("circle", "blue", 20, 20, 8)],  # the square drawn as a circle
        [("circle", "red", 2, 2, 8), ("circle", "blue", 20, 2, 8), ("square", "white", 11, 20, 8)],
        [("circle", "red", 2, 2, 8), ("circle", "blue", 20, 2, 8)],  # one circle short
        [("circle", "red", 2, 2, 7), ("circle", "blue", 12, 2, 7), ("circle", "white", 22, 2, 7)]
        + [("circle", "green", 12, 20, 7)],  # one circle too many
        [("square", "red", 2, 10, 8), ("triangle", "blue", 22, 10, 8)],  # triangle right of square
        [("triangle", "blue", 2, 10, 8), ("square", "red", 22, 10, 8)],  # the relation reversed
        [("circle", "blue", 10, 10, 9)],  # right shape, wrong colour
    ]
    metas = [TWO, TWO, TWO, COUNT3, COUNT3, COUNT3, RIGHT_OF, RIGHT_OF, RED]
    batch = batch_of(painter, scenes, metas)
    objects = build_reward("shapes_geneval").score(batch)  # the default mode
    # slots: 1 exact, 0.5 other colour, 0.5 other shape, 0 missing; relations 1/0; × e^(−0.5·surplus)
    expected = [1.0, 0.5, (1 + 0.5) / 2, (1 + 1 + 0.5) / 3, 2 / 3, math.exp(-0.5), 1.0, 2 / 3, 0.5]
    assert objects.scores.tolist() == pytest.approx(expected)
    assert objects.details["objects"].tolist() == pytest.approx([*expected[:5], 1.0, *expected[6:]])
    # the default (clutter) reward orders the same attempts the other way: a wrong second object
    # zeroes its clause and counts as extra, so leaving it out pays more
    clutter = build_reward("shapes_geneval", mode="clutter").score(batch).scores.tolist()
    assert clutter[1] > clutter[2] and objects.scores[2] > objects.scores[1]
    assert clutter[4] > clutter[3] and objects.scores[3] > objects.scores[4]
    assert objects.details["strict"].tolist() == [1, 0, 0, 0, 0, 0, 1, 0, 0]
    quarter = build_reward("shapes_geneval", wrong_shape_credit=0.25).score(batch)
    assert quarter.scores[2] == pytest.approx((1 + 0.25) / 2)


def test_ground_truth_scores_one():
    metas = build_splits()["test"][:24]
    images = render_batch(metas, list(range(24)))
    batch = RewardBatch([m["prompt"] for m in metas], images, metas)
    for mode in ("clutter", "objects"):
        result = ShapesGenEvalReward(mode).score(batch)
        assert result.scores.tolist() == [1.0] * 24 and result.details["strict"].sum() == 24


def test_config_builds_the_reward():
    cfg = OmegaConf.to_container(OmegaConf.load(conf_dir() / "reward" / "shapes_geneval.yaml"))
    assert cfg["weights"] == {"shapes_geneval": 1.0}
    reward = build_reward("shapes_geneval", **cfg["kwargs"]["shapes_geneval"])
    assert isinstance(reward, ShapesGenEvalReward)
    assert (reward.mode, reward.extra_penalty, reward.credit.wrong_shape) == ("objects", 0.5, 0.5)
    data = OmegaConf.load(conf_dir() / "data" / "shapes.yaml")
    assert data.train == "builtin:shapes_train.jsonl" and data.test == "builtin:shapes_test.jsonl"


def test_bad_arguments_and_batches():
    with pytest.raises(ValueError, match="mode"):
        build_reward("shapes_geneval", mode="recall")
    with pytest.raises(ValueError, match="extra_penalty"):
        build_reward("shapes_geneval", extra_penalty=-1.0)
    with pytest.raises(ValueError, match="wrong_shape_credit"):
        build_reward("shapes_geneval", wrong_shape_credit=0.7)
    reward = ShapesGenEvalReward()
    with pytest.raises(ValueError, match="RGB images"):
        reward.score(RewardBatch(["p"], images=torch.zeros(1, 3, 2, 8, 8), metadata=[SINGLE]))
    with pytest.raises(ValueError, match="metadata"):
        reward.score(RewardBatch(["p"], images=torch.zeros(1, 3, 8, 8)))
    dog = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    with pytest.raises(ValueError, match="ShapesEval"):
        reward.score(RewardBatch(["p"], images=torch.zeros(1, 3, 8, 8), metadata=[dog]))


def test_served_scores_equal_local_scores():
    from rlgen_cli.rewards.remote import RemoteReward
    from rlgen_cli.server.app import ServerSettings, build_app
    from rlgen_cli.server.runner import BackgroundServer

    reward = build_reward("shapes_geneval")
    metas = build_splits()["test"][:6]
    images = render_batch(metas, list(range(6)))
    images[1, :, 0:3, 0:3] = 1.0  # a 9-pixel white square: one extra object in image 1
    batch = RewardBatch([m["prompt"] for m in metas], images, metas)
    local = reward.score(batch)
    app = build_app({"shapes_geneval": reward}, ServerSettings(port=0, max_wait_ms=0))
    server = BackgroundServer(app, shutdown_timeout_s=10).start()
    try:
        remote = RemoteReward("shapes_geneval", endpoints=[server.url], batch_size=4).score(batch)
    finally:
        server.stop()
    assert torch.equal(remote.scores, local.scores) and local.scores[1] == pytest.approx(math.exp(-0.5))
    assert torch.equal(remote.details["strict"], local.details["strict"])
