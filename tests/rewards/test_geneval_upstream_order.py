"""GenEval's detection filter as upstream's ``evaluate_images.py`` runs it: float32 threshold, tie order.

Upstream holds each class's detections in a float32 array ``bbox`` and keeps
``np.argsort(bbox[:, 4])[::-1]`` filtered by ``bbox[ordering, 4] > threshold``; both facts are pinned here on
crafted detections whose expected outcome is written out by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from rlgen_cli.geneval_rules import Detection, GenEvalThresholds, score_geneval, select_detections

LEFT, RIGHT, MIDDLE = (0, 40, 20, 60), (80, 40, 100, 60), (40, 40, 60, 60)
F32_03 = float(np.float32(0.3))  # 0.30000001192092896: above 0.3 in float64, equal to it in float32
F32_ABOVE_03 = float(np.nextafter(np.float32(0.3), np.float32(1)))
JUST_ABOVE_09 = 0.9 + 1e-9  # above 0.9 in float64, rounds to float32(0.9) in upstream's float32 array
F32_ABOVE_09 = float(np.nextafter(np.float32(0.9), np.float32(1)))
UPSTREAM = GenEvalThresholds(tie_order="upstream")  # the GenEval reward's setting


def test_a_score_of_float32_threshold_is_dropped_the_next_float32_kept():
    assert F32_03 > 0.3  # the float64 comparison would keep it
    dets = [Detection("dog", LEFT, F32_03), Detection("dog", RIGHT, F32_ABOVE_03)]
    assert [d.box for d in select_detections(dets, "two_object")["dog"]] == [RIGHT]


def test_counting_threshold_is_compared_in_float32_too():
    assert np.float32(JUST_ABOVE_09) == np.float32(0.9)
    dets = [Detection("cup", LEFT, JUST_ABOVE_09), Detection("cup", RIGHT, F32_ABOVE_09)]
    assert [d.box for d in select_detections(dets, "counting")["cup"]] == [RIGHT]
    meta = {
        "tag": "counting",
        "include": [{"class": "cup", "count": 2}],
        "exclude": [{"class": "cup", "count": 3}],
    }
    result = score_geneval(dets, meta, lambda objs, cls: [])
    # one cup kept of two: count term 1 − |2 − 1|/2 = 0.5, not correct
    assert (result.score, result.accuracy) == (0.5, False)


def test_tied_scores_put_the_later_listed_detection_first():
    dets = [Detection("car", LEFT, 0.8), Detection("car", MIDDLE, 0.9), Detection("car", RIGHT, 0.8)]
    assert [d.box for d in select_detections(dets, "colors", UPSTREAM)["car"]] == [MIDDLE, RIGHT, LEFT]
    # ShapesEval's setting (every shape scores 1.0): equal scores stay in listed order
    assert [d.box for d in select_detections(dets, "colors")["car"]] == [MIDDLE, LEFT, RIGHT]


def test_tie_order_decides_which_object_the_colour_check_reads():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
    colour_of = {LEFT: "red", RIGHT: "blue"}

    def colours(objs: Sequence[Detection], cls: str) -> list[str]:
        return [colour_of[o.box] for o in objs]

    tied = [Detection("car", LEFT, 0.8), Detection("car", RIGHT, 0.8)]
    # accuracy reads the top-1 car: the later-listed (blue) one, so the red prompt fails
    assert score_geneval(tied, meta, colours, UPSTREAM).accuracy is False
    assert score_geneval(tied[::-1], meta, colours, UPSTREAM).accuracy is True


def test_ties_come_latest_listed_first_within_each_score():
    # upstream's np.argsort(scores)[::-1] on [0.5, 0.7, 0.5, 0.7, 0.5] with ties kept in listed order
    # (the insertion sort NumPy uses on short arrays), reversed: 0.7s as 3, 1, then 0.5s as 4, 2, 0
    scores = [0.5, 0.7, 0.5, 0.7, 0.5]
    dets = [Detection("cat", (i, 0, i + 1, 1), s) for i, s in enumerate(scores)]
    kept = [int(d.box[0]) for d in select_detections(dets, "single_object", UPSTREAM)["cat"]]
    assert kept == [3, 1, 4, 2, 0]


def test_the_geneval_reward_orders_ties_as_upstream_and_an_unknown_order_is_refused():
    from rlgen_cli.rewards.geneval import GenEvalKwargs, GenEvalReward

    assert GenEvalKwargs().tie_order == "upstream"
    reward = GenEvalReward(detector=None, color_classifier=None)
    assert reward.thresholds.tie_order == "upstream"
    with pytest.raises(ValueError, match=r"tie_order='first'; choose 'upstream' .* or 'listed'"):
        GenEvalThresholds(tie_order="first")
