"""The sanity-check rewards: ``brightness`` (mean pixel value) and ``char_fraction`` (share of characters
in a class), against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.r1vl import TEXT_REWARDS


def test_brightness_is_the_mean_pixel_value() -> None:
    images = torch.zeros(3, 3, 2, 2)
    images[1] = 1.0
    images[2, 0] = 1.0  # red channel only: 4 of 12 values are 1
    images[2, 1, 0, 0] = 0.5  # plus one half-lit green pixel: (4 + 0.5) / 12
    scores = build_reward("brightness").score(RewardBatch(["a", "b", "c"], images=images)).scores
    assert scores.dtype == torch.float32
    assert scores.tolist() == pytest.approx([0.0, 1.0, 4.5 / 12])


def test_brightness_of_uint8_pixels_and_of_videos() -> None:
    reward = build_reward("brightness")
    pixels = torch.full((1, 3, 2, 2), 51, dtype=torch.uint8)  # 51 / 255 = 0.2
    assert reward.score(RewardBatch(["a"], images=pixels)).scores.item() == pytest.approx(0.2)
    video = torch.zeros(1, 3, 2, 4, 4)
    video[:, :, 1] = 1.0  # a black frame then a white one
    assert reward.score(RewardBatch(["a"], images=video)).scores.item() == pytest.approx(0.5)


def test_brightness_rejects_a_batch_without_images() -> None:
    with pytest.raises(ValueError, match="RewardBatch.images is None"):
        build_reward("brightness").score(RewardBatch(["a"], texts=["x"]))


def test_char_fraction_counts_characters_of_the_class() -> None:
    texts = ["abc", "aB1c", "", "\n\n", "é a"]
    scores = build_reward("char_fraction", chars="a-z").score(RewardBatch(["p"] * 5, texts=texts)).scores
    assert scores.tolist() == pytest.approx([1.0, 0.5, 0.0, 0.0, 1 / 3])


def test_char_fraction_defaults_to_printable_ascii() -> None:
    texts = ["Hi 2!", "\x17\x17ok", "\ufffd"]
    scores = build_reward("char_fraction").score(RewardBatch(["p"] * 3, texts=texts)).scores
    assert scores.tolist() == pytest.approx([1.0, 0.5, 0.0])


@pytest.mark.parametrize("chars", ["", "z-a"])
def test_char_fraction_rejects_a_bad_class_and_shows_a_valid_one(chars: str) -> None:
    with pytest.raises(ValueError, match="char_fraction"):
        build_reward("char_fraction", chars=chars)


def test_char_fraction_is_a_text_reward_the_vlm_recipes_accept() -> None:
    assert "char_fraction" in TEXT_REWARDS and "brightness" not in TEXT_REWARDS
