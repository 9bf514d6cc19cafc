"""What ShapesEval's report shows: evaluation grids captioned with each prompt and a pass / fail border
from the sample's strict score, and the held-out split's row in the before → after table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageFont

from rlgen_cli.training.reporting.images import (
    CAPTIONED_TILE,
    FAIL_COLOR,
    FONT_SIZE,
    PASS_COLOR,
    caption_height,
    save_grid,
    wrap,
)
from rlgen_cli.training.reporting.report import (
    BEFORE_AFTER_GRID,
    BEFORE_AFTER_TABLE,
    ROW_LABEL_WIDTH,
    before_after_table,
    eval_report,
    strict_marks,
)

PROMPTS = ["a photo of a circle", "a photo of a circle left of a blue triangle", "a photo of four squares"]


def _pixel(png: Path, x: int, y: int) -> tuple[int, int, int]:
    with Image.open(png) as image:
        return image.convert("RGB").getpixel((x, y))


def test_a_captioned_grid_grows_by_the_caption_band_and_borders_each_tile_by_its_mark(tmp_path: Path):
    images = torch.full((3, 3, 32, 32), 0.5)  # grey tiles: any green or red comes from the marks
    plain = save_grid(images, tmp_path / "plain.png", columns=3, upscale=2)
    captioned = save_grid(
        images, tmp_path / "captioned.png", columns=3, upscale=2, captions=PROMPTS, passed=[True, False, None]
    )
    with Image.open(plain) as a, Image.open(captioned) as b:
        assert a.size == (3 * 64, 64)  # unchanged without captions
        # 32-pixel tiles are drawn 4× (128 wide) with the caption band under each
        assert b.size == (3 * CAPTIONED_TILE, CAPTIONED_TILE + caption_height())
    assert caption_height() >= 3 * FONT_SIZE
    assert _pixel(captioned, 1, 1) == PASS_COLOR
    assert _pixel(captioned, CAPTIONED_TILE + 1, 1) == FAIL_COLOR
    assert _pixel(captioned, CAPTIONED_TILE + 64, CAPTIONED_TILE - 2) == FAIL_COLOR  # the whole frame
    assert _pixel(captioned, 2 * CAPTIONED_TILE + 1, 1) == (128, 128, 128)  # not scored: no border
    assert _pixel(captioned, CAPTIONED_TILE + 64, 64) == (128, 128, 128)  # the sample itself untouched
    with Image.open(captioned) as grid:  # some dark text in each band, on white
        for i in range(3):
            band = grid.crop((i * CAPTIONED_TILE, CAPTIONED_TILE, (i + 1) * CAPTIONED_TILE, grid.height))
            assert min(band.convert("L").getdata()) < 100 and max(band.convert("L").getdata()) == 255


def test_one_caption_and_mark_per_image_or_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="2 captions for 3 images"):
        save_grid(torch.zeros(3, 3, 8, 8), tmp_path / "x.png", captions=PROMPTS[:2])


def test_captions_wrap_to_the_tile_and_cut_what_does_not_fit():
    font = ImageFont.load_default(size=FONT_SIZE)
    lines = wrap(PROMPTS[1], font, 122, 3)
    assert " ".join(lines) == PROMPTS[1] and len(lines) >= 2
    assert all(font.getlength(line) <= 122 for line in lines)
    cut = wrap("a photo of " * 20, font, 122, 2)
    assert len(cut) == 2 and cut[-1].endswith("…") and font.getlength(cut[-1]) <= 122


def test_marks_follow_the_strict_score():
    assert strict_marks(torch.tensor([1.0, 0.0, math.nan])) == [True, False, None]


def _metrics(prefix: str, strict: float, lenient: float, extra: float) -> dict[str, float]:
    base = f"{prefix}reward/shapes_geneval"
    out = {f"{base}/strict/mean": strict, f"{base}/accuracy/mean": lenient, f"{base}/n_extra/mean": extra}
    return out | {
        f"{base}/strict/tag/counting": strict,
        f"{base}/accuracy/tag/counting": lenient,
        f"{base}/n_extra/tag/counting": extra,
    }


def test_the_before_after_table_ends_with_the_heldout_row():
    before = _metrics("eval/", 0.25, 0.5, 1.0) | _metrics("eval_heldout/", 0.1, 0.2, 0.8)
    after = _metrics("eval/", 0.5, 0.5, 0.5) | _metrics("eval_heldout/", 0.15, 0.3, 0.6)
    after["eval_heldout/num_samples"] = 162.0
    lines = before_after_table(before, after).splitlines()
    assert [line.split()[0] for line in lines] == ["tag", "counting", "overall", "unseen", "unseen:"]
    assert lines[3].split() == [
        "unseen",
        "10.0",
        "→",
        "15.0",
        "(",
        "+5.0)",
        "20.0",
        "→",
        "30.0",
        "(",
        "+10.0)",
        "0.8",
        "→",
        "0.6",
        "(",
        "-0.2)",
    ]
    assert lines[4] == "unseen: 162 samples of prompt combinations never trained on (eval_heldout)"
    # without the held-out split on both sides: no row
    assert len(before_after_table(_metrics("eval/", 0.25, 0.5, 1.0), after).splitlines()) == 3


def test_the_shapes_report_captions_the_before_after_grid_from_each_evaluation(tmp_path: Path):
    report = eval_report("shapes", tmp_path)
    grey = torch.full((2, 3, 32, 32), 0.5)
    prompts = PROMPTS[:2]
    report.evaluated(-1, grey, prompts, {"shapes_geneval/strict": torch.tensor([0.0, 1.0])})
    report.evaluated(0, grey, prompts, {"shapes_geneval/strict": torch.tensor([1.0, 1.0])})
    before = _metrics("eval/", 0.5, 0.5, 1.0) | {"eval/reward/mean": 0.2}
    after = _metrics("eval/", 1.0, 1.0, 0.0) | {"eval/reward/mean": 0.4}
    (tmp_path / "metrics.jsonl").write_text("")
    report.write(before, after)
    assert (tmp_path / BEFORE_AFTER_TABLE).is_file()
    grid = tmp_path / BEFORE_AFTER_GRID
    row = CAPTIONED_TILE + caption_height()
    with Image.open(grid) as image:  # the rows' names in a strip on the left
        assert image.size == (ROW_LABEL_WIDTH + 2 * CAPTIONED_TILE, 2 * row)
    # before: fail, pass; after: pass, pass
    x0, x1 = ROW_LABEL_WIDTH + 1, ROW_LABEL_WIDTH + CAPTIONED_TILE + 1
    assert _pixel(grid, x0, 1) == FAIL_COLOR and _pixel(grid, x1, 1) == PASS_COLOR
    assert _pixel(grid, x0, row + 1) == PASS_COLOR and _pixel(grid, x1, row + 1) == PASS_COLOR
    assert report.tile_labels(prompts, {}) == {"captions": prompts}  # another reward: captions alone


def test_the_train_reward_panel_draws_a_smoothed_line_over_faint_raw_points(tmp_path: Path, monkeypatch):
    import json

    import matplotlib.pyplot as plt

    from rlgen_cli.training.reporting.plots import RAW_ALPHA
    from rlgen_cli.training.reporting.report import SHAPES_CURVE, SHAPES_CURVES

    rewards = [0.1, 0.5, 0.2, 0.6, 0.3]
    rows = [{"step": i, "reward/mean": r} for i, r in enumerate(rewards, start=1)]
    rows[-1] |= _metrics("eval/", 0.5, 0.5, 0.5)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its artists
    eval_report("shapes", tmp_path).write(None, rows[-1])
    assert (tmp_path / SHAPES_CURVE).is_file()
    train = next(ax for ax in figures[0].axes if ax.get_title() == dict(SHAPES_CURVES)["reward/mean"])
    (points,) = train.collections
    assert points.get_alpha() == RAW_ALPHA and [y for _, y in points.get_offsets()] == rewards
    (line,) = train.get_lines()
    # exponential moving average, weight 0.6, bias-corrected: 0.1, then (0.6·0.04 + 0.4·0.5) / (1 − 0.36) …
    assert line.get_ydata()[:2] == pytest.approx([0.1, (0.6 * 0.04 + 0.4 * 0.5) / 0.64])
    assert line.get_alpha() in (None, 1.0)
