"""GenEval scoring rules on hand-made detections, plus one end-to-end run with tiny random models."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.geneval_rules import (
    Detection,
    GenEvalResult,
    relative_position,
    score_geneval,
    select_detections,
    summarise,
)
from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.geneval import COLORS, GenEvalReward, _to_pil, crop_object


def det(label: str, box: tuple[float, float, float, float], score: float = 0.95) -> Detection:
    return Detection(label, box, score)


def paint(color_of: dict[tuple[float, ...], str]):
    """A colour function reading each object's colour from a {box: colour} table."""

    def colors(objs: Sequence[Detection], cls: str) -> list[str]:
        return [color_of[o.box] for o in objs]

    return colors


def no_colors(objs: Sequence[Detection], cls: str) -> list[str]:
    raise AssertionError("colour classifier must not be called for this clause")


LEFT, RIGHT = (0, 40, 20, 60), (80, 40, 100, 60)  # two 20×20 boxes, centres 80 px apart horizontally
TOP, BOTTOM = (40, 0, 60, 20), (40, 80, 60, 100)


# --------------------------------------------------------------------------------------- single / two


def test_single_object_found():
    meta = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    r = score_geneval([det("dog", LEFT)], meta, no_colors)
    # count term 1 − |1−1|/1 = 1 → score 1; accuracy and strict hold.
    assert (r.score, r.accuracy, r.strict) == (1.0, True, True)


def test_single_object_extra_instance():
    meta = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    r = score_geneval([det("dog", LEFT), det("dog", RIGHT, 0.8)], meta, no_colors)
    # found 2: count term 1 − 1/1 = 0 → score 0. Original: ≥ 1 dog → correct. Strict: 2 ≠ 1 → False.
    assert (r.score, r.accuracy, r.strict) == (0.0, True, False)


def test_single_object_clamped_and_unclamped():
    meta = {"tag": "single_object", "include": [{"class": "dog", "count": 1}]}
    dets = [det("dog", LEFT), det("dog", RIGHT), det("dog", TOP)]
    # found 3: raw count term 1 − 2/1 = −1; clamped to 0 by default.
    assert score_geneval(dets, meta, no_colors).score == 0.0
    assert score_geneval(dets, meta, no_colors, clamp_count_term=False).score == -1.0


def test_two_object_one_missing():
    meta = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]}
    r = score_geneval([det("dog", LEFT), det("apple", RIGHT)], meta, no_colors)
    # terms [1 (dog), 0 (cat: 1 − 1/1)] → 0.5; accuracy and strict fail.
    assert (r.score, r.accuracy, r.strict) == (0.5, False, False)


def test_threshold_half_confidence_counts_for_two_object_not_counting():
    two = {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]}
    dets = [det("dog", LEFT, 0.95), det("cat", RIGHT, 0.5)]
    assert score_geneval(dets, two, no_colors).accuracy  # 0.5 > 0.3
    counting = {
        "tag": "counting",
        "include": [{"class": "cat", "count": 2}],
        "exclude": [{"class": "cat", "count": 3}],
    }
    dets = [det("cat", LEFT, 0.95), det("cat", RIGHT, 0.5)]
    r = score_geneval(dets, counting, no_colors)
    # 0.5 < 0.9 → only one cat: count term 1 − 1/2 = 0.5; accuracy/strict fail.
    assert (r.score, r.accuracy, r.strict) == (0.5, False, False)


def test_threshold_is_strictly_greater_and_max_objects():
    dets = [det("dog", LEFT, 0.3), det("dog", RIGHT, 0.31)]
    assert [d.score for d in select_detections(dets, "two_object")["dog"]] == [0.31]
    many = [det("dog", (i, 0, i + 1, 1), 0.5 + i / 100) for i in range(20)]
    kept = select_detections(many, "single_object")["dog"]
    assert len(kept) == 16 and kept[0].score == pytest.approx(0.69)  # most confident first


# -------------------------------------------------------------------------------------------- counting

COUNT3 = {
    "tag": "counting",
    "include": [{"class": "cup", "count": 3}],
    "exclude": [{"class": "cup", "count": 4}],
}


def test_counting_exact():
    dets = [det("cup", LEFT), det("cup", RIGHT), det("cup", TOP)]
    r = score_geneval(dets, COUNT3, no_colors)
    assert (r.score, r.accuracy, r.strict) == (1.0, True, True)


def test_counting_too_many_fails_through_exclude():
    dets = [det("cup", b) for b in (LEFT, RIGHT, TOP, BOTTOM)]
    r = score_geneval(dets, COUNT3, no_colors)
    # found 4: count term 1 − 1/3 = 2/3. Original: ≥3 ok but exclude (<4) fails → False. Strict False.
    assert r.score == pytest.approx(2 / 3)
    assert (r.accuracy, r.strict) == (False, False)


def test_counting_too_few():
    r = score_geneval([det("cup", LEFT)], COUNT3, no_colors)
    # found 1: 1 − 2/3 = 1/3.
    assert r.score == pytest.approx(1 / 3) and not r.accuracy and not r.strict


def test_exclude_without_matching_include():
    meta = {
        "tag": "single_object",
        "include": [{"class": "dog", "count": 1}],
        "exclude": [{"class": "cat", "count": 1}],
    }
    r = score_geneval([det("dog", LEFT), det("cat", RIGHT)], meta, no_colors)
    # partial credit only scores include clauses: 1. Exclude "fewer than 1 cat" fails → accuracy, strict False.
    assert (r.score, r.accuracy, r.strict) == (1.0, False, False)
    assert score_geneval([det("dog", LEFT)], meta, no_colors).strict


# ---------------------------------------------------------------------------------------------- colours


def test_colors_right_and_wrong():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    r = score_geneval([det("car", LEFT)], meta, paint({LEFT: "red"}))
    assert (r.score, r.accuracy, r.strict) == (1.0, True, True)
    r = score_geneval([det("car", LEFT)], meta, paint({LEFT: "blue"}))
    # terms [1 (count), 0 (colour: 1 − |1−0|/1)] → 0.5.
    assert (r.score, r.accuracy, r.strict) == (0.5, False, False)


def test_colors_wrong_count_appends_zero_and_skips_classifier():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    r = score_geneval([], meta, no_colors)
    # count term 1 − 1/1 = 0, then 0 for the colour → 0.
    assert (r.score, r.accuracy, r.strict) == (0.0, False, False)


def test_colors_extra_object_original_checks_most_confident_only():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    dets = [det("car", LEFT, 0.9), det("car", RIGHT, 0.8)]
    r = score_geneval(dets, meta, paint({LEFT: "red", RIGHT: "blue"}))
    # original: top-1 car is red → correct. Partial: 2 ≠ 1 → [0, 0] → 0; strict False.
    assert (r.score, r.accuracy, r.strict) == (0.0, True, False)


def test_color_attr_one_of_two_right():
    meta = {
        "tag": "color_attr",
        "include": [
            {"class": "car", "count": 1, "color": "red"},
            {"class": "bench", "count": 1, "color": "green"},
        ],
    }
    r = score_geneval([det("car", LEFT), det("bench", RIGHT)], meta, paint({LEFT: "red", RIGHT: "white"}))
    # terms [1, 1 (car red), 1, 0 (bench not green)] → 0.75.
    assert (r.score, r.accuracy, r.strict) == (0.75, False, False)


def test_multi_count_color_partial_colour_term():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 2, "color": "red"}]}
    r = score_geneval([det("car", LEFT), det("car", RIGHT)], meta, paint({LEFT: "red", RIGHT: "blue"}))
    # terms [1 (count), 1 − |2−1|/2 = 0.5] → 0.75.
    assert r.score == 0.75 and not r.accuracy and not r.strict


# --------------------------------------------------------------------------------------------- position

POSITION = {
    "tag": "position",
    "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}],
}


def test_position_right_of():
    r = score_geneval([det("cat", LEFT), det("dog", RIGHT)], POSITION, no_colors)
    # terms [1 (cat), 1 (dog), 1 (dog right of cat)] → 1.
    assert (r.score, r.accuracy, r.strict) == (1.0, True, True)


def test_position_wrong_side_upstream_appends_zero_then_one():
    r = score_geneval([det("cat", RIGHT), det("dog", LEFT)], POSITION, no_colors)  # default: upstream
    # the server's terms [1 (cat), 1 (dog), 0 (relation fails), 1 (appended after its loop)] → 3/4.
    assert r.score == pytest.approx(3 / 4) and not r.accuracy and not r.strict


def test_position_wrong_side_strict_appends_one_zero():
    r = score_geneval([det("cat", RIGHT), det("dog", LEFT)], POSITION, no_colors, position_credit="strict")
    # terms [1, 1, 0] → 2/3.
    assert r.score == pytest.approx(2 / 3) and not r.accuracy and not r.strict


def test_position_wrong_side_for_one_of_two_objects():
    meta = {
        "tag": "position",
        "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 2, "position": ["right of", 0]}],
    }
    dets = [det("cat", (40, 40, 60, 60)), det("dog", RIGHT), det("dog", LEFT, 0.9)]  # one dog left of the cat
    # upstream [1, 1, 0, 1] → 3/4 (one 0 however many pairs fail); strict [1, 1, 0] → 2/3.
    assert score_geneval(dets, meta, no_colors).score == pytest.approx(3 / 4)
    assert score_geneval(dets, meta, no_colors, position_credit="strict").score == pytest.approx(2 / 3)


@pytest.mark.parametrize("position_credit", ["upstream", "strict"])
def test_position_target_missing(position_credit):
    r = score_geneval([det("dog", RIGHT)], POSITION, no_colors, position_credit=position_credit)
    # terms [0 (no cat), 1 (dog), 0 (no target group)] → 1/3 under both.
    assert r.score == pytest.approx(1 / 3) and not r.accuracy


def test_position_after_a_failed_colour():
    meta = {
        "tag": "position",
        "include": [
            {"class": "cat", "count": 1},
            {"class": "dog", "count": 1, "color": "red", "position": ["right of", 0]},
        ],
    }
    dets, colours = [det("cat", LEFT), det("dog", RIGHT)], paint({RIGHT: "blue"})
    # upstream checks no position once the colour failed: [1, 1, 0 (colour)] → 2/3;
    # strict pays the unchecked position a 0: [1, 1, 0, 0] → 1/2.
    assert score_geneval(dets, meta, colours).score == pytest.approx(2 / 3)
    assert score_geneval(dets, meta, colours, position_credit="strict").score == pytest.approx(1 / 2)


def test_unknown_position_credit_is_rejected():
    with pytest.raises(ValueError, match="position_credit.*upstream, strict"):
        score_geneval([det("cat", LEFT)], POSITION, no_colors, position_credit="lenient")
    with pytest.raises(ValueError, match="position_credit"):
        build_reward("geneval", detector_path="d", clip_path="c", position_credit="half")


def test_relative_position_basic_relations():
    assert relative_position(LEFT, RIGHT) == {"left of"}
    assert relative_position(RIGHT, LEFT) == {"right of"}
    assert relative_position(TOP, BOTTOM) == {"above"}
    assert relative_position(BOTTOM, TOP) == {"below"}
    assert relative_position(LEFT, LEFT) == set()  # identical boxes: no relation


def test_relative_position_margin_edge():
    # Two 20-px boxes: the margin removes 0.1·(20+20) = 4 px of the horizontal offset.
    a, b = (0, 0, 20, 20), (4, 0, 24, 20)  # offset 4 px → shrunk to 0 → no relation
    assert relative_position(b, a) == set()
    b = (5, 0, 25, 20)  # offset 5 → shrunk 1; 1/5 = 0.2 < 0.5 → still no relation
    assert relative_position(b, a) == set()
    b = (8, 0, 28, 20)  # offset 8 → shrunk 4; 4/8 = 0.5, not > 0.5 → no relation
    assert relative_position(b, a) == set()
    b = (9, 0, 29, 20)  # offset 9 → shrunk 5; 5/9 ≈ 0.56 > 0.5 → right of
    assert relative_position(b, a) == {"right of"}
    assert relative_position(b, a, margin=0.0) == {"right of"}


def test_relative_position_diagonal():
    # Offset (40, 40) for 20-px boxes: shrunk (36, 36)/‖(40, 40)‖ ≈ 0.64 each → right of and below.
    assert relative_position((40, 40, 60, 60), (0, 0, 20, 20)) == {"right of", "below"}


# --------------------------------------------------------------------------------------------- summary


def test_summarise_per_tag():
    results = [
        GenEvalResult("counting", 0.5, True, False),
        GenEvalResult("counting", 1.0, False, False),
        GenEvalResult("position", 1.0, True, True),
    ]
    assert summarise(results) == {"counting": 0.5, "position": 1.0, "overall": 0.75}
    assert summarise(results, key="strict") == {"counting": 0.0, "position": 1.0, "overall": 0.5}
    assert summarise(results, key="score")["counting"] == 0.75
    assert summarise([]) == {}


def test_metadata_without_include_is_rejected():
    with pytest.raises(ValueError, match="include"):
        score_geneval([], {"tag": "single_object"}, no_colors)


def test_factory_without_paths_says_what_to_set():
    with pytest.raises(ValueError, match=r"reward\.kwargs\.geneval\.detector_path"):
        build_reward("geneval")
    with pytest.raises(ValueError, match=r"reward\.kwargs\.geneval\.clip_path"):
        build_reward("geneval", detector_path="some/dir")


def test_crop_object_uses_mask_background():
    image = Image.new("RGB", (10, 10), (255, 0, 0))
    mask = np.zeros((10, 10), dtype=bool)
    mask[:, :5] = True
    crop = np.asarray(crop_object(image, Detection("x", (0, 0, 10, 10), 1.0, mask)))
    assert crop.shape == (10, 10, 3)
    assert tuple(crop[0, 0]) == (255, 0, 0) and tuple(crop[0, 9]) == (0x99, 0x99, 0x99)


class FakeDetector:
    def detect(self, images):
        return [[det("dog", LEFT)] for _ in images]


class FakeColors:
    def classify(self, image, objects, classname):
        return ["red" for _ in objects]


def test_reward_with_injected_models():
    reward = GenEvalReward(FakeDetector(), FakeColors())
    metas = [
        {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "red"}]},
        {"tag": "two_object", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]},
    ]
    out = reward.score(RewardBatch(prompts=["a", "b"], images=torch.rand(2, 3, 100, 100), metadata=metas))
    assert out.scores.tolist() == [1.0, 0.5]
    assert out.details["accuracy"].tolist() == [1.0, 0.0] and out.details["strict"].tolist() == [1.0, 0.0]
    assert out.details["tag"] == ["colors", "two_object"]
    with pytest.raises(ValueError, match="metadata"):
        reward.score(RewardBatch(prompts=["a"], images=torch.rand(1, 3, 8, 8)))


class TwoAnimals:
    def detect(self, images):
        return [[det("dog", LEFT), det("cat", RIGHT)] for _ in images]  # the dog is LEFT of the cat


@pytest.mark.parametrize(("position_credit", "expected"), [("upstream", 0.75), ("strict", 2 / 3)])
def test_reward_applies_its_position_credit(position_credit, expected):
    reward = GenEvalReward(TwoAnimals(), FakeColors(), position_credit=position_credit)
    batch = RewardBatch(
        prompts=["a dog right of a cat"], images=torch.rand(1, 3, 100, 100), metadata=[POSITION]
    )
    assert reward.score(batch).scores.item() == pytest.approx(expected)  # [1, 1, 0, 1] | [1, 1, 0]


# ----------------------------------------------------------------------------------- tiny transformers


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        YolosConfig,
        YolosForObjectDetection,
        YolosImageProcessor,
    )

    from rlgen_cli.models.tokenizers import tiny_clip_tokenizer

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("geneval_models")
    labels = ["dog", "cat", "mouse"]  # "mouse" exercises the alias to "computer mouse"
    det_cfg = YolosConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=[64, 64],
        patch_size=16,
        num_detection_tokens=5,
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )
    YolosForObjectDetection(det_cfg).save_pretrained(root / "det")
    YolosImageProcessor(size={"shortest_edge": 64, "longest_edge": 64}).save_pretrained(root / "det")
    tok = tiny_clip_tokenizer()
    clip_cfg = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        projection_dim=16,
    )
    CLIPModel(clip_cfg).save_pretrained(root / "clip")
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(root / "clip")
    return str(root / "det"), str(root / "clip")


def test_end_to_end_tiny_transformers(tiny_paths):
    det_path, clip_path = tiny_paths
    # Thresholds at 0 so the untrained detector's low-confidence boxes reach the colour and position code.
    reward = build_reward(
        "geneval",
        detector_path=det_path,
        clip_path=clip_path,
        local_files_only=True,
        threshold=0.0,
        counting_threshold=0.0,
        colour_crop="box",  # YOLOS gives boxes only
    )
    images = reward.detector.detect([Image.new("RGB", (80, 48)), Image.new("RGB", (40, 40))])
    assert len(images) == 2 and all(isinstance(d, Detection) for dets in images for d in dets)
    assert all(d.label in {"dog", "cat", "computer mouse"} for dets in images for d in dets)
    assert all(0 <= d.box[0] <= d.box[2] <= 80 + 1e-3 for d in images[0])
    colours = reward.color_classifier.classify(Image.new("RGB", (80, 48)), images[0][:2], "dog")
    assert len(colours) == len(images[0][:2]) and set(colours) <= set(COLORS)
    metas = [
        {"tag": "color_attr", "include": [{"class": "dog", "count": 1, "color": "red"}, {"class": "cat", "count": 1, "color": "blue"}]},
        {"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
        {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}]},
    ]  # fmt: skip
    images = torch.rand(4, 3, 48, 64)
    # A clause whose count matches what the detector finds, so scoring reaches the CLIP colour check.
    found = reward.detector.detect(_to_pil(images[3:]))[0]
    label = found[0].label if found else "dog"
    n = max(sum(d.label == label for d in found), 1)
    metas.append({"tag": "colors", "include": [{"class": label, "count": n, "color": "red"}]})
    out = reward.score(RewardBatch(prompts=["a", "b", "c", "d"], images=images, metadata=metas))
    assert out.scores.shape == (4,) and out.scores.dtype == torch.float32
    assert torch.all((out.scores >= 0) & (out.scores <= 1))
    assert out.details["accuracy"].shape == (4,) and out.details["strict"].shape == (4,)
    assert out.details["tag"] == ["color_attr", "position", "counting", "colors"]
    if found:  # the count matched, so any failure can only be the colour check
        assert "==" not in out.details["reason"][3]


def test_hydra_config_kwargs_reach_the_factory():
    from pathlib import Path

    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[2] / "conf/reward/geneval.yaml"))
    assert cfg["weights"] == {"geneval": 1.0}
    with pytest.raises(ValueError, match=r"reward\.kwargs\.geneval\.detector_path="):
        build_reward("geneval", **cfg["kwargs"]["geneval"])
    kwargs = {**cfg["kwargs"]["geneval"], "detector_path": "d", "clip_path": "c"}
    reward = build_reward("geneval", **kwargs)  # nothing loads until first use
    assert isinstance(reward, GenEvalReward) and reward.position_credit == "upstream"
