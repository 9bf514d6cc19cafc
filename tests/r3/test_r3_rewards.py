"""R3 reward logic on hand-made cases: format checks, stage rewards, masked per-track advantages."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.r3.rewards import (
    NO_EDIT,
    extract_instruction,
    extract_plan,
    format_ok,
    is_no_edit,
    reason_rewards,
    refine_rewards,
    track_advantages,
    track_advantages_with_stats,
)


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ------------------------------------------------------------------------------------------ format
@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("<think>a red car, centred</think>", True),
        ("  \n<think>\nmulti\nline plan\n</think>\n ", True),  # whitespace around is stripped
        ("<think></think>", True),
        ("<think>plan</think> and more", False),  # nothing may follow the block
        ("plan only", False),
        ("<think>unclosed plan", False),
        ("prefix <think>plan</think>", False),
        ("<think>a</think><think>b</think>", False),  # exactly one block
        ("<think>a <think>nested</think>", False),
        ("", False),
    ],
)
def test_reason_format(text, ok):
    assert format_ok(text, "reason") is ok


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("<think>the car is blue</think>Make the car red.", True),
        ("<think>fine</think>\nno further edit needed", True),
        ("<think>x</think>", False),  # no instruction
        ("<think>x</think>   \n", False),
        ("Make the car red.", False),  # no reasoning
        ("<think>x</think>edit</think>", False),
        ("<think>x</think>edit <think>more</think>", False),
    ],
)
def test_reflect_format(text, ok):
    assert format_ok(text, "reflect") is ok


def test_unknown_stage_is_named():
    with pytest.raises(ValueError, match="reason, reflect"):
        format_ok("<think>x</think>", "refine")


def test_extract_plan_and_instruction():
    assert extract_plan(" <think> two dogs on the left </think>") == "two dogs on the left"
    assert extract_plan("<think>cut off by the token limit") == "cut off by the token limit"
    assert extract_plan("no tags at all") == "no tags at all"
    assert extract_instruction("<think>a</think> Add a cat. ") == "Add a cat."
    assert extract_instruction("<think>a</think>x</think>last") == "last"  # after the last </think>
    assert extract_instruction("<think>reasoning cut off") == ""
    assert extract_instruction("Add a cat.") == "Add a cat."  # a bare instruction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>looks right</think>No further edit needed.", True),
        ("<think>ok</think>  NO FURTHER EDIT NEEDED!  ", True),
        ('<think>ok</think>"no further  edit needed"', True),
        (NO_EDIT, True),
        ("<think>ok</think>", True),  # no instruction: nothing to edit
        ("<think>cut off", True),
        ("<think>ok</think>No further edit needed, but make the sky bluer.", False),
        ("<think>ok</think>Add a further edit: needed a cat.", False),
        ("Make the car red.", False),
    ],
)
def test_is_no_edit(text, expected):
    assert is_no_edit(text) is expected


# ------------------------------------------------------------------------------------ stage rewards
def test_reason_rewards_hand_made():
    texts = ["<think>plan</think>", "plan without tags", "<think>p</think>", "<think>p</think>x"]
    out = reason_rewards(texts, _t([0.5, 1.0, 0.0, 0.25]), format_weight=0.5)
    # f = [1, 0, 1, 0]; text = f·(r + 0.5) = [1.0, 0, 0.5, 0]
    assert out.format.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.text.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert out.image.tolist() == [0.5, 1.0, 0.0, 0.25]
    assert out.image_mask.tolist() == [True] * 4 and out.delta is None
    assert out.text.dtype == out.image.dtype == torch.float32


def test_malformed_think_gets_zero_text_reward_even_with_a_nan_score():
    out = reason_rewards(["<think>unclosed", "<think>ok</think>"], _t([math.nan, 1.0]), format_weight=1.0)
    assert out.text[0].item() == 0.0 and out.text[1].item() == 2.0
    assert math.isnan(out.image[0].item())  # the image track keeps the failure visible


def test_refine_rewards_hand_made():
    texts = [
        "<think>blue car</think>Make the car red.",  # edit: Δ = 0.9 − 0.4 = 0.5
        "<think>all good</think>No further edit needed.",  # no edit on a perfect image: Δ = 1
        "<think>all good</think>no further edit needed",  # no edit on an imperfect image: Δ = 0, masked
        "Make the car red.",  # edit, but no <think>: f = 0 → text 0
        "<think>worse</think>Remove the car.",  # edit that hurts: Δ = 0.2 − 0.6 = −0.4
    ]
    prev = _t([0.4, 1.0, 0.3, 0.4, 0.6])
    new = _t([0.9, 1.0, 0.3, 0.8, 0.2])
    perfect = torch.tensor([False, True, False, False, False])
    out = refine_rewards(texts, prev, new, perfect, format_weight=0.5)
    assert out.delta.tolist() == pytest.approx([0.5, 1.0, 0.0, 0.4, -0.4])
    assert out.format.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    # text = f·(0.5 + Δ) = [1.0, 1.5, 0.5, 0, 0.1]
    assert out.text.tolist() == pytest.approx([1.0, 1.5, 0.5, 0.0, 0.1])
    assert out.image.tolist() == pytest.approx([0.9, 1.0, 0.3, 0.8, 0.2])
    assert out.image_mask.tolist() == [True, False, False, True, True]


def test_refine_derives_perfect_from_the_threshold():
    texts = ["<think>a</think>no further edit needed"] * 2
    out = refine_rewards(texts, _t([1.0, 0.8]), _t([1.0, 0.8]), None, 0.0, perfect_threshold=0.9)
    assert out.delta.tolist() == [1.0, 0.0] and out.text.tolist() == [1.0, 0.0]


def test_refine_rejects_bad_inputs():
    with pytest.raises(ValueError, match="one entry per completion"):
        refine_rewards(["<think>a</think>b"], _t([1.0, 0.0]), _t([1.0]), None, 0.0)
    with pytest.raises(ValueError, match="bool"):
        refine_rewards(["<think>a</think>b"], _t([1.0]), _t([1.0]), _t([1.0]), 0.0)


# --------------------------------------------------------------------------------------- advantages
def test_group_mean_subtraction_hand_computed():
    rewards = _t([1.0, 3.0, 10.0, 20.0, 30.0])
    ids = _ids([7, 7, 2, 2, 2])
    # group 7: mean 2 → [-1, 1]; group 2: mean 20 → [-10, 0, 10]
    assert track_advantages(rewards, ids).tolist() == pytest.approx([-1.0, 1.0, -10.0, 0.0, 10.0])


def test_std_option_divides_by_the_group_std_plus_eps():
    rewards = _t([1.0, 3.0, 10.0, 20.0, 30.0])
    ids = _ids([0, 0, 1, 1, 1])
    adv = track_advantages(rewards, ids, scale_by_std=True, eps=0.0)
    # group 0: std 1 → [-1, 1]; group 1: std sqrt(200/3) = 8.165 → ∓10/8.165 = ∓1.2247
    assert adv.tolist() == pytest.approx([-1.0, 1.0, -1.2247449, 0.0, 1.2247449], rel=1e-6)
    with_eps = track_advantages(rewards, ids, scale_by_std=True)  # eps 1e-4
    assert with_eps[1].item() == pytest.approx(1 / (1 + 1e-4))


def test_masked_members_leave_the_mean_and_get_zero():
    rewards = _t([0.2, 0.6, 0.9, math.nan])  # the masked NaN is never read
    mask = torch.tensor([True, True, False, False])
    adv, stats = track_advantages_with_stats(rewards, _ids([0, 0, 0, 0]), mask)
    # mean over the two edited branches = 0.4 → [-0.2, 0.2, 0, 0]
    assert adv.tolist() == pytest.approx([-0.2, 0.2, 0.0, 0.0])
    assert stats.num_groups == 1 and stats.mean_group_size == 2


def test_image_advantage_masked_when_no_edit_happened():
    texts = [
        "<think>a</think>Add a cat.",
        "<think>a</think>Add a dog.",
        "<think>a</think>No further edit needed",
    ]
    out = refine_rewards(texts, _t([0.5] * 3), _t([1.0, 0.0, 0.5]), torch.zeros(3, dtype=torch.bool), 0.0)
    image_adv = track_advantages(out.image, _ids([0, 0, 0]), out.image_mask)
    assert image_adv.tolist() == pytest.approx([0.5, -0.5, 0.0])  # mean of the two edits = 0.5
    text_adv = track_advantages(out.text, _ids([0, 0, 0]))
    # text = Δ = [0.5, −0.5, 0] (w_f = 0), mean 0
    assert text_adv.tolist() == pytest.approx([0.5, -0.5, 0.0])


def test_edge_cases_of_track_advantages():
    rewards = _t([1.0, 2.0])
    none = torch.zeros(2, dtype=torch.bool)
    adv, stats = track_advantages_with_stats(rewards, _ids([0, 0]), none)
    assert adv.tolist() == [0.0, 0.0] and stats is None
    assert track_advantages(_t([0.7, 0.7, 0.7]), _ids([1, 1, 1])).tolist() == [0.0] * 3
    with pytest.raises(ValueError, match="NaN"):
        track_advantages(_t([math.nan, 1.0]), _ids([0, 0]))
    with pytest.raises(ValueError, match="bool"):
        track_advantages(rewards, _ids([0, 0]), mask=_t([1.0, 1.0]))
    with pytest.raises(ValueError, match="same shape"):
        track_advantages(rewards, _ids([0, 0, 0]))
