"""Input files read as they are meant, or refused: a UTF-8 byte-order mark is not part of the first prompt
(in .txt and .jsonl alike); source images are read upright (EXIF orientation) and 16-bit / float pixels
keep their gray level instead of saturating; ``eval_heldout`` gets the source-image checks of
``data.test`` before any model loads."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.data import PromptDataset
from rlgen_cli.data.images import load_images
from rlgen_cli.data.paths import load_prompts
from rlgen_cli.errors import UserError
from rlgen_cli.tasks.prerequisites import data_problems

BOM = b"\xef\xbb\xbf"

# --- byte-order mark ------------------------------------------------------------------------------------


def test_a_bom_is_not_part_of_the_first_txt_prompt(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(BOM + b"a cat\na dog\n")
    assert [ex.prompt for ex in PromptDataset.from_file(path)] == ["a cat", "a dog"]


def test_a_bom_before_a_jsonl_is_read_like_the_txt_one(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    record = {"prompt": "a cat", "tag": "single_object"}
    path.write_bytes(BOM + (json.dumps(record) + "\n").encode())
    dataset = PromptDataset.from_file(path)
    assert [ex.prompt for ex in dataset] == ["a cat"] and dataset[0].metadata == record


def test_a_bom_file_that_is_not_utf8_names_the_byte_at_its_offset_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(BOM + b"a caf\xe9\n")  # latin-1 é at offset 8 of the file
    with pytest.raises(UserError, match=r"is not UTF-8 text \(byte 0xe9 at offset 8\)"):
        load_prompts(str(path), key="data.train")


# --- source images --------------------------------------------------------------------------------------


def test_16_bit_grayscale_keeps_its_gray_level(tmp_path: Path) -> None:
    path = tmp_path / "gray16.png"
    levels = np.array([[0, 32768], [65535, 257 * 100]], dtype=np.uint16)  # 257·k is exactly 8-bit k
    Image.fromarray(levels).save(path)
    assert Image.open(path).mode == "I;16"
    image = load_images([path], 2, 2)  # no resize: the pixels themselves
    assert torch.equal(image[0, 0] * 255, torch.tensor([[0.0, 128.0], [255.0, 100.0]]))
    assert torch.equal(image[0, 0], image[0, 1]) and torch.equal(image[0, 0], image[0, 2])


def test_float_pixels_in_0_1_keep_their_gray_level(tmp_path: Path) -> None:
    path = tmp_path / "gray.tiff"
    Image.fromarray(np.array([[0.0, 0.5], [1.0, 0.2]], dtype=np.float32)).save(path)
    assert Image.open(path).mode == "F"
    image = load_images([path], 2, 2)
    assert torch.equal(image[0, 0] * 255, torch.tensor([[0.0, 128.0], [255.0, 51.0]]))


def test_float_pixels_outside_0_1_are_refused_naming_the_file_and_mode(tmp_path: Path) -> None:
    path = tmp_path / "hdr.tiff"
    Image.fromarray(np.array([[0.0, 2.5]], dtype=np.float32)).save(path)
    with pytest.raises(UserError, match=rf"source image {path} has float pixels \(mode F\) in \[0, 2.5\]"):
        load_images([path], 2, 2)


def test_32_bit_integer_pixels_are_refused_naming_the_file_and_mode(tmp_path: Path) -> None:
    path = tmp_path / "int32.tiff"
    Image.fromarray(np.array([[0, 70000]], dtype=np.int32)).save(path)
    assert Image.open(path).mode == "I"
    with pytest.raises(UserError, match=rf"source image {path} has I pixels .* no fixed range"):
        load_images([path], 2, 2)


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    """Stored 16 wide × 8 tall, red left half, with orientation 6 (rotate 90° clockwise to show): shown
    8 wide × 16 tall with red on top, which is what a viewer and diffusers' load_image give."""
    stored = Image.new("RGB", (16, 8), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 8, 8))
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "photo.jpg"
    stored.save(path, exif=exif, quality=95)
    image = load_images([path], 16, 8)[0]
    red, blue = image[0], image[2]
    assert red[:8].mean() > 0.9 and blue[:8].mean() < 0.1  # top half red
    assert blue[8:].mean() > 0.9 and red[8:].mean() < 0.1  # bottom half blue


def test_8_bit_images_load_as_before(tmp_path: Path) -> None:
    path = tmp_path / "rgb.png"
    pixels = np.arange(2 * 2 * 3, dtype=np.uint8).reshape(2, 2, 3) * 20
    Image.fromarray(pixels).save(path)
    image = load_images([path], 2, 2)
    assert torch.equal(image[0].permute(1, 2, 0) * 255, torch.from_numpy(pixels).float())


# --- eval_heldout gets data.test's checks ----------------------------------------------------------------


def _cfg(family: str, tmp_path: Path, heldout: Path | None) -> SimpleNamespace:
    text = tmp_path / "text.txt"
    text.write_text("a red circle\n", encoding="utf-8")
    data = SimpleNamespace(train=str(text), test=str(text))
    return SimpleNamespace(
        data=data, model=SimpleNamespace(family=family), eval_heldout=heldout and str(heldout)
    )


def _edit_set(directory: Path, image: str) -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / "heldout.jsonl"
    path.write_text(json.dumps({"prompt": "make it blue", "image": image}) + "\n", encoding="utf-8")
    return path


def test_an_eval_heldout_with_source_images_is_refused_for_a_model_that_does_not_edit(tmp_path: Path) -> None:
    Image.new("RGB", (8, 8)).save(tmp_path / "src.png")
    problems = data_problems(
        _cfg("sd3", tmp_path, _edit_set(tmp_path, "src.png")), tmp_path, ("train", "test")
    )
    assert len(problems) == 1 and problems[0].startswith("eval_heldout: example 0 of "), problems
    assert "model.family=sd3 does not edit" in problems[0]


def test_an_eval_heldout_source_image_that_is_missing_is_named_before_training(tmp_path: Path) -> None:
    cfg = _cfg("flux_kontext", tmp_path, _edit_set(tmp_path, "gone.png"))
    cfg.data.train = cfg.data.test = str(_edit_set(tmp_path / "ok", "src.png"))
    Image.new("RGB", (8, 8)).save(tmp_path / "ok" / "src.png")
    problems = data_problems(cfg, tmp_path, ("train", "test"))
    assert problems == [
        f"eval_heldout: example 0 of {tmp_path / 'heldout.jsonl'} names source image {tmp_path / 'gone.png'}, "
        'which does not exist; paths in "image" are relative to the dataset file'
    ]


def test_an_unset_eval_heldout_is_not_read_and_a_listed_one_is_read_once(tmp_path: Path) -> None:
    assert data_problems(_cfg("sd3", tmp_path, None), tmp_path, ("train", "test")) == []
    missing = tmp_path / "gone.txt"
    problems = data_problems(_cfg("sd3", tmp_path, missing), tmp_path, ("train", "test", "eval_heldout"))
    assert len(problems) == 1 and problems[0].startswith(
        f"eval_heldout: prompt file {missing} does not exist"
    )


def test_a_vlm_question_image_is_read_upright_and_in_8_bits(tmp_path: Path) -> None:
    """The VLM rollout reads its question images through the same reader as source images."""
    from rlgen_cli.vlm.rollout import load_image

    stored = Image.new("RGB", (16, 8), (0, 0, 255))
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(tmp_path / "photo.jpg", exif=exif, quality=95)
    assert load_image(tmp_path / "photo.jpg").size == (8, 16)  # shown 8 wide × 16 tall
    Image.fromarray(np.full((4, 4), 32768, dtype=np.uint16)).save(tmp_path / "gray16.png")
    assert np.asarray(load_image(tmp_path / "gray16.png")).mean() == pytest.approx(128, abs=1)


@pytest.mark.parametrize("layout", ["jsonl", "json list"])
def test_vlm_and_r3_rows_files_may_start_with_a_bom(tmp_path: Path, layout: str) -> None:
    from rlgen_cli.r3.data import load_r3_dataset
    from rlgen_cli.vlm.data import read_rows

    row = {"prompt": "two cubes", "tag": "counting", "include": [{"class": "cube", "count": 2}]}
    text = json.dumps([row]) if layout == "json list" else json.dumps(row)
    (tmp_path / "rows.jsonl").write_text("\ufeff" + text + "\n", encoding="utf-8")
    assert read_rows(tmp_path / "rows.jsonl") == [row]
    if layout == "jsonl":
        assert [s.prompt for s in load_r3_dataset(tmp_path / "rows.jsonl", "geneval")] == ["two cubes"]
