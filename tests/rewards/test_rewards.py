"""Behaviour of the reward contracts, registry, weighted mix and JPEG rewards."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.rewards import (
    RewardBatch,
    RewardResult,
    WeightedMix,
    available,
    build_mix,
    build_reward,
    register,
)
from rlgen_cli.rewards.base import accepts_uint8, all_finite
from rlgen_cli.rewards.registry import REWARDS


class ConstReward:
    """Test reward returning fixed scores and a per-sample detail."""

    def __init__(self, name: str, scores: list[float]) -> None:
        self.name = name
        self._scores = torch.tensor(scores, dtype=torch.float32)

    def score(self, batch: RewardBatch) -> RewardResult:
        return RewardResult(
            self._scores.clone(), {"raw": [f"{self.name}{i}" for i in range(len(self._scores))]}
        )


def _flat_and_noise() -> torch.Tensor:
    flat = torch.full((3, 64, 64), 0.5)
    noise = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0))
    return torch.stack([flat, noise])


def _pil_kb(image: torch.Tensor, quality: int = 95) -> float:
    array = (image.permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return len(buffer.getvalue()) / 1000


# --- RewardBatch / RewardResult ------------------------------------------------------------------


def test_batch_len_and_length_mismatch_names_field() -> None:
    assert len(RewardBatch(prompts=["a", "b"], texts=["x", "y"])) == 2
    with pytest.raises(ValueError, match=r"metadata has 1 .* prompts has 2"):
        RewardBatch(prompts=["a", "b"], metadata=[{}])
    with pytest.raises(ValueError, match=r"images has 3 .* prompts has 2"):
        RewardBatch(prompts=["a", "b"], images=torch.zeros(3, 3, 4, 4))


def test_result_requires_1d_scores() -> None:
    with pytest.raises(ValueError, match="shape"):
        RewardResult(scores=torch.zeros(2, 1))


# --- JPEG ---------------------------------------------------------------------------------------


def test_flat_image_is_more_compressible_than_noise() -> None:
    batch = RewardBatch(prompts=["flat", "noise"], images=_flat_and_noise())
    comp = build_reward("jpeg_compressibility").score(batch)
    incomp = build_reward("jpeg_incompressibility").score(batch)
    assert comp.scores.dtype == torch.float32 and comp.scores.shape == (2,)
    assert comp.scores[0] > comp.scores[1]
    assert incomp.scores[0] < incomp.scores[1]
    assert torch.equal(comp.scores, -incomp.scores)
    assert torch.equal(comp.details["jpeg_kb"], incomp.details["jpeg_kb"])


def test_jpeg_score_matches_independent_pil_encoding() -> None:
    images = _flat_and_noise()
    result = build_reward("jpeg_compressibility").score(RewardBatch(["a", "b"], images=images))
    expected = torch.tensor([-_pil_kb(img) / 500 for img in images], dtype=torch.float32)
    torch.testing.assert_close(result.scores, expected)
    torch.testing.assert_close(result.details["jpeg_kb"], -expected * 500)


def test_jpeg_quality_argument_changes_size() -> None:
    batch = RewardBatch(["n"], images=_flat_and_noise()[1:])
    low = build_reward("jpeg_incompressibility", quality=20).score(batch).scores
    high = build_reward("jpeg_incompressibility").score(batch).scores
    assert low[0] < high[0]
    torch.testing.assert_close(low, torch.tensor([_pil_kb(batch.images[0], 20) / 500]))


def test_jpeg_video_is_mean_over_frames() -> None:
    frames = _flat_and_noise()  # two frames: flat, noise
    video = frames.permute(1, 0, 2, 3).unsqueeze(0)  # (1, C, F=2, H, W)
    result = build_reward("jpeg_incompressibility").score(RewardBatch(["v"], images=video))
    expected = (_pil_kb(frames[0]) + _pil_kb(frames[1])) / 2 / 500
    torch.testing.assert_close(result.scores, torch.tensor([expected]))


def test_jpeg_rejects_missing_or_bad_images() -> None:
    reward = build_reward("jpeg_compressibility")
    with pytest.raises(ValueError, match="images is None"):
        reward.score(RewardBatch(["a"]))
    with pytest.raises(ValueError, match="non-finite"):
        reward.score(RewardBatch(["a"], images=torch.full((1, 3, 8, 8), float("nan"))))
    with pytest.raises(ValueError, match="C in"):
        reward.score(RewardBatch(["a"], images=torch.zeros(1, 4, 8, 8)))


def test_jpeg_scores_uint8_pixels_like_the_float_images_they_quantise() -> None:
    images = _flat_and_noise()
    pixels = (images * 255).round().to(torch.uint8)
    reward = build_reward("jpeg_compressibility")
    assert accepts_uint8(reward)
    as_float = reward.score(RewardBatch(["a", "b"], images=images)).scores
    as_uint8 = reward.score(RewardBatch(["a", "b"], images=pixels)).scores
    assert torch.equal(as_float, as_uint8)


def test_jpeg_rejects_infinite_pixels() -> None:
    images = torch.zeros(2, 3, 8, 8)
    images[1, 2, 3, 4] = -float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        build_reward("jpeg_compressibility").score(RewardBatch(["a", "b"], images=images))


@pytest.mark.parametrize(
    ("values", "finite"),
    [
        (torch.tensor([0.0, 1.0, -3.0]), True),
        (torch.tensor([0.0, float("nan"), 1.0]), False),
        (torch.tensor([float("inf"), 0.0]), False),
        (torch.tensor([0.0, -float("inf")]), False),
        (torch.tensor([float("nan")] * 3), False),
        (torch.empty(0), True),
        (torch.tensor([0, 255], dtype=torch.uint8), True),
    ],
)
def test_all_finite(values: torch.Tensor, finite: bool) -> None:
    assert all_finite(values) is finite
    assert all_finite(values) == bool(torch.isfinite(values).all())


# --- registry -----------------------------------------------------------------------------------


def test_unknown_reward_lists_sorted_names() -> None:
    assert {"jpeg_compressibility", "jpeg_incompressibility"} <= set(available())
    assert available() == sorted(available())
    with pytest.raises(ValueError, match="jpeg_compressibility, jpeg_incompressibility") as info:
        build_reward("jpeg_compresibility")
    assert "'jpeg_compresibility'" in str(info.value)


def test_register_duplicate_raises_and_builds_with_kwargs() -> None:
    name = "_test_const_reward"
    try:
        register(name)(ConstReward)
        with pytest.raises(ValueError, match="already registered"):
            register(name)(ConstReward)
        reward = build_reward(name, name=name, scores=[1.0])
        assert reward.score(RewardBatch(["p"])).scores.tolist() == [1.0]
    finally:
        REWARDS.pop(name, None)


# --- mix ----------------------------------------------------------------------------------------


def test_mix_is_weighted_sum_and_logs_every_component() -> None:
    a, b = ConstReward("a", [1.0, -2.0, 3.0]), ConstReward("b", [0.5, 0.25, -1.0])
    result = WeightedMix({"a": a, "b": b}, {"a": 0.5, "b": 2.0}).score(RewardBatch(["x", "y", "z"]))
    torch.testing.assert_close(result.scores, torch.tensor([0.5 + 1.0, -1.0 + 0.5, 1.5 - 2.0]))
    assert result.details["a"].tolist() == [1.0, -2.0, 3.0]
    assert result.details["b"].tolist() == [0.5, 0.25, -1.0]
    assert result.details["a/raw"] == ["a0", "a1", "a2"] and result.details["b/raw"] == ["b0", "b1", "b2"]


def test_build_mix_from_registry_with_per_reward_kwargs() -> None:
    batch = RewardBatch(["flat", "noise"], images=_flat_and_noise())
    mix = build_mix(
        {"jpeg_compressibility": 0.5, "jpeg_incompressibility": 2.0},
        jpeg_incompressibility={"quality": 50},
    )
    comp = build_reward("jpeg_compressibility").score(batch).scores
    incomp = build_reward("jpeg_incompressibility", quality=50).score(batch).scores
    result = mix.score(batch)
    torch.testing.assert_close(result.scores, 0.5 * comp + 2.0 * incomp)
    assert "jpeg_compressibility/jpeg_kb" in result.details
    torch.testing.assert_close(result.details["jpeg_incompressibility"], incomp)


def test_mix_propagates_nan_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    a = ConstReward("a", [1.0, float("nan")])
    b = ConstReward("b", [1.0, 1.0])
    with caplog.at_level(logging.WARNING, logger="rlgen_cli.rewards.mix"):
        scores = WeightedMix({"a": a, "b": b}, {"a": 0.0, "b": 1.0}).score(RewardBatch(["x", "y"])).scores
    assert scores[0] == 1.0 and torch.isnan(scores[1])
    assert "'a' returned NaN for 1 of 2" in caplog.text


def test_mix_component_length_mismatch_names_component() -> None:
    mix = WeightedMix(
        {"good": ConstReward("good", [1.0, 2.0]), "short": ConstReward("short", [1.0])},
        {"good": 1.0, "short": 1.0},
    )
    with pytest.raises(ValueError, match="'short' returned 1 scores for a batch of 2"):
        mix.score(RewardBatch(["x", "y"]))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({}, "empty"),
        ({"jpeg_compressibility": float("nan")}, "finite"),
        ({"jpeg_compressibility": float("inf")}, "finite"),
        ({"jpeg_compressibility": 0.0, "jpeg_incompressibility": 0.0}, "all reward mix weights are zero"),
        ({"nope": 1.0}, "valid names"),
    ],
)
def test_build_mix_rejects_bad_specs(spec: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_mix(spec)


def test_build_mix_rejects_kwargs_for_absent_reward() -> None:
    with pytest.raises(ValueError, match="not in the mix"):
        build_mix({"jpeg_compressibility": 1.0}, jpeg_incompressibility={"quality": 50})


def test_weighted_mix_rejects_mismatched_weights() -> None:
    with pytest.raises(ValueError, match="do not match"):
        WeightedMix({"a": ConstReward("a", [1.0])}, {"b": 1.0})


def test_each_built_in_reward_says_whether_it_reads_the_prompt():
    """A reward server refuses a prompt-less request for a reward that reads prompts (rather than score
    against ""), so each reward that scores the image alone must say so, and no prompt reader may."""
    from rlgen_cli.rewards.base import reads_prompts
    from rlgen_cli.rewards.clip import ClipReward
    from rlgen_cli.rewards.registry import build_reward

    image_only = ["brightness", "jpeg_compressibility", "jpeg_incompressibility", "image_similarity"]
    assert not any(reads_prompts(build_reward(name)) for name in [*image_only, "shapes_geneval"])
    assert not reads_prompts(ClipReward("aesthetic", "unused"))  # its head file is not needed to say so
    assert all(reads_prompts(build_reward(name)) for name in ["pickscore", "clipscore"])
    assert not reads_prompts(build_reward("deqa", endpoints="http://127.0.0.1:9", allow_pickle=True))
