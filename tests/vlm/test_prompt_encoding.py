"""encode_prompts encodes each distinct (prompt, image) of a batch once and lays the result out by row:
the tensors must equal the processor's own encoding of every row, for each Qwen-VL family."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.models.helpers import CPU, model_cfg

FAMILIES = {"qwen2_vl": "tiny_qwen2_vl", "qwen2_5_vl": "tiny_qwen2_vl", "qwen3_vl": "tiny_qwen3_vl"}
LAYOUT = [0, 0, 1, 1, 0, 2, 2, 1]
"""Examples per row: groups of copies, a prompt coming back later, prompts of different lengths."""


@pytest.fixture(scope="module")
def built() -> dict[str, object]:
    return {}


def _policy(built: dict, family: str):
    if family not in built:
        from rlgen_cli.vlm.policy import build_vlm

        built[family] = build_vlm(dataclasses.replace(model_cfg(FAMILIES[family]), family=family), CPU)
    return built[family]


def _rows(policy):
    from rlgen_cli.vlm.data import load_vlm_examples, prompt_text
    from rlgen_cli.vlm.rollout import load_images

    examples = load_vlm_examples("builtin:tiny_r1vl.json")[:3]
    vlm = policy.cfg.vlm
    texts = [prompt_text(policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in examples]
    return [texts[k] for k in LAYOUT], load_images([examples[k].image for k in LAYOUT])


def _processor_encoding(policy, prompts, images) -> dict[str, torch.Tensor]:
    policy.tokenizer.padding_side = "left"
    present = [image for image in images if image is not None] or None
    return dict(policy.processor(text=prompts, images=present, return_tensors="pt", padding=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_repeated_prompts_encode_as_the_processor_encodes_every_row(built, family):
    from rlgen_cli.vlm.rollout import distinct_rows, encode_prompts

    policy = _policy(built, family)
    prompts, images = _rows(policy)
    assert distinct_rows(prompts, images) == (LAYOUT, [0, 2, 5])  # three encodings instead of eight
    ours = encode_prompts(policy, prompts, images)
    theirs = _processor_encoding(policy, prompts, images)
    assert sorted(ours) == sorted(theirs) and "pixel_values" in ours
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_text_only_prompts_encode_alike(built):
    from rlgen_cli.vlm.rollout import encode_prompts

    policy = _policy(built, "qwen2_vl")
    texts = ["how many?", "what colour is the small square on the left?", "is it round?"]
    prompts, images = [texts[k] for k in LAYOUT], [None] * len(LAYOUT)
    ours = encode_prompts(policy, prompts, images)
    theirs = _processor_encoding(policy, prompts, images)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_equal_images_loaded_apart_stay_distinct_rows():
    """Rows share an encoding only when they share the image object (load_images gives a path's rows
    one): two loads of equal pixels are two rows, so nothing is merged on a guess."""
    from PIL import Image

    from rlgen_cli.vlm.rollout import distinct_rows

    one, other = Image.new("RGB", (4, 4)), Image.new("RGB", (4, 4))
    assert distinct_rows(["p", "p", "p"], [one, other, one]) == ([0, 1, 0], [0, 1])
    assert distinct_rows(["p", "q"], [one, one]) == ([0, 1], [0, 1])


def test_an_output_of_another_processor_is_refused_rather_than_guessed():
    from rlgen_cli.vlm.rollout import repeated_rows

    with pytest.raises(ValueError, match="video_grid_thw"):
        repeated_rows({"input_ids": torch.zeros(2, 3), "video_grid_thw": torch.ones(1, 3)}, [0, 1, 0])


def test_load_images_reads_each_file_once(tmp_path, monkeypatch):
    from PIL import Image

    from rlgen_cli.vlm import rollout

    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path in paths:
        Image.new("RGB", (4, 4)).save(path)
    reads = []
    monkeypatch.setattr(rollout, "load_image", lambda path: reads.append(path) or Image.open(path))
    images = rollout.load_images([paths[0], paths[0], None, paths[1], paths[0]])
    assert reads == paths  # one read per file
    assert images[0] is images[1] is images[4] and images[2] is None and images[3] is not images[0]
