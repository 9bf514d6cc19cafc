"""Prompt files the configs point at: the missing-file message, and the tiny editing set generated in a run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.data.edit_sets import SPLIT_SIZES, tiny_edit_set
from rlgen_cli.data.paths import load_prompts, resolve_data_path
from rlgen_cli.errors import UserError
from rlgen_cli.shapes.detect import ShapeDetector


def test_a_missing_upstream_file_names_the_layout_and_the_override(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        resolve_data_path("dataset/geneval/test_metadata.jsonl", "data.test")
    message = str(err.value)
    assert message.startswith(
        f"data.test: prompt file dataset/geneval/test_metadata.jsonl does not exist (looked at "
        f"{tmp_path}/dataset/geneval/test_metadata.jsonl)."
    )
    assert (
        "Flow-GRPO's repository (github.com/yifan123/flow_grpo): put its dataset/geneval/ folder under"
        in message
    )
    assert 'JSON lines, one object per line with a "prompt"' in message
    assert message.endswith(
        "To use another file: data.test=/path/to/test_metadata.jsonl (data.train=… likewise)."
    )


def test_a_missing_file_of_my_own_gets_no_upstream_story(tmp_path: Path):
    with pytest.raises(UserError) as err:
        resolve_data_path(str(tmp_path / "mine.txt"), "data.train")
    assert "upstream" not in str(err.value) and "Flow-GRPO" not in str(err.value)
    assert "plain text, one prompt per line" in str(err.value)


def test_a_generated_set_needs_a_run_directory():
    with pytest.raises(UserError, match="generated in a run directory"):
        resolve_data_path("builtin:tiny_edit_train.jsonl")


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory) -> Path:
    return tiny_edit_set(tmp_path_factory.mktemp("run"))


def test_the_tiny_editing_set_has_a_source_image_per_row(edit_dir: Path):
    for name, size in SPLIT_SIZES.items():
        dataset = load_prompts(f"builtin:{name}", edit_dir.parent, "data.train")
        assert len(dataset) == size
        for example in dataset:
            assert example.metadata["tag"] in ("counting", "colors")
            with Image.open(edit_dir / example.metadata["image"]) as image:
                assert image.size == (32, 32) and image.mode == "RGB"


def test_each_source_image_shows_what_its_source_prompt_says(edit_dir: Path):
    """The ShapesEval detector reads back the count, shape and colour that ``source_prompt`` names."""
    words = {"a": 1, "one": 1, "two": 2, "three": 3}
    detector = ShapeDetector()
    rows = [json.loads(line) for line in (edit_dir / "tiny_edit_train.jsonl").read_text().splitlines()]
    for row in rows:
        count, color, shape = row["source_prompt"].split()
        pixels = np.asarray(Image.open(edit_dir / row["image"]), dtype=np.float32) / 255.0
        (found,) = detector.detect(torch.from_numpy(pixels).permute(2, 0, 1)[None])
        assert len(found) == words[count], row
        assert all(d.label == shape.rstrip("s") and d.color == color for d in found), row


def test_the_set_is_written_once_and_reused(edit_dir: Path):
    path = edit_dir / "tiny_edit_test.jsonl"
    before = (path.stat().st_mtime_ns, path.read_text())
    assert tiny_edit_set(edit_dir.parent) == edit_dir
    assert (path.stat().st_mtime_ns, path.read_text()) == before
    assert not [p for p in edit_dir.parent.iterdir() if p.name.startswith(".tiny_edit-")]  # no staging left
