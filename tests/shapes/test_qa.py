"""ShapesQA data: deterministic, answers the rule reads from the scene, R1-VL chains the rewards accept,
disjoint splits, held-out combinations only in the held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlgen_cli.rewards.r1vl import answer_accuracy, step_rar, step_rvr
from rlgen_cli.shapes.detect import ShapeDetector
from rlgen_cli.shapes.qa import (
    QUESTION_TYPES,
    answer_of,
    build_split,
    chain_of,
    is_heldout,
    key_step,
    make_question,
    row_of,
)
from rlgen_cli.shapes.vocab import HELDOUT_COLOR_SHAPES, HELDOUT_RELATIONS
from rlgen_cli.vlm.data import load_sft, load_vlm_examples

SHIPPED = Path(__file__).resolve().parents[2] / "rlgen_cli" / "assets" / "vlm" / "shapesqa"


@pytest.fixture(scope="module")
def splits() -> dict[str, list]:
    return {name: build_split(name, 60) for name in ("train", "test", "heldout")}


def test_the_same_seed_gives_the_same_question_and_scene() -> None:
    for kind in QUESTION_TYPES:
        a, b = make_question(kind, 17), make_question(kind, 17)
        assert (a.text, a.objects) == (b.text, b.objects)
        np.testing.assert_array_equal(a.image, b.image)
    assert make_question("count", 17).objects != make_question("count", 18).objects


def test_an_unknown_question_type_is_refused() -> None:
    with pytest.raises(ValueError, match="count, colour, relation"):
        make_question("size", 0)


def test_answers_agree_with_what_the_detector_reads_from_the_pixels(splits) -> None:
    """The rule reads the placed objects; the ShapesEval detector reads the pixels: they must agree."""
    for question in splits["test"]:
        pixels = torch.from_numpy(question.image).permute(2, 0, 1)[None].float() / 255
        seen = [(o.label, o.color) for o in ShapeDetector().detect(pixels)[0]]
        found = sorted(seen)
        assert found == sorted((o.shape, o.color) for o in question.objects)
        if question.kind == "count":
            colour, shape = question.subject
            assert question.answer == str(seen.count((shape, colour)))
        if question.kind == "colour":
            assert question.answer == next(c for s, c in seen if s == question.subject[0])


def test_a_relation_answer_follows_the_boxes_by_hand() -> None:
    """A yes is a scene where the asked relation holds along its axis; moving the subject across flips it."""
    question = next(q for q in build_split("test", 30) if q.kind == "relation")
    a, relation, b = question.subject
    ox = {o.shape: o for o in question.objects}
    centre = {s: ((o.box[0] + o.box[2]) / 2, (o.box[1] + o.box[3]) / 2) for s, o in ox.items()}
    axis, sign = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}[relation]
    holds = sign * (centre[a][axis] - centre[b][axis]) > 0
    assert question.answer == ("yes" if holds else "no")


def test_the_chain_earns_the_whole_r1vl_reward_and_a_wrong_answer_loses_accuracy(splits) -> None:
    for question in splits["train"][:12]:
        chain, row = chain_of(question), row_of(question, "x.png")
        assert answer_accuracy(chain, row["solution"], backend="normalizer") == 1.0
        assert step_rvr(chain, mode="strict") == 1.0
        assert step_rar(chain, row["key_steps"], scale=0.1) == pytest.approx(0.1)
        wrong = "7" if question.kind == "count" else "maybe"
        broken = chain.replace(f"is: {question.answer}", f"is: {wrong}")
        assert answer_accuracy(broken, row["solution"], backend="normalizer") == 0.0
        assert key_step(question) in chain.lower()


def test_splits_are_disjoint_and_balanced(splits) -> None:
    def keys(questions):
        return {(q.text, q.image.tobytes()) for q in questions}

    assert not keys(splits["train"]) & keys(splits["test"])
    assert not keys(splits["train"]) & keys(splits["heldout"])
    assert not keys(splits["test"]) & keys(splits["heldout"])
    for questions in splits.values():
        assert [q.kind for q in questions[:3]] == list(QUESTION_TYPES)
        assert {q.kind for q in questions} == set(QUESTION_TYPES)


def test_heldout_combinations_appear_only_in_the_heldout_split(splits) -> None:
    for name in ("train", "test"):
        for question in splits[name]:
            assert not is_heldout(question)
            assert not any((o.color, o.shape) in HELDOUT_COLOR_SHAPES for o in question.objects)
            if question.kind == "relation":
                assert question.subject not in HELDOUT_RELATIONS
    assert all(is_heldout(q) for q in splits["heldout"])


def test_the_shipped_files_are_what_the_generator_writes() -> None:
    """The assets load through the VLM data readers and match a fresh generation row for row."""
    train = load_vlm_examples(str(SHIPPED / "train.json"))
    test = load_vlm_examples(str(SHIPPED / "test.jsonl"))
    heldout = load_vlm_examples(str(SHIPPED / "heldout.jsonl"))
    sft = load_sft(str(SHIPPED / "sft.jsonl"))
    assert (len(train), len(test), len(heldout), len(sft)) == (480, 150, 90, 480)
    fresh = build_split("test", 6)
    shipped_rows = [json.loads(line) for line in (SHIPPED / "test.jsonl").read_text().splitlines()[:6]]
    assert shipped_rows == [row_of(q, f"images/test_{i:04d}.png") for i, q in enumerate(fresh)]
    assert {ex.category for ex in test} == set(QUESTION_TYPES)
    assert all(answer_of(q) == row["solution"] for q, row in zip(fresh, shipped_rows, strict=True))
