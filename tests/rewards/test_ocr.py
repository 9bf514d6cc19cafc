"""OCR reward: hand-checked edit distances and scores, then PP-OCR on text rendered with PIL."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from rlgen_cli.rewards import RewardBatch, available, build_reward
from rlgen_cli.rewards.ocr import OcrReward, extract_target, levenshtein, normalise_text, ocr_score

logger = logging.getLogger(__name__)

PHRASES = ["Hello World", "OPEN 24 HOURS", "rlgen rocks", "Coffee Shop", "Deep Learning"]


def render(text: str, size: int = 256, font_size: int = 32) -> torch.Tensor:
    """Black text centred on white, as a (3, size, size) float tensor in [0, 1]."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)  # Pillow's bundled scalable font: offline
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(
        ((size - right + left) / 2 - left, (size - bottom + top) / 2 - top), text, fill="black", font=font
    )
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0


def blank(size: int = 256) -> torch.Tensor:
    return torch.ones(3, size, size)


@pytest.fixture(scope="module")
def reward() -> OcrReward:
    return build_reward("ocr")


# -------------------------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    ("a", "b", "dist"),
    [
        ("kitten", "sitting", 3),
        ("flaw", "lawn", 2),
        ("", "abc", 3),
        ("abc", "", 3),
        ("abc", "abc", 0),
        ("ab", "ba", 2),
    ],
)
def test_levenshtein(a, b, dist):
    assert levenshtein(a, b) == dist == levenshtein(b, a)


def test_ocr_score_by_hand():
    assert normalise_text(" Hello \n World ") == "helloworld"
    assert ocr_score("HelloWorld", "hello world") == 1.0  # spaces and case ignored
    assert ocr_score("the OPEN sign", "open") == 1.0  # target is a substring
    assert ocr_score("helo", "hello") == pytest.approx(1 - 1 / 5)  # one insertion
    assert ocr_score("hallo", "hello") == pytest.approx(0.8)  # one substitution
    assert ocr_score("", "abc") == 0.0  # distance 3 = len → 0
    assert ocr_score("zzzzzzzzzz", "ab") == 0.0  # distance 10 capped at len 2 → 0
    with pytest.raises(ValueError, match="empty"):
        ocr_score("x", "  ")


def test_extract_target():
    assert extract_target('A sign that says "OPEN 24 HOURS" at night') == "OPEN 24 HOURS"
    assert extract_target('"a" then "b"') == "a"
    assert extract_target("plain words", mode="whole_prompt") == "plain words"
    with pytest.raises(ValueError, match="a sign without quotes"):
        extract_target("a sign without quotes")
    with pytest.raises(ValueError, match="pair of double quotes"):
        extract_target('only "one quote')
    with pytest.raises(ValueError, match="target mode"):
        extract_target("x", mode="nope")


def test_registered_and_lazy():
    assert {"ocr", "video_ocr"} <= set(available())
    fresh = build_reward("video_ocr")
    assert fresh._engine is None and fresh.frame_stride == 4


# --------------------------------------------------------------------------------------------- PP-OCR


def test_rendered_phrases_accuracy_and_speed(reward):
    reward.read(np.zeros((32, 32, 3), dtype=np.uint8))  # warm-up: creates the engine
    engine = reward.engine
    exact, elapsed = 0, 0.0
    for phrase in PHRASES:
        batch = RewardBatch(prompts=[f'a poster that says "{phrase}"'], images=render(phrase)[None])
        start = time.perf_counter()
        score = float(reward.score(batch).scores[0])
        elapsed += time.perf_counter() - start
        exact += score == 1.0
        logger.info("OCR %r -> %.3f", phrase, score)
    per_image = elapsed / len(PHRASES)
    logger.info("OCR exact %d/%d, %.3f s/image", exact, len(PHRASES), per_image)
    assert exact >= 4, f"only {exact}/{len(PHRASES)} rendered phrases read exactly"
    assert per_image < 2.0, f"{per_image:.2f} s/image: is the detector side limit set?"
    assert reward.engine is engine  # created once per reward instance


def test_blank_and_wrong_text_score_low(reward):
    batch = RewardBatch(
        prompts=['"Coffee Shop"', '"Coffee Shop"'], images=torch.stack([blank(), render("zebra")])
    )
    scores = reward.score(batch).scores
    assert scores[0] == 0.0  # nothing read: distance = len(target)
    assert scores[1] < 0.5


def test_batch_shapes_and_details(reward):
    batch = RewardBatch(
        prompts=['say "Hello World"', 'say "Deep Learning"'],
        images=torch.stack([render("Hello World"), blank()]),
    )
    out = reward.score(batch)
    assert out.scores.shape == (2,) and out.scores.dtype == torch.float32
    assert out.details["ocr_target"] == ["Hello World", "Deep Learning"]
    assert out.scores[0] == 1.0 and out.scores[1] == 0.0
    with pytest.raises(ValueError, match="no text between"):
        reward.score(RewardBatch(prompts=["no quotes"], images=blank()[None]))


def test_video_every_fourth_frame():
    video_reward = build_reward("video_ocr")
    text, empty = render("Hello World"), blank()
    # Frames 0 and 4 are read. Text only on frame 0 → (1 + 0)/2; text on unread frames only → 0.
    frames_a = [text if i == 0 else empty for i in range(8)]
    frames_b = [empty if i in (0, 4) else text for i in range(8)]
    videos = torch.stack([torch.stack(frames_a, dim=1), torch.stack(frames_b, dim=1)])  # (2, 3, 8, H, W)
    scores = video_reward.score(RewardBatch(prompts=['"Hello World"'] * 2, images=videos)).scores
    assert scores.tolist() == [0.5, 0.0]


def test_engine_failure_is_nan(monkeypatch):
    broken = OcrReward()

    def fail(image):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(broken, "read", fail)
    scores = broken.score(RewardBatch(prompts=['"x"'], images=blank(32)[None])).scores
    assert math.isnan(float(scores[0]))


def test_hydra_config_kwargs_reach_the_factory():
    from pathlib import Path

    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[2] / "conf/reward/ocr.yaml"))
    assert cfg["weights"] == {"ocr": 1.0}
    built = build_reward("ocr", **cfg["kwargs"]["ocr"])
    assert isinstance(built, OcrReward) and built.target == "quoted"
