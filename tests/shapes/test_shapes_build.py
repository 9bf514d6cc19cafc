"""``python -m rlgen_cli.shapes.build``: split files, ground-truth PNGs and the self-check summary."""

from __future__ import annotations

import logging

import numpy as np
from PIL import Image

from rlgen_cli.shapes.build import main, scene_seed
from rlgen_cli.shapes.prompts import SplitConfig, build_splits, read_jsonl
from rlgen_cli.shapes.render import render


def test_build_writes_splits_and_images(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rlgen_cli.shapes.build")
    sizes = ["--train-per-tag", "2", "--test-per-tag", "1", "--heldout-per-tag", "1"]
    args = [str(tmp_path), "--images", *sizes]
    assert main(args) == 0
    splits = build_splits(SplitConfig(2, 1, 1))
    for split, rows in splits.items():
        assert read_jsonl(tmp_path / f"{split}.jsonl") == rows
        pngs = sorted((tmp_path / "images" / split).glob("*.png"))
        assert len(pngs) == len(rows)
    first = np.asarray(Image.open(tmp_path / "images" / "test" / "00000.png"))
    expected = render(splits["test"][0], scene_seed("test", 0))[0].permute(1, 2, 0).numpy()
    assert np.array_equal(first, (expected * 255).round().astype(np.uint8))
    assert caplog.text.count("detector strict accuracy 1.0000") == 3


def test_scene_seeds_differ_across_splits():
    seeds = {scene_seed(s, i) for s in ("train", "test", "heldout") for i in range(1000)}
    assert len(seeds) == 3000
