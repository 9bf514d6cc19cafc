"""R1-VL rule rewards: golden cases (StepRAR, StepRVR, accuracy normaliser), TRL signatures, registry."""

from __future__ import annotations

import json

import pytest
import torch

from rlgen_cli.rewards import RewardBatch, build_mix, r1vl
from rlgen_cli.rewards.r1vl import (
    accuracy_reward,
    answer_accuracy,
    answers_match,
    extract_answer,
    key_step_fraction,
    length_reward,
    normalize_key_steps,
    step_rar,
    step_rar_reward,
    step_rvr,
    step_rvr_reward,
    think_format,
    think_format_reward,
)

GOOD = (
    "### Image Description:\nA right triangle with legs 3 and 4.\n"
    "### Rationales:\nUse Pythagoras.\n"
    "### Let's think step by step.\n"
    "### Step 1:\nThe legs are 3 and 4.\n"
    "### Step 2:\nThe hypotenuse squared is 9 + 16 = 25.\n"
    "### Step 3:\nSo the hypotenuse is 5.\n"
    "### The final answer is: 5"
)
KEY_STEPS = {  # 6 groups; 3 match the steps of GOOD ("legs are 3 and 4", "25", "hypotenuse is 5")
    "Steps": [
        ["legs are 3 and 4", "legs 3, 4"],
        "9 + 16 = 25",
        ["hypotenuse is 5"],
        "area is 6",
        ["perimeter", "sum of sides"],
        "angle of 90",
    ]
}


def test_six_groups_three_matched_pays_0_05():
    assert key_step_fraction(GOOD, KEY_STEPS) == 0.5  # 3 of 6
    assert step_rar(GOOD, KEY_STEPS) == pytest.approx(0.05)  # 0.1 · 0.5


def test_step_rar_matches_only_step_bodies_and_lowercases():
    # the description mentions "perimeter", but only ### Step N: bodies count
    text = GOOD.replace("A right triangle", "A right triangle, perimeter 12,").replace("legs are", "LEGS ARE")
    assert key_step_fraction(text, KEY_STEPS) == 0.5


def test_step_rar_modes_without_a_final_answer():
    no_answer = GOOD.rsplit("### The final answer is:", 1)[0]
    assert step_rar(no_answer, KEY_STEPS, mode="r1vl") == pytest.approx(0.05)  # upstream pays anyway
    assert step_rar(no_answer, KEY_STEPS, mode="paper") == 0.0
    assert step_rar(GOOD, KEY_STEPS, mode="paper") == pytest.approx(0.05)
    assert step_rar(no_answer + "### The final answer is:   ", KEY_STEPS, mode="paper") == 0.0  # empty
    with pytest.raises(ValueError, match="mode"):
        step_rar(GOOD, KEY_STEPS, mode="strict")


def test_step_rar_optional_normalisation():
    text = "### Step 1:\nThe total   is 1,000.50 and $x^2$\n### The final answer is: 1000.5"
    assert key_step_fraction(text, ["total is 1000.5"]) == 0.0
    assert key_step_fraction(text, ["total is 1000.5"], whitespace=True, numbers=True) == 1.0
    assert key_step_fraction(text, ["x^2"], latex=True) == 1.0


def test_step_rvr_golden_cases():
    assert step_rvr(GOOD) == 1.0
    assert step_rvr(GOOD.replace("### Rationales:", "Rationales:")) == 0.0  # missing header
    assert step_rvr(GOOD.replace("### Image Description:", "")) == 0.0
    assert step_rvr(GOOD.replace("### Step 3:", "### Step 4:")) == 0.0  # numbered 1, 2, 4
    assert (
        step_rvr(
            GOOD.replace("### Step 1:", "### Step 2:").replace("### Step 2:\nThe hyp", "### Step 1:\nThe hyp")
        )
        == 0.0
    )
    early = GOOD.replace("### Step 3:", "### The final answer is: 5\n### Step 3:").rsplit(
        "\n### The final", 1
    )[0]
    assert step_rvr(early) == 0.0  # answer header before the last step
    assert step_rvr(GOOD.replace("### Step 1:", "### Step one:")) == 0.0  # no Step 1 header


def test_rewards_total_in_range_for_a_perfect_answer():
    total = answer_accuracy(GOOD, "5") + step_rar(GOOD, KEY_STEPS) + step_rvr(GOOD)
    assert total == pytest.approx(2.05)


@pytest.mark.parametrize(
    "prediction,truth,expected",
    [
        ("\\boxed{3.50}", "3.5", True),
        ("1,000", "1000", True),
        ("\\frac{1}{2}", "0.5", True),
        ("$\\dfrac{3}{4}$", "0.75", True),
        ("(B) 12 cm", "B", True),
        ("B.", "(B)", True),
        ("12°", "12", True),
        ("  Yes. ", "yes", True),
        ("\\text{Paris}", "paris", True),
        ("3", "4", False),
        ("12 cm", "12", False),  # units are not stripped (documented)
        ("apple", "a", False),
        ("(C)", "B", False),
    ],
)
def test_accuracy_normaliser(prediction, truth, expected):
    assert answers_match(prediction, truth) is expected


def test_answer_accuracy_backends():
    assert extract_answer("x\n### The final answer is: 42\nextra") == "42"
    assert extract_answer("no header") is None
    assert answer_accuracy(GOOD, "### The final answer is: 5", backend="normalizer") == 1.0
    assert answer_accuracy(GOOD, "6", backend="normalizer") == 0.0
    assert answer_accuracy("5", "5", backend="normalizer") == 0.0  # no answer header: no answer
    assert (
        answer_accuracy("### The final answer is: 5.0", "5", backend="exact") == 0.0
    )  # upstream string match
    assert answer_accuracy("### The final answer is: 5", "5", backend="exact") == 1.0
    with pytest.raises(ValueError, match="backend"):
        answer_accuracy(GOOD, "5", backend="fuzzy")


def test_think_format():
    assert think_format("<think>because</think>\n<answer>5</answer>") == 1.0
    assert think_format("<think>because</think>") == 0.0
    assert think_format("so <think>a</think><answer>5</answer>") == 0.0


def test_trl_signatures_accept_strings_and_chat_messages():
    chats = [[{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": "nothing"}]]
    assert accuracy_reward(chats, solution=["5", "5"], backend="normalizer", key_steps=[None, None]) == [
        1.0,
        0.0,
    ]
    assert step_rar_reward([GOOD, "x"], key_steps=[KEY_STEPS, KEY_STEPS]) == pytest.approx([0.05, 0.0])
    assert step_rvr_reward(chats) == [1.0, 0.0]
    assert think_format_reward(["<think>a</think><answer>b</answer>"]) == [1.0]
    assert length_reward(["abcd", "ab"], target=4) == [1.0, 0.5]
    with pytest.raises(TypeError, match="completion"):
        step_rvr_reward([3])


def test_normalize_key_steps():
    assert normalize_key_steps({"Steps": ["a", ["b", "c"]]}) == [["a"], ["b", "c"]]
    assert normalize_key_steps(None) == []
    with pytest.raises(ValueError, match="key-step group"):
        normalize_key_steps({"Steps": [[1]]})


def test_registered_rewards_score_texts_in_a_mix():
    mix = build_mix(
        {"answer_accuracy": 1.0, "step_rar": 1.0, "step_rvr": 1.0, "length": 0.5},
        answer_accuracy={"backend": "normalizer"},
        length={"target": 10},
    )
    meta = [{"solution": "5", "key_steps": KEY_STEPS}, {"solution": "7", "key_steps": KEY_STEPS}]
    result = mix.score(RewardBatch(prompts=["p", "p"], texts=[GOOD, "short"], metadata=meta))
    assert torch.allclose(result.scores, torch.tensor([2.05 + 0.5, 0.25]))
    assert result.details["step_rvr"].tolist() == [1.0, 0.0]


def test_registered_reward_errors_name_the_fix():
    reward = r1vl.build_answer_accuracy()
    with pytest.raises(ValueError, match="RewardBatch.texts is None"):
        reward.score(RewardBatch(prompts=["p"]))
    with pytest.raises(ValueError, match="needs metadata"):
        reward.score(RewardBatch(prompts=["p"], texts=["x"], metadata=[{}]))
    with pytest.raises(
        ImportError if not r1vl._has_math_verify() else ValueError, match="math-verify|backend"
    ):
        r1vl.build_answer_accuracy(backend="math_verify" if not r1vl._has_math_verify() else "nope")


def test_key_steps_stored_as_a_json_string_are_decoded_not_read_as_characters():
    """A dataset library that needs one type per column stores R1-VL-10K's ``key_steps`` as JSON text."""
    steps = {"Steps": ["red squares", ["two squares", "2 squares"]]}
    assert normalize_key_steps(json.dumps(steps)) == [["red squares"], ["two squares", "2 squares"]]
    assert normalize_key_steps(json.dumps(steps["Steps"])) == [["red squares"], ["two squares", "2 squares"]]
    completion = "### Step 1: I see red squares.\n### Step 2: one circle.\n### The final answer is: 2"
    assert step_rar(completion, json.dumps(steps)) == pytest.approx(0.1 * 1 / 2)  # one of two groups matched
    for text, why in [
        ("red squares", "not JSON"),
        ('"red squares"', "JSON of a str"),
        ("3", "JSON of a int"),
    ]:
        with pytest.raises(ValueError, match=f"key_steps is a string, {why}"):
            normalize_key_steps(text)
    with pytest.raises(ValueError, match="key_steps is a string"):  # reported, never scored as characters
        step_rar_reward([completion], ["not json"])
