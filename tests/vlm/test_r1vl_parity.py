"""R1-VL reward parity: ``reward=r1vl`` on crafted completions equals R1-VL's own reward functions.

The expected numbers were obtained by running R1-VL's ``accuracy_reward`` (math-verify, then the string
match of the answer line, plus 0.1 · matched key-step fraction) and ``validity_reward`` (StepRVR) on
exactly these inputs, with math-verify 0.9.0; they are written here as plain numbers. ``accuracy`` is
upstream's first function (rlgen's ``answer_accuracy + step_rar``), ``validity`` its second
(``step_rvr``). The cases cover answer forms math-verify does and does not equate, missing and empty
answer headers, empty ground truths, misnumbered and misplaced steps, and key steps inside and outside
the step bodies.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlgen_cli._hydra import conf_dir
from rlgen_cli.rewards import RewardBatch, build_mix, r1vl

HEAD = "### Image Description:\nA right triangle with legs 3 and 4.\n### Rationales:\nUse Pythagoras.\n"
S1 = "### Step 1:\nThe legs are 3 and 4.\n"
S2 = "### Step 2:\nThe hypotenuse squared is 9 + 16 = 25.\n"
S3 = "### Step 3:\nSo the hypotenuse is 5.\n"
STEPS = S1 + S2 + S3
ANS = "### The final answer is: "
KS = {"Steps": [["legs are 3 and 4", "legs 3, 4"], "9 + 16 = 25", ["hypotenuse is 5"], "area is 6"]}
KS_ALL = {"Steps": ["legs are 3 and 4", ["HYPOTENUSE SQUARED", "c^2"], "so the hypotenuse"]}
TEN_STEPS = "".join(f"### Step {i}:\nstep {i}.\n" for i in range(1, 11))


def full(answer: str, steps: str = STEPS, head: str = HEAD) -> str:
    """A completion in R1-VL's format ending with ``### The final answer is: {answer}``."""
    return head + "### Let's think step by step.\n" + steps + ANS + answer


# (name, completion, solution, key_steps, upstream accuracy_reward, upstream validity_reward)
CASES = [
    ("plain_right", full("5"), "5", KS, 1.075, 1.0),
    ("solution_with_header", full("5"), "### The final answer is: 5", KS, 1.075, 1.0),
    ("wrong_number", full("6"), "5", KS, 0.075, 1.0),
    ("boxed", full("\\boxed{5}"), "5", KS, 1.075, 1.0),
    ("decimal_form", full("5.0"), "5", KS, 1.075, 1.0),
    ("half_decimal_vs_fraction", full("1/2"), "0.5", KS, 1.075, 1.0),
    ("latex_frac", full("\\frac{1}{2}"), "1/2", KS, 1.075, 1.0),
    ("choice_letter", full("B"), "B", KS, 1.075, 1.0),
    ("choice_parenthesised", full("(B)"), "B", KS, 0.075, 1.0),
    ("choice_lowercase", full("b"), "B", KS, 0.075, 1.0),
    ("yes_case", full("Yes"), "yes", KS, 0.075, 1.0),
    ("unit_suffix", full("3 cm"), "3", KS, 1.075, 1.0),
    ("degrees", full("30°"), "30", KS, 1.075, 1.0),
    ("thousands_comma", full("2,000"), "2000", KS, 1.075, 1.0),
    ("no_header_bare_answer", "5", "5", KS, 1.0, 0.0),
    ("no_header_prose", "The hypotenuse is therefore 5", "5", KS, 1.0, 0.0),
    ("empty_completion", "", "5", KS, 0.0, 0.0),
    ("empty_completion_empty_solution", "", "", KS, 1.0, 0.0),
    ("ends_with_empty_header", full(""), "5", KS, 1.075, 1.0),
    ("ends_with_empty_header_empty_solution", full(""), "", KS, 1.075, 1.0),
    ("answer_vs_empty_solution", full("5"), "", KS, 0.075, 1.0),
    ("solution_empty_after_header", full("5"), "### The final answer is:", KS, 0.075, 1.0),
    ("steps_skip_a_number", full("5", S1 + S3), "5", KS, 1.05, 0.0),
    ("steps_start_at_two", full("5", S2 + S3), "5", KS, 1.05, 0.0),
    ("no_image_description", full("5", head="### Rationales:\nUse Pythagoras.\n"), "5", KS, 1.075, 0.0),
    ("no_rationales", full("5", head="### Image Description:\nA triangle.\n"), "5", KS, 1.075, 0.0),
    ("answer_before_last_step", HEAD + S1 + ANS + "5\n" + S2 + S3, "5", KS, 1.075, 0.0),
    ("answer_first_then_empty_header_at_end", HEAD + ANS + "5\n" + STEPS + ANS.rstrip(), "5", KS, 1.075, 1.0),
    ("answer_first_then_empty_header_and_space", HEAD + ANS + "5\n" + STEPS + ANS + " \n", "5", KS, 1.075, 1.0),
    ("two_headers_first_too_early", HEAD + S1 + ANS + "4\n" + S2 + S3 + ANS + "5", "5", KS, 1.075, 0.0),
    ("repeated_step_one", full("5", S1 + S1 + S3), "5", KS, 1.05, 0.0),
    ("ten_steps", full("5", TEN_STEPS), "5", KS, 1.0, 1.0),
    ("answer_on_next_line", full("\n5"), "5", KS, 1.075, 1.0),
    ("trailing_period", full("5."), "5", KS, 1.075, 1.0),
    ("answer_in_sentence", full("The answer is 5"), "5", KS, 1.075, 1.0),
    ("dollar_math", full("$5$"), "5", KS, 1.075, 1.0),
    ("all_key_steps_matched", full("5"), "5", KS_ALL, 1.1, 1.0),
    ("key_steps_only_in_description", full("5", "### Step 1:\nCompute.\n"), "5",
     {"Steps": ["right triangle", "pythagoras"]}, 1.0, 1.0),
    ("no_key_steps", full("5"), "5", {"Steps": []}, 1.0, 1.0),
    ("answer_glued_to_last_step", HEAD + S1 + S2 + "### Step 3:\nSo it is 5. ### The final answer is: 5", "5",
     {"Steps": ["the final answer is: 5", "area is 6"]}, 1.05, 1.0),
    ("fraction_vs_decimal_solution", full("0.75"), "\\frac{3}{4}", KS, 1.075, 1.0),
    ("equation_answer", full("x = 5"), "5", KS, 1.075, 1.0),
    ("think_answer_format", "<think>3-4-5 triangle</think><answer>5</answer>", "5", KS, 0.0, 0.0),
    ("padded_answer", full("   5   "), "5", KS, 1.075, 1.0),
    ("misspelled_header", HEAD + STEPS + "### Final answer: 5", "5", KS, 1.075, 0.0),
    ("choice_with_value", full("A. 12"), "A", KS, 0.075, 1.0),
    ("text_answer_exact", full("isosceles"), "isosceles", KS, 1.075, 1.0),
    ("text_answer_case", full("Isosceles"), "isosceles", KS, 0.075, 1.0),
    ("negative_number", full("-3"), "-3", KS, 1.075, 1.0),
    ("step_header_without_colon", full("5", "### Step 1\nfoo\n### Step 2:\nbar\n"), "5", KS, 1.0, 0.0),
    ("bare_empty_header_empty_solution", "### The final answer is:", "", KS, 1.0, 0.0),
    ("prose_then_empty_header_vs_empty_solution_header", "No idea.\n### The final answer is:",
     "### The final answer is:", KS, 1.0, 0.0),
    ("prose_then_empty_header_vs_answer", "No idea.\n### The final answer is:", "7", KS, 0.0, 0.0),
    ("empty_header_exemption_steps_misnumbered", HEAD + ANS + "5\n" + S1 + S3 + ANS, "5", KS, 1.05, 0.0),
    ("empty_header_exemption_without_step_one", HEAD + ANS + "5\n" + S2 + ANS, "5", KS, 1.025, 0.0),
]  # fmt: skip


def r1vl_reward_config() -> tuple[dict, dict]:
    """Weights and kwargs of ``reward=r1vl`` as shipped."""
    spec = OmegaConf.to_container(OmegaConf.load(Path(conf_dir()) / "reward" / "r1vl.yaml"))
    return spec["weights"], spec.get("kwargs") or {}


def score_cases(cases: list[tuple]) -> dict[str, list[float]]:
    weights, kwargs = r1vl_reward_config()
    mix = build_mix(weights, **kwargs)
    batch = RewardBatch(
        prompts=["q"] * len(cases),
        texts=[c[1] for c in cases],
        metadata=[{"solution": c[2], "key_steps": c[3]} for c in cases],
    )
    details = mix.score(batch).details
    return {name: details[name].tolist() for name in weights}


def test_math_verify_is_part_of_the_default_install():
    assert r1vl._has_math_verify(), "math-verify is a default dependency of rlgen: pip install -e ."


def test_the_table_is_large_and_covers_every_outcome():
    assert len(CASES) >= 39 and len({c[0] for c in CASES}) == len(CASES)
    assert {c[5] for c in CASES} == {0.0, 1.0} and {round(c[4]) for c in CASES} == {0, 1}


def test_reward_r1vl_equals_r1vl_reward_functions_on_every_case():
    got = score_cases(CASES)
    mismatches = []
    for i, (name, *_, accuracy, validity) in enumerate(CASES):
        ours = (got["answer_accuracy"][i] + got["step_rar"][i], got["step_rvr"][i])
        if ours != pytest.approx((accuracy, validity), abs=1e-6):
            mismatches.append(f"{name}: rlgen {ours} vs R1-VL {(accuracy, validity)}")
    assert not mismatches, f"{len(mismatches)} of {len(CASES)} differ:\n" + "\n".join(mismatches)


def test_step_rvr_strict_mode_drops_the_empty_header_exemption():
    text = dict((c[0], c[1]) for c in CASES)["answer_first_then_empty_header_at_end"]
    assert r1vl.step_rvr(text, mode="r1vl") == 1.0
    assert r1vl.step_rvr(text, mode="strict") == 0.0  # the first answer header precedes the steps
    with pytest.raises(ValueError, match="step_rvr mode"):
        r1vl.step_rvr(text, mode="lenient")
