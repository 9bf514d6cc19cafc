"""Per-tag evaluation summaries, the before → after report, and the end-of-run evaluation reports."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.training.reporting.report import (
    BEFORE_AFTER_GRID,
    BEFORE_AFTER_TABLE,
    ROW_LABEL_WIDTH,
    SHAPES_CURVE,
    before_after_table,
    detail_summaries,
    eval_report,
    tag_table,
    write_before_after,
)

DETAILS = {
    "shapes_geneval": torch.tensor([1.0, 0.0, 0.5, 0.5]),
    "shapes_geneval/strict": torch.tensor([1.0, 0.0, 1.0, 0.0]),
    "shapes_geneval/n_extra": torch.tensor([0.0, 2.0, 0.0, 1.0]),
    "shapes_geneval/tag": ["counting", "counting", "position", "colors"],
    "shapes_geneval/reason": ["", "", "", ""],
}


def test_detail_summaries_average_overall_and_per_tag():
    out = detail_summaries(DETAILS, by_tag=True)
    assert out["reward/shapes_geneval/strict/mean"] == pytest.approx(0.5)
    assert out["reward/shapes_geneval/strict/tag/counting"] == pytest.approx(0.5)
    assert out["reward/shapes_geneval/strict/tag/position"] == pytest.approx(1.0)
    assert out["reward/shapes_geneval/n_extra/tag/colors"] == pytest.approx(1.0)
    assert "reward/shapes_geneval/reason/mean" not in out  # strings are not averaged
    assert not any("/tag/" in key for key in detail_summaries(DETAILS))  # only when asked


def _metrics(strict: dict[str, float], extra: float) -> dict[str, float]:
    out = {f"eval/reward/shapes_geneval/strict/tag/{t}": v for t, v in strict.items()}
    out["eval/reward/shapes_geneval/strict/mean"] = sum(strict.values()) / len(strict)
    out |= {f"eval/reward/shapes_geneval/n_extra/tag/{t}": extra for t in strict}
    out["eval/reward/shapes_geneval/n_extra/mean"] = extra
    return out


def test_before_after_table_rows_and_deltas():
    before = _metrics({"counting": 0.25, "position": 0.5}, extra=0.8)
    after = _metrics({"counting": 0.5, "position": 0.75}, extra=0.4)
    columns = [("strict", "strict"), ("n_extra", "extra/img")]
    lines = before_after_table(before, after, columns=columns).splitlines()
    assert [line.split()[0] for line in lines] == ["tag", "counting", "position", "overall"]
    assert "25.0 →   50.0 ( +25.0)" in lines[1]  # accuracies in percent
    assert "0.8 →    0.4 (  -0.4)" in lines[1]  # extra objects as counts
    assert "37.5 →   62.5 ( +25.0)" in lines[3]


def test_tag_table_without_prefix_reads_eval_task_keys():
    table = tag_table(detail_summaries(DETAILS, by_tag=True), columns=[("strict", "strict")], prefix="")
    assert [line.split()[0] for line in table.splitlines()] == [
        "tag",
        "counting",
        "colors",
        "position",
        "overall",
    ]
    assert table.splitlines()[1].split() == ["counting", "0.500"]
    assert table.splitlines()[-1].split() == ["overall", "0.500"]


def test_write_before_after_writes_the_table_and_grid(tmp_path: Path):
    before = _metrics({"counting": 0.25}, extra=1.0)
    after = _metrics({"counting": 0.5}, extra=0.5)
    images = torch.rand(3, 3, 8, 8)
    table = write_before_after(tmp_path, before, after, images, images)
    assert table is not None and (tmp_path / BEFORE_AFTER_TABLE).read_text().strip() == table
    assert (tmp_path / BEFORE_AFTER_GRID).is_file()
    assert write_before_after(tmp_path, {}, {"eval/reward/mean": 1.0}) is None  # no tags: no report


def _write_metrics(run_dir: Path, rows: list[dict[str, float]]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_shapes_report_writes_curves_table_and_the_grid_of_the_first_and_last_evaluation(tmp_path: Path):
    before = _metrics({"counting": 0.25}, extra=1.0) | {"eval/reward/mean": 0.2}
    after = _metrics({"counting": 0.5}, extra=0.5) | {"eval/reward/mean": 0.4, "reward/mean": 0.3}
    _write_metrics(tmp_path, [before | {"step": 0}, after | {"step": 1}])
    report = eval_report("shapes", tmp_path)
    first, middle, last = torch.zeros(2, 3, 8, 8), torch.full((2, 3, 8, 8), 0.5), torch.ones(2, 3, 8, 8)
    for epoch, images in ((-1, first), (0, middle), (1, last)):
        report.evaluated(epoch, images)
    report.write(before, after)
    assert (tmp_path / SHAPES_CURVE).is_file()
    table = (tmp_path / BEFORE_AFTER_TABLE).read_text().splitlines()
    assert table[1].split()[:4] == ["counting", "25.0", "→", "50.0"]
    grid = np.asarray(Image.open(tmp_path / BEFORE_AFTER_GRID))[:, ROW_LABEL_WIDTH:]  # right of the row names
    # top row: the evaluation before training (black), bottom row: the last one (white), not the middle
    assert grid[: grid.shape[0] // 2].max() == 0 and grid[grid.shape[0] // 2 :].min() == 255


def test_the_shapes_report_without_an_evaluation_before_draws_only_the_curves(tmp_path: Path):
    after = _metrics({"counting": 0.5}, extra=0.5) | {"eval/reward/mean": 0.4}
    _write_metrics(tmp_path, [after | {"step": 1}])
    eval_report("shapes", tmp_path).write(None, after)
    assert (tmp_path / SHAPES_CURVE).is_file() and not (tmp_path / BEFORE_AFTER_TABLE).exists()


def test_no_report_without_an_evaluation_before_writes_nothing(tmp_path: Path):
    after = _metrics({"counting": 0.5}, extra=0.5) | {"eval/reward/mean": 0.4}
    report = eval_report("none", tmp_path)
    report.evaluated(0, torch.zeros(2, 3, 8, 8))
    report.write(None, after)
    assert list(tmp_path.iterdir()) == []
