"""Prompt universe, splits (balance, held-out disjointness) and the shipped files."""

from __future__ import annotations

from collections import Counter

import pytest

from rlgen_cli.data.paths import load_prompts
from rlgen_cli.shapes.prompts import SplitConfig, build_splits, is_heldout, prompt_universe, read_jsonl
from rlgen_cli.shapes.vocab import HELDOUT_COLOR_SHAPES, HELDOUT_RELATIONS, TAGS

SPLITS = build_splits()


def test_universe_sizes_and_geneval_format():
    universe = prompt_universe()
    # 3 shapes; 3·2 ordered pairs; 3 shapes × counts 2–4; 6 colours × 3; 6 pairs × 4 relations; 6 pairs × 6·5.
    assert {t: len(v) for t, v in universe.items()} == dict(zip(TAGS, (3, 6, 9, 18, 24, 180)))
    counting = universe["counting"][0]
    assert counting == {
        "tag": "counting",
        "include": [{"class": "circle", "count": 2}],
        "exclude": [{"class": "circle", "count": 3}],
        "prompt": "a photo of two circles",
    }
    position = universe["position"][0]
    assert position["prompt"] == "a photo of a circle left of a square"
    assert position["include"] == [
        {"class": "square", "count": 1},
        {"class": "circle", "count": 1, "position": ["left of", 0]},
    ]
    assert universe["color_attr"][0]["prompt"] == "a photo of a red circle and a yellow square"


def test_heldout_classification():
    assert is_heldout({"include": [{"class": "circle", "count": 1, "color": "purple"}]})
    assert not is_heldout({"include": [{"class": "circle", "count": 1, "color": "red"}]})
    include = [{"class": "triangle", "count": 1}, {"class": "circle", "count": 1, "position": ["left of", 0]}]
    assert is_heldout({"include": include}) and ("circle", "left of", "triangle") in HELDOUT_RELATIONS


def test_splits_are_balanced_and_interleaved():
    config = SplitConfig()
    assert Counter(m["tag"] for m in SPLITS["train"]) == dict.fromkeys(TAGS, config.train_per_tag)
    assert Counter(m["tag"] for m in SPLITS["test"]) == dict.fromkeys(TAGS, config.test_per_tag)
    assert Counter(m["tag"] for m in SPLITS["heldout"]) == dict.fromkeys(
        ("colors", "position", "color_attr"), config.heldout_per_tag
    )
    assert [m["tag"] for m in SPLITS["test"][:12]] == list(TAGS) * 2  # any prefix is balanced


def test_heldout_combinations_never_reach_train_or_test():
    prompts = {split: {m["prompt"] for m in rows} for split, rows in SPLITS.items()}
    assert not prompts["heldout"] & (prompts["train"] | prompts["test"])
    assert all(is_heldout(m) for m in SPLITS["heldout"]) and not any(is_heldout(m) for m in SPLITS["train"])
    named = {(c.get("color"), c["class"]) for m in SPLITS["train"] + SPLITS["test"] for c in m["include"]}
    assert not named & HELDOUT_COLOR_SHAPES
    # every held-out combination is in the heldout split
    held = {
        m["prompt"]
        for tag in ("colors", "position", "color_attr")
        for m in prompt_universe()[tag]
        if is_heldout(m)
    }
    assert held == prompts["heldout"] and len(held) == 3 + 4 + 54


def test_color_attr_test_combinations_are_unseen_in_train():
    train = {m["prompt"] for m in SPLITS["train"] if m["tag"] == "color_attr"}
    test = {m["prompt"] for m in SPLITS["test"] if m["tag"] == "color_attr"}
    assert len(train) == 101 and len(test) == 25 and not train & test  # 126 seen combinations, 20 % test


def test_splits_are_deterministic_and_seeded():
    assert build_splits() == SPLITS
    assert build_splits(SplitConfig(seed=1))["train"] != SPLITS["train"]
    with pytest.raises(ValueError, match="test_fraction"):
        build_splits(SplitConfig(test_fraction=1.0))


@pytest.mark.parametrize("split", ["train", "test", "heldout"])
def test_shipped_files_match_the_generator(split):
    path = f"builtin:shapes_{split}.jsonl"
    dataset = load_prompts(path)
    assert [dict(ex.metadata) for ex in dataset] == SPLITS[split], (
        "shipped ShapesEval prompts are stale: python -m rlgen_cli.shapes.build rlgen_cli/assets/prompts --prefix shapes_"
    )
    assert read_jsonl(dataset.source) == SPLITS[split]
