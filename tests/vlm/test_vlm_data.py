"""VLM data: R1-VL-10K rows, MathVista-style eval rows, ShareGPT SFT with the reflection filter."""

from __future__ import annotations

import json

import pytest

from rlgen_cli.errors import UserError
from rlgen_cli.schema.vlm import REFLECTION_MARKERS
from rlgen_cli.vlm.data import build_messages, drop_reflective, load_sft, load_vlm_examples


def test_r1vl_rows_normalise_key_steps_and_resolve_images():
    examples = load_vlm_examples("builtin:tiny_r1vl.json")
    assert len(examples) == 8 and all(ex.image.is_file() for ex in examples)
    first = examples[0]
    assert first.metadata["key_steps"] == [["red squares", "squares are red"], ["1 squares"]]
    assert first.metadata["solution"] == "### The final answer is: 1"


def test_mathvista_rows_have_categories():
    examples = load_vlm_examples("builtin:tiny_mathvista.jsonl")
    assert {ex.category for ex in examples} == {"counting", "colour"}
    assert examples[1].solution == "green" and examples[1].metadata["key_steps"] == []


def test_sharegpt_images_become_parts_and_reflective_samples_drop():
    examples = load_sft("builtin:tiny_sft.jsonl")
    assert examples[0].messages[0]["content"][0] == {"type": "image"}
    kept, dropped = drop_reflective(examples, REFLECTION_MARKERS)
    assert (len(kept), dropped) == (7, 1)
    assert drop_reflective(examples, []) == (examples, 0)


def test_bad_rows_fail_with_file_and_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"problem": "q", "solution": "1", "image_path": "missing.png"}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl, row 0: image 'missing.png' not found"):
        load_vlm_examples(str(path))
    path.write_text(json.dumps({"problem": "q"}) + "\n")
    with pytest.raises(UserError, match="no solution / answer field"):
        load_vlm_examples(str(path))
    path.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "<image>q"}, {"role": "assistant", "content": "a"}]}
        )
        + "\n"
    )
    with pytest.raises(UserError, match="1 <image> placeholders but 0 images"):
        load_sft(str(path))
    with pytest.raises(UserError, match="no built-in VLM data file"):
        load_vlm_examples("builtin:nope.json")


def test_mulberry_prompt_format():
    plain = build_messages("Q?", True, "plain", None)
    assert plain == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]}]
    mulberry = build_messages("Q?", False, "mulberry", "sys")
    assert mulberry[0] == {"role": "system", "content": "sys"}
    assert "### The final answer is:" in mulberry[1]["content"][0]["text"]
    assert mulberry[1]["content"][0]["text"].endswith("Q?")


def test_key_steps_stored_as_json_text_load_as_groups_and_bad_text_names_the_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    steps = {"Steps": ["red squares", ["one square", "1 square"]]}
    path.write_text(json.dumps({"problem": "q", "solution": "1", "key_steps": json.dumps(steps)}) + "\n")
    (example,) = load_vlm_examples(str(path))
    assert example.metadata["key_steps"] == [["red squares"], ["one square", "1 square"]]
    path.write_text(json.dumps({"problem": "q", "solution": "1", "key_steps": "red squares"}) + "\n")
    with pytest.raises(UserError, match=r"rows.jsonl, row 0: key_steps is a string, not JSON"):
        load_vlm_examples(str(path))


def test_a_non_utf8_file_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        json.dumps({"problem": "caf\u00e9", "solution": "1"}, ensure_ascii=False).encode("latin-1") + b"\n"
    )
    with pytest.raises(UserError, match=r"latin1.jsonl is not UTF-8 text \(byte 0xe9"):
        load_vlm_examples(str(path))
