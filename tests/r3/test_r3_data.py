"""R3 dataset loaders: the shipped tiny files, good and bad rows, errors that name file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlgen_cli.errors import UserError
from rlgen_cli.r3.data import DATASETS, R3Sample, load_r3_dataset, parse_r3_row
from rlgen_cli.rewards.judge_prompts import geneval_plus_checklist, tiif_questions

GENEVAL = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a red car"}
GENEVAL_PLUS = {
    "include": [{"class": "cat", "count": 1, "region": "left", "size": "larger"}],
    "exclude": [{"class": "cat", "count": 2}],
    "prompt": "a big cat on the left",
}
TIIF = {
    "type": "counting",
    "short_description": "two apples",
    "long_description": "Two green apples on a table.",
    "yn_question_list": ["Are there two apples?"],
    "yn_answer_list": ["yes"],
}


def _write(tmp_path: Path, rows: list, name: str = "data.jsonl") -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("name", "dataset", "size"),
    [
        ("r3_geneval_tiny.jsonl", "geneval", 6),
        ("r3_geneval_plus_tiny.jsonl", "geneval_plus", 5),
        ("r3_tiif_tiny.jsonl", "tiif", 5),
    ],
)
def test_builtin_tiny_files_load(name, dataset, size):
    samples = load_r3_dataset(f"builtin:{name}", dataset)
    assert len(samples) == size and [s.index for s in samples] == list(range(size))
    assert all(isinstance(s, R3Sample) and s.prompt and s.tag for s in samples)
    assert len({s.tag for s in samples}) == size  # one row per tag: per-tag metrics have something to show


def test_geneval_rows_keep_the_whole_row_as_metadata(tmp_path):
    path = _write(tmp_path, [GENEVAL, "", {**GENEVAL, "prompt": "  padded  "}])
    first, second = load_r3_dataset(path, "geneval")  # the blank line is skipped
    assert first == R3Sample("a red car", GENEVAL, "colors", 0)
    assert second.prompt == "padded" and second.index == 1


def test_geneval_plus_tag_is_optional_and_rows_feed_the_judge(tmp_path):
    (sample,) = load_r3_dataset(_write(tmp_path, [GENEVAL_PLUS]), "geneval_plus")
    assert sample.tag == "all"
    assert "larger 1 cat located in the left part" in geneval_plus_checklist(sample.metadata)
    plus_samples = load_r3_dataset("builtin:r3_geneval_plus_tiny.jsonl", "geneval_plus")
    assert all(
        geneval_plus_checklist(s.metadata).startswith("This image should contain:") for s in plus_samples
    )


def test_tiif_prompt_is_the_short_description_and_tag_the_type(tmp_path):
    (sample,) = load_r3_dataset(_write(tmp_path, [TIIF]), "tiif")
    assert (sample.prompt, sample.tag) == ("two apples", "counting")
    assert tiif_questions(sample.metadata) == (["Are there two apples?"], ["yes"])


def test_geneval_rows_satisfy_the_geneval_scorer():
    from rlgen_cli.geneval_rules import score_geneval

    for sample in load_r3_dataset("builtin:r3_geneval_tiny.jsonl", "geneval"):
        result = score_geneval([], sample.metadata, colors=lambda found, _cls: ["red"] * len(found))
        assert result.tag == sample.tag and result.score == 0.0  # nothing detected, nothing earned


@pytest.mark.parametrize(
    ("dataset", "row", "message"),
    [
        ("geneval", "{not json", "invalid JSON"),
        ("geneval", "[1, 2]", "expected a JSON object"),
        ("geneval", {**GENEVAL, "prompt": ""}, '"prompt"'),
        ("geneval", {k: v for k, v in GENEVAL.items() if k != "tag"}, '"tag"'),
        ("geneval", {**GENEVAL, "include": []}, '"include" must be a non-empty list'),
        ("geneval", {**GENEVAL, "include": [{"class": "car"}]}, '"count" >= 1'),
        ("geneval", {**GENEVAL, "include": [{"class": "car", "count": 0}]}, '"count" >= 1'),
        ("geneval", {**GENEVAL, "include": [{"class": "car", "count": True}]}, '"count" >= 1'),
        ("geneval", {**GENEVAL, "include": [{"count": 1}]}, '"class"'),
        ("geneval", {**GENEVAL, "include": [{"class": "car", "count": 1, "color": 3}]}, '"color"'),
        (
            "geneval",
            {**GENEVAL, "include": [{"class": "a", "count": 1, "position": ["left of", 0]}]},
            "earlier",
        ),
        (
            "geneval",
            {
                **GENEVAL,
                "include": [{"class": "a", "count": 1}, {"class": "b", "count": 1, "position": ["near", 0]}],
            },
            "relation",
        ),
        ("geneval", {**GENEVAL, "exclude": [{"class": "car"}]}, "exclude"),
        (
            "geneval_plus",
            {**GENEVAL_PLUS, "include": [{"class": "cat", "count": 1, "region": "top"}]},
            '"region"',
        ),
        (
            "geneval_plus",
            {**GENEVAL_PLUS, "include": [{"class": "cat", "count": 1, "size": "huge"}]},
            '"size"',
        ),
        ("tiif", {k: v for k, v in TIIF.items() if k != "short_description"}, '"short_description"'),
        ("tiif", {k: v for k, v in TIIF.items() if k != "type"}, '"type"'),
        ("tiif", {**TIIF, "yn_answer_list": []}, "yn_answer_list"),
        ("tiif", {**TIIF, "yn_answer_list": ["perhaps"]}, "yes"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, dataset, row, message):
    good = {"geneval": GENEVAL, "geneval_plus": GENEVAL_PLUS, "tiif": TIIF}[dataset]
    path = _write(tmp_path, [good, "", row])
    with pytest.raises(UserError, match=message) as err:
        load_r3_dataset(path, dataset)
    assert f"{path}:3:" in str(err.value) and dataset in str(err.value)


def test_unknown_dataset_missing_and_empty_files(tmp_path):
    with pytest.raises(UserError, match="geneval, geneval_plus, tiif"):
        load_r3_dataset("builtin:r3_geneval_tiny.jsonl", "geneval_pp")
    with pytest.raises(UserError, match="does not exist"):
        load_r3_dataset(tmp_path / "missing.jsonl", "tiif")
    with pytest.raises(UserError, match="no built-in prompt file"):
        load_r3_dataset("builtin:nope.jsonl", "tiif")
    with pytest.raises(UserError, match="empty"):
        load_r3_dataset(_write(tmp_path, ["", "  "]), "geneval")
    assert DATASETS == ("geneval", "geneval_plus", "tiif")


def test_wrong_dataset_for_a_file_fails_on_the_first_row():
    with pytest.raises(UserError, match=r"r3_geneval_tiny\.jsonl:1: .*short_description"):
        load_r3_dataset("builtin:r3_geneval_tiny.jsonl", "tiif")


def test_parse_r3_row_directly():
    sample = parse_r3_row(json.dumps(TIIF), "tiif", index=4)
    assert sample.index == 4 and sample.metadata == TIIF
