"""Multi-round R3 evaluation metrics: per-round accuracy by tag, improvement fractions, strips."""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from rlgen_cli.r3.metrics import (
    carry_forward,
    format_round_table,
    round_metrics,
    round_strip,
    save_round_strips,
)

TAGS = ["counting", "counting", "position", "position"]


def _scores(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_round_metrics_hand_computed():
    scores = _scores(
        [
            [0.0, 1.0, 0.0, 0.5],  # round 0
            [1.0, 1.0, 0.0, 0.0],  # round 1
            [1.0, 1.0, 1.0, 0.0],  # round 2 (final)
        ]
    )
    finished = torch.tensor([True, True, False, False])
    m = round_metrics(scores, TAGS, finished)
    # round 0: counting (0 + 1)/2 = 0.5, position (0 + 0.5)/2 = 0.25, overall (0.5 + 0.25)/2 = 0.375
    assert m.accuracy[0] == pytest.approx({"counting": 0.5, "position": 0.25, "overall": 0.375})
    assert m.accuracy[1] == pytest.approx({"counting": 1.0, "position": 0.0, "overall": 0.5})
    assert m.accuracy[2] == pytest.approx({"counting": 1.0, "position": 0.5, "overall": 0.75})
    # final − round 0 = [+1, 0, +1, −0.5]: 2 improved, 1 worse, 1 unchanged
    assert (m.improved, m.worse, m.unchanged) == (0.5, 0.25, 0.25)
    assert m.finish_rate == 0.5 and m.rounds == 3 and m.num_samples == 4
    assert m.counts == {"counting": 2, "position": 2}
    flat = m.to_dict()
    assert flat["round_2/overall"] == pytest.approx(0.75) and flat["finish_rate"] == 0.5


def test_overall_weighs_each_tag_equally():
    m = round_metrics(_scores([[1.0, 1.0, 1.0, 0.0]]), ["a", "a", "a", "b"], torch.zeros(4, dtype=torch.bool))
    assert m.accuracy[0]["overall"] == 0.5  # (1 + 0)/2, not 3/4
    assert m.unchanged == 1.0 and m.finish_rate == 0.0


def test_carry_forward_repeats_the_score_before_the_stop_round():
    scores = _scores([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, math.nan, 0.9]])
    # sample 0 never stops (3 ≥ R); sample 1 says "no edit" in round 1; sample 2 in round 2
    carried, finished = carry_forward(scores, torch.tensor([3, 1, 2]))
    assert finished.tolist() == [False, True, True]
    expected = _scores([[0.1, 0.2, 0.3], [0.4, 0.2, 0.6], [0.7, 0.2, 0.6]])
    assert torch.equal(carried, expected)
    m = round_metrics(carried, ["x"] * 3, finished)
    assert m.unchanged == pytest.approx(1 / 3) and m.improved == pytest.approx(2 / 3)


def test_round_metrics_rejects_bad_input():
    with pytest.raises(ValueError, match="one tag"):
        round_metrics(_scores([[1.0, 0.0]]), ["a"], torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaN"):
        round_metrics(_scores([[math.nan]]), ["a"], torch.zeros(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="rounds, N"):
        round_metrics(torch.zeros(3), ["a"] * 3, torch.zeros(3, dtype=torch.bool))


def test_format_round_table():
    scores = _scores([[0.0, 1.0, 0.0, 0.5], [1.0, 1.0, 1.0, 0.0]])
    table = format_round_table(round_metrics(scores, TAGS, torch.tensor([True, False, False, False])))
    lines = table.splitlines()
    assert lines[0].split() == ["tag", "n", "round", "0", "round", "1"]
    assert lines[2].split() == ["counting", "2", "50.00%", "100.00%"]
    assert lines[3].split() == ["position", "2", "25.00%", "50.00%"]
    assert lines[4].split() == ["overall", "4", "37.50%", "75.00%"]
    assert lines[5] == "final vs round 0: improved 50.0% · worse 25.0% · unchanged 25.0% · finished 25.0%"


def test_round_strip_tiles_rounds_horizontally(tmp_path):
    rounds = [torch.full((2, 3, 4, 5), float(r) / 2) for r in range(3)]  # round r is filled with r/2
    strip = round_strip(rounds)
    assert strip.shape == (2, 3, 4, 15)
    assert strip[:, :, :, 5:10].eq(0.5).all() and strip[:, :, :, 10:].eq(1.0).all()
    path = save_round_strips(rounds, tmp_path / "strips" / "r.png", upscale=2)
    with Image.open(path) as image:
        assert image.size == (15 * 2, 2 * 4 * 2)  # one row per sample, rounds left to right
        assert image.getpixel((0, 0)) == (0, 0, 0) and image.getpixel((29, 15)) == (255, 255, 255)
    with pytest.raises(ValueError, match="one shape"):
        round_strip([torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, 6)])
    with pytest.raises(ValueError, match="empty"):
        round_strip([])
