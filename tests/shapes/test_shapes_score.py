"""Scoring on hand-made detections: every tag, extra objects, partial credit (hand arithmetic)."""

from __future__ import annotations

import math

import pytest

from rlgen_cli.shapes.detect import ShapeDetection
from rlgen_cli.shapes.score import (
    ShapesResult,
    check_metadata,
    count_extra,
    format_summary,
    score_detections,
    summarise_results,
)

# 8×8 boxes: LEFT/RIGHT share a row (centres 20 px apart), TOP/BOTTOM share a column.
LEFT, RIGHT = (2.0, 12.0, 10.0, 20.0), (22.0, 12.0, 30.0, 20.0)
TOP, BOTTOM = (12.0, 2.0, 20.0, 10.0), (12.0, 22.0, 20.0, 30.0)
CORNER = (24.0, 24.0, 30.0, 30.0)


def det(shape: str, box: tuple[float, ...], color: str = "red") -> ShapeDetection:
    return ShapeDetection(shape, box, 1.0, None, color)


def meta(tag: str, *include: dict, exclude: list[dict] | None = None) -> dict:
    return {"tag": tag, "include": list(include), **({"exclude": exclude} if exclude else {}), "prompt": "p"}


def scores(r: ShapesResult) -> tuple:
    return r.score, r.accuracy, r.geneval_strict, r.strict, r.n_extra


SINGLE = meta("single_object", {"class": "circle", "count": 1})
TWO = meta("two_object", {"class": "circle", "count": 1}, {"class": "triangle", "count": 1})
COUNT3 = meta("counting", {"class": "square", "count": 3}, exclude=[{"class": "square", "count": 4}])
RED_CIRCLE = meta("colors", {"class": "circle", "count": 1, "color": "red"})
# "a photo of a circle right of a square": clause 0 = square, clause 1 = circle right of clause 0.
RIGHT_OF = meta(
    "position", {"class": "square", "count": 1}, {"class": "circle", "count": 1, "position": ["right of", 0]}
)
ATTR = meta(
    "color_attr",
    {"class": "circle", "count": 1, "color": "red"},
    {"class": "square", "count": 1, "color": "blue"},
)


# ------------------------------------------------------------------------------------------- every tag


def test_single_object():
    assert scores(score_detections([det("circle", LEFT, "blue")], SINGLE)) == (1.0, True, True, True, 0)
    # nothing found: count term 1 − |1 − 0|/1 = 0.
    assert scores(score_detections([], SINGLE)) == (0.0, False, False, False, 0)


def test_two_object():
    assert score_detections([det("circle", LEFT), det("triangle", RIGHT)], TWO).strict
    # circle + square: terms [1 (circle), 0 (triangle missing)] → 0.5; the square is extra.
    r = score_detections([det("circle", LEFT), det("square", RIGHT)], TWO)
    assert scores(r) == (0.5, False, False, False, 1)


def test_counting():
    three = [det("square", b) for b in (LEFT, RIGHT, TOP)]
    assert scores(score_detections(three, COUNT3)) == (1.0, True, True, True, 0)
    # two squares: 1 − |3 − 2|/3 = 2/3.
    r = score_detections(three[:2], COUNT3)
    assert r.score == pytest.approx(2 / 3) and not (r.accuracy or r.strict) and r.n_extra == 0
    # four squares: 1 − |3 − 4|/3 = 2/3; GenEval accuracy fails through the exclude clause; 1 extra.
    r = score_detections([*three, det("square", BOTTOM)], COUNT3)
    assert r.score == pytest.approx(2 / 3) and (r.accuracy, r.strict, r.n_extra) == (False, False, 1)


def test_colors():
    assert score_detections([det("circle", LEFT, "red")], RED_CIRCLE).strict
    # blue circle: terms [count 1, colour 1 − |1 − 0|/1 = 0] → 0.5.
    r = score_detections([det("circle", LEFT, "blue")], RED_CIRCLE)
    assert scores(r) == (0.5, False, False, False, 0)


def test_position():
    r = score_detections([det("square", LEFT), det("circle", RIGHT)], RIGHT_OF)
    assert scores(r) == (1.0, True, True, True, 0)
    # swapped: terms [square count 1, circle count 1, position 0] → 2/3.
    r = score_detections([det("square", RIGHT), det("circle", LEFT)], RIGHT_OF)
    assert r.score == pytest.approx(2 / 3) and not r.strict
    # circle straight below the square: offset (0, 20) → "below" only, not "right of".
    r = score_detections([det("square", TOP), det("circle", BOTTOM)], RIGHT_OF)
    assert r.score == pytest.approx(2 / 3) and not r.strict


def test_position_margin():
    # centres 1 px apart in x, 10 px in y; margin 0.1·(8 + 8) = 1.6 px per axis shrinks dx to 0:
    # revised offset (0, 8.4) / ‖(1, 10)‖ → "below" only, so "right of" fails.
    nudged = (3.0, 22.0, 11.0, 30.0)
    square = (2.0, 12.0, 10.0, 20.0)
    assert not score_detections([det("square", square), det("circle", nudged)], RIGHT_OF).strict


def test_color_attr():
    good = [det("circle", LEFT, "red"), det("square", RIGHT, "blue")]
    assert scores(score_detections(good, ATTR)) == (1.0, True, True, True, 0)
    # colours swapped: terms [circle 1, colour 0, square 1, colour 0] → 0.5.
    swapped = [det("circle", LEFT, "blue"), det("square", RIGHT, "red")]
    assert score_detections(swapped, ATTR).score == 0.5


# -------------------------------------------------------------------------------------- extra objects


def test_extra_object_of_an_unrequested_class_breaks_strict_only():
    r = score_detections([det("circle", LEFT), det("triangle", CORNER)], SINGLE)
    # GenEval ignores the triangle (partial 1, accuracy and GenEval strict hold); ShapesEval strict fails.
    assert scores(r) == (1.0, True, True, False, 1)
    assert "unrequested" in r.reasons[-1]


def test_extra_object_of_a_requested_class():
    r = score_detections([det("circle", LEFT), det("circle", RIGHT)], SINGLE)
    # two circles for one: count term 1 − 1/1 = 0; GenEval accuracy (≥ 1) holds; one extra.
    assert scores(r) == (0.0, True, False, False, 1)


def test_count_extra_sums_over_classes():
    dets = [det("circle", LEFT), det("circle", RIGHT), det("square", TOP), det("triangle", BOTTOM)]
    # requested: circle 1, triangle 1 → extra = (2 − 1) circle + 1 square + 0 triangle = 2.
    assert count_extra(dets, TWO) == 2


# ---------------------------------------------------------------------------- partial credit, summary


def test_partial_credit_formula_mixed_clauses():
    # color_attr, found: red circle, a green square and a second, blue square.
    # clause circle: count 1 − 0/1 = 1, colour 1 − 0/1 = 1. clause square: found 2 → count 1 − |1 − 2|/1 = 0,
    # count wrong → append 0 for its colour. Terms [1, 1, 0, 0] → 0.5. Extra: 1 square.
    dets = [det("circle", LEFT, "red"), det("square", RIGHT, "green"), det("square", TOP, "blue")]
    r = score_detections(dets, ATTR)
    assert scores(r) == (0.5, False, False, False, 1)


def test_partial_credit_formula_counting_colour_terms():
    # 2 red squares requested, 2 found, one red: terms [count 1, colour 1 − |2 − 1|/2 = 0.5] → 0.75.
    two_red = meta("colors", {"class": "square", "count": 2, "color": "red"})
    r = score_detections([det("square", LEFT, "red"), det("square", RIGHT, "blue")], two_red)
    assert r.score == pytest.approx(0.75) and not r.strict


def test_summary_and_table():
    results = [
        score_detections([det("circle", LEFT)], SINGLE),  # strict
        score_detections([det("circle", LEFT), det("square", CORNER)], SINGLE),  # extra
        score_detections([det("circle", LEFT, "blue")], RED_CIRCLE),  # wrong colour
    ]
    summary = summarise_results(results)
    assert summary["strict"] == {"single_object": 0.5, "colors": 0.0, "overall": 0.25}
    assert summary["extra_rate"]["single_object"] == 0.5 and summary["partial"]["colors"] == 0.5
    assert summary["accuracy"]["overall"] == pytest.approx((1.0 + 0.0) / 2)
    table = format_summary(summary)
    assert table.splitlines()[0].split() == ["tag", *summary] and "overall" in table
    assert math.isclose(summary["n_extra"]["overall"], 0.25)


@pytest.mark.parametrize(
    "bad",
    [
        {"include": []},
        meta("colors", {"class": "dog", "count": 1}),
        meta("colors", {"class": "circle", "count": 1, "color": "pink"}),
    ],
)
def test_non_shapes_metadata_is_rejected(bad):
    with pytest.raises(ValueError, match="ShapesEval"):
        check_metadata(bad)
