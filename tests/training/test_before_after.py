"""``eval_before=true`` writes ``before_after.txt`` and ``images/before_after.png`` whatever the
``eval_report``: the reward (each of the mix and its details) before → after, and the grid with its rows
named "before" and "after"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.training.reporting.report import (
    BEFORE_AFTER_GRID,
    BEFORE_AFTER_TABLE,
    ROW_LABEL_WIDTH,
    eval_report,
    reward_before_after_table,
)

JPEG = "eval/reward/jpeg_compressibility"


def _jpeg(kb: float) -> dict[str, float]:
    return {"eval/reward/mean": -kb / 500, f"{JPEG}/mean": -kb / 500, f"{JPEG}/jpeg_kb/mean": kb}


def test_the_table_sets_each_reward_and_detail_before_against_after():
    table = reward_before_after_table(_jpeg(1.6), _jpeg(1.2))
    assert table is not None
    rows = [line.split() for line in table.splitlines()]
    assert rows[0] == ["eval", "(test", "split)", "before", "→", "after", "(Δ)"]
    # −1.6/500 = −0.0032 → −1.2/500 = −0.0024, Δ +0.0008; the size 1.6 → 1.2 kB, Δ −0.4
    assert rows[1] == ["reward", "-0.0032", "→", "-0.0024", "(+0.0008)"]
    assert rows[2] == ["jpeg_compressibility", "-0.0032", "→", "-0.0024", "(+0.0008)"]
    assert rows[3] == ["jpeg_compressibility/jpeg_kb", "1.6", "→", "1.2", "(-0.4)"]
    assert reward_before_after_table({}, _jpeg(1.2)) is None  # no evaluation before


def _strip_has_text(strip: np.ndarray) -> bool:
    return bool((strip < 128).any())


def test_without_a_report_an_eval_before_run_writes_the_table_and_the_named_rows(tmp_path: Path):
    report = eval_report("none", tmp_path)
    before, middle, after = torch.zeros(3, 3, 8, 8), torch.full((3, 3, 8, 8), 0.5), torch.ones(3, 3, 8, 8)
    for epoch, images in ((-1, before), (0, middle), (1, after)):
        report.evaluated(epoch, images)
    report.write(_jpeg(1.6), _jpeg(1.2))
    assert (tmp_path / BEFORE_AFTER_TABLE).read_text() == reward_before_after_table(
        _jpeg(1.6), _jpeg(1.2)
    ) + "\n"
    grid = np.asarray(Image.open(tmp_path / BEFORE_AFTER_GRID).convert("L"))
    half = grid.shape[0] // 2
    tiles, strip = grid[:, ROW_LABEL_WIDTH:], grid[:, :ROW_LABEL_WIDTH]
    assert tiles.shape[1] == 3 * 8 * 2  # three samples a row, upscaled twice
    assert tiles[:half].max() == 0 and tiles[half:].min() == 255  # before on top, the last evaluation below
    assert _strip_has_text(strip[:half]) and _strip_has_text(strip[half:])  # each row named
    assert not np.array_equal(strip[:half], strip[half:])  # by different names


@pytest.mark.slow  # ≈ 35 s: a one-epoch tiny training evaluated before and after
def test_tiny_cpu_with_eval_before_writes_before_after_and_says_it(cli, tmp_path: Path):
    from tests.conftest import TINY_RUN

    code, out = cli(
        "train",
        *TINY_RUN,
        "epochs=1",
        "eval_every=1",
        "eval_before=true",
        "images_every=0",
        "save_every=0",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 0, out
    assert "evaluation before → after training" in out
    table = (tmp_path / BEFORE_AFTER_TABLE).read_text().splitlines()
    assert [row.split()[0] for row in table[1:]] == [
        "reward",
        "jpeg_compressibility",
        "jpeg_compressibility/jpeg_kb",
    ]
    assert (tmp_path / BEFORE_AFTER_GRID).is_file()
