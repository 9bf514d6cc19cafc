"""Behaviour of prompt-file parsing and the distributed group sampler."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from rlgen_cli.data import GroupSampler, PromptDataset, PromptExample

# --- PromptDataset ------------------------------------------------------------------------------


def test_txt_strips_whitespace_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text('  a cat  \n\n\t\na dog\nA "SALE" sign\n', encoding="utf-8")
    ds = PromptDataset.from_file(path)
    assert len(ds) == 3
    assert [ex.prompt for ex in ds] == ["a cat", "a dog", 'A "SALE" sign']
    assert ds[1] == PromptExample(index=1, prompt="a dog", metadata={})
    assert ds[-1].index == 2 and [ex.index for ex in ds[0:2]] == [0, 1]


def test_jsonl_geneval_keeps_metadata_and_index(tmp_path: Path) -> None:
    records = [
        {"tag": "counting", "include": [{"class": "cat", "count": 2}], "prompt": "a photo of two cats"},
        {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a red car"},
    ]
    path = tmp_path / "geneval.jsonl"
    path.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n", encoding="utf-8")
    ds = PromptDataset.from_file(str(path))
    assert [ex.prompt for ex in ds] == ["a photo of two cats", "a red car"]
    assert ds[1].metadata == records[1] and ds[1].index == 1


def test_duplicate_prompts_stay_distinct_groups() -> None:
    ds = PromptDataset.from_prompts(["same", "same"])
    assert [ex.index for ex in ds] == [0, 1]


@pytest.mark.parametrize(
    ("lines", "lineno", "problem"),
    [
        (['{"prompt": "ok"}', '{"prompt": "broken"'], 2, "invalid JSON"),
        (['{"prompt": "ok"}', "", '{"tag": "x"}'], 3, "missing prompt"),
        (['["a list"]'], 1, "expected a JSON object"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, lines: list[str], lineno: int, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=problem) as info:
        PromptDataset.from_file(path)
    assert f"{path}:{lineno}:" in str(info.value)


def test_empty_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty") as info:
        PromptDataset.from_file(path)
    assert str(path) in str(info.value)


def test_missing_file_and_bad_suffix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        PromptDataset.from_file(missing)
    csv = tmp_path / "prompts.csv"
    csv.write_text("a\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'\.csv'"):
        PromptDataset.from_file(csv)


def _tagged(tmp_path: Path) -> PromptDataset:
    rows = [("a", "single_object"), ("b", "counting"), ("c", "two_object"), ("d", "counting")]
    path = tmp_path / "tagged.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "tag": t}) + "\n" for p, t in rows))
    return PromptDataset.from_file(path)


def test_repeated_by_tag_copies_each_tagged_prompt_and_reindexes(tmp_path: Path) -> None:
    data = _tagged(tmp_path)
    assert data.repeated_by_tag({}) is data
    out = data.repeated_by_tag({"counting": 3, "single_object": 0})
    assert [e.prompt for e in out] == ["b", "b", "b", "c", "d", "d", "d"]  # file order, copies in a row
    assert [e.index for e in out] == list(range(7))  # each copy its own group
    assert out[0].metadata == {"prompt": "b", "tag": "counting"}
    # a pass over the expanded set visits counting prompts 3× as often as two_object ones
    sampler = GroupSampler(len(out), prompts_per_step=7, group_size=1, seed=0)
    assert Counter(out[i].metadata["tag"] for i in sampler.prompt_indices_for_epoch(0)) == {
        "counting": 6,
        "two_object": 1,
    }


@pytest.mark.parametrize(
    ("repeats", "match"),
    [
        (
            {"colors": 2},
            "no prompt of .* carries; its tags are \\['counting', 'single_object', 'two_object'\\]",
        ),
        ({"counting": -1}, "whole number of copies"),
        ({"counting": 1.5}, "whole number of copies"),
        ({"counting": 0, "single_object": 0, "two_object": 0}, "leaves no prompt"),
    ],
)
def test_repeated_by_tag_errors(tmp_path: Path, repeats: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _tagged(tmp_path).repeated_by_tag(repeats)


def test_repeated_by_tag_needs_tags(tmp_path: Path) -> None:
    path = tmp_path / "plain.txt"
    path.write_text("a\nb\n")
    with pytest.raises(ValueError, match="GenEval .jsonl prompts carry a tag"):
        PromptDataset.from_file(path).repeated_by_tag({"counting": 2})


def test_from_prompts_validation() -> None:
    with pytest.raises(ValueError, match="empty"):
        PromptDataset.from_prompts([])
    with pytest.raises(TypeError, match="single string"):
        PromptDataset.from_prompts("abc")
    with pytest.raises(TypeError, match="prompt 1 is a int"):
        PromptDataset.from_prompts(["a", 3])  # type: ignore[list-item]


# --- GroupSampler -------------------------------------------------------------------------------


def _groups(indices: list[int], k: int) -> list[list[int]]:
    return [indices[i : i + k] for i in range(0, len(indices), k)]


def test_each_prompt_repeated_group_size_times_consecutively() -> None:
    sampler = GroupSampler(dataset_size=10, prompts_per_step=4, group_size=3, seed=1)
    indices = sampler.global_indices_for_epoch(0)
    assert len(indices) == 12
    groups = _groups(indices, 3)
    assert all(len(set(g)) == 1 for g in groups)
    assert len({g[0] for g in groups}) == 4
    assert all(0 <= i < 10 for i in indices)


def test_deterministic_per_seed_and_epoch_and_varies_across_epochs() -> None:
    a = GroupSampler(20, 4, 2, seed=7)
    b = GroupSampler(20, 4, 2, seed=7)
    assert a.global_indices_for_epoch(3) == b.global_indices_for_epoch(3)
    # order of calls does not matter: a pure function of (seed, epoch)
    b.global_indices_for_epoch(9)
    assert a.global_indices_for_epoch(9) == b.global_indices_for_epoch(9)
    assert a.global_indices_for_epoch(0) != a.global_indices_for_epoch(1)
    assert GroupSampler(20, 4, 2, seed=8).global_indices_for_epoch(0) != a.global_indices_for_epoch(0)


def test_covers_every_prompt_once_per_pass() -> None:
    sampler = GroupSampler(dataset_size=12, prompts_per_step=4, group_size=2, seed=0)
    passes = []
    for first_epoch in (0, 3):  # 12 / 4 = 3 epochs per pass
        prompts = [
            p for e in range(first_epoch, first_epoch + 3) for p in sampler.prompt_indices_for_epoch(e)
        ]
        assert sorted(prompts) == list(range(12))
        passes.append(prompts)
    assert passes[0] != passes[1]  # a fresh permutation on wrap-around


def test_wraps_across_passes_when_not_divisible() -> None:
    sampler = GroupSampler(dataset_size=5, prompts_per_step=3, group_size=1, seed=0)
    stream = [p for e in range(10) for p in sampler.prompt_indices_for_epoch(e)]  # 30 = 6 passes
    assert all(sorted(stream[i : i + 5]) == list(range(5)) for i in range(0, 30, 5))
    assert Counter(stream) == Counter({i: 6 for i in range(5)})


def test_replica_slices_concatenate_to_global_batch() -> None:
    single = GroupSampler(16, 4, 3, seed=5)
    ranks = [GroupSampler(16, 4, 3, seed=5, num_replicas=2, rank=r) for r in range(2)]
    for epoch in (0, 1, 6):
        parts = [s.indices_for_epoch(epoch) for s in ranks]
        assert all(len(p) == 6 for p in parts)
        assert parts[0] + parts[1] == single.indices_for_epoch(epoch) == single.batch(epoch)


def test_set_epoch_drives_iteration() -> None:
    sampler = GroupSampler(8, 2, 2, seed=0, num_replicas=2, rank=1)
    sampler.set_epoch(5)
    assert list(sampler) == [sampler.indices_for_epoch(5)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset_size": 10, "prompts_per_step": 3, "group_size": 3, "num_replicas": 2}, "not divisible"),
        ({"dataset_size": 0, "prompts_per_step": 1, "group_size": 1}, "dataset_size"),
        ({"dataset_size": 4, "prompts_per_step": 2, "group_size": 0}, "group_size"),
        ({"dataset_size": 4, "prompts_per_step": 2, "group_size": 2, "num_replicas": 2, "rank": 2}, "rank"),
    ],
)
def test_bad_configuration_raises(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GroupSampler(**kwargs)


def test_state_dict_round_trip_and_validation() -> None:
    sampler = GroupSampler(10, 2, 4, seed=3)
    sampler.set_epoch(7)
    resumed = GroupSampler(10, 2, 4, seed=3, num_replicas=2, rank=0)  # replica count may change
    resumed.load_state_dict(sampler.state_dict())
    assert resumed.epoch == 7
    assert resumed.global_indices_for_epoch(7) == sampler.global_indices_for_epoch(7)
    with pytest.raises(ValueError, match=r"seed differs .*4 now, 3 saved"):
        GroupSampler(10, 2, 4, seed=4).load_state_dict(sampler.state_dict())
