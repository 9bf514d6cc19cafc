"""StepGRPO follows R1-VL's reward on ShapesQA from the shipped SFT'd base; check-onpolicy holds on that base.

Learning (default suite): experiment=shapesqa_stepgrpo on 4 train questions (every one every epoch) × 8
chains, EPOCHS epochs at lr 2e-4 (constant), R1-VL's reward; the negated arm is the same run with every
reward weight at −1. Both arms sample the same first epoch (same base, same seeds: asserted), so they are
compared over the epochs after it: the mean raw reward (accuracy + 0.1·StepRAR + StepRVR, whatever the
weights) of the trained arm must beat the negated arm's by MARGIN, and the negated arm must fall below its
own first epoch. Three updates of 32 chains are too few for the trained arm's own rise to clear the
sampling noise (it moved −0.35 … +0.19 over seeds 0, 1, 3); the negated arm falls on every seed, so the
gap measures that the update follows the reward's sign. Measured (raw reward, first epoch → mean after):

    seed   trained               negated               gap
    3      0.691 → 0.744         0.691 → 0.387         0.357
    0      0.944 → 0.731         0.944 → 0.346         0.385
    1      0.909 → 0.761         0.909 → 0.334         0.427

MARGIN is about half the smallest gap. With lr 1e-3 both arms collapse (0.63 → 0.06 / 0.06); with 4
chains per question and lr 3e-4 seed 0's gap was 0.15.

The slow test holds the measured headline: experiment=shapesqa_stepgrpo as shipped, stopped after
HEADLINE_EPOCHS epochs, lifts greedy test accuracy over the SFT'd base by HEADLINE_GAIN (measured: 40
epochs, 36.0 → 42.0 %: count 20 → 28, colour 34 → 44, relation 54 → 54; greedy decoding and a seeded run
repeat on one machine, the threshold is half the gain). It holds that seed's result, not a general gain:
at seed 0 the same run ended at 32.7 % (docs/vlm.md, ShapesQA).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlgen_cli.vlm.data import ASSETS
from tests.conftest import run_cli

SHAPESQA = ASSETS / "shapesqa"
REWARDS = ("answer_accuracy", "step_rar", "step_rvr")
EPOCHS = 4
MARGIN = 0.2
LEARNING_RUN = [
    "experiment=shapesqa_stepgrpo", "progress=false", f"epochs={EPOCHS}", "eval_every=0", "save_every=0",
    "algo.prompts_per_epoch=4", "algo.group_size=8", "algo.sample_batch_size=32", "algo.train_batch_size=32",
    "algo.gradient_accumulation_steps=1", "algo.lr=2e-4", "algo.token.lr_schedule=constant", "seed=3",
]  # fmt: skip


def few_questions(tmp_path: Path, count: int = 4) -> Path:
    """The first ``count`` train questions, as a file of their own (images by absolute path)."""
    rows = json.loads((SHAPESQA / "train.json").read_text())[:count]
    for row in rows:
        row["image_path"] = str(SHAPESQA / row["image_path"])
    path = tmp_path / "few.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def raw_rewards(run: Path, data: Path, weight: float) -> list[float]:
    """Train with every R1-VL reward weighted by ``weight``; the raw reward of each epoch's rollouts."""
    weights = [f"reward.weights.{name}={weight}" for name in REWARDS]
    code, out = run_cli("train", *LEARNING_RUN, f"data.train={data}", *weights, f"hydra.run.dir={run}")
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == EPOCHS
    return [sum(row[f"reward/{k}/mean"] for k in REWARDS) for row in rows]  # the components are raw


def test_stepgrpo_keeps_r1vls_reward_above_the_negated_arm_which_falls(tmp_path: Path) -> None:
    data = few_questions(tmp_path)
    trained = raw_rewards(tmp_path / "trained", data, 1.0)
    negated = raw_rewards(tmp_path / "negated", data, -1.0)
    assert trained[0] == pytest.approx(negated[0]), "the first rollouts precede any update: they must agree"
    after_trained, after_negated = sum(trained[1:]) / (EPOCHS - 1), sum(negated[1:]) / (EPOCHS - 1)
    assert after_trained - after_negated >= MARGIN, (trained, negated)
    assert after_negated < negated[0], f"the negated reward did not lower the reward: {negated}"


ONPOLICY = [
    "model=shapesqa_base", "model.path=builtin:shapesqa_sft", "algo=step_grpo", "data=shapesqa", "reward=r1vl",
    "algo.prompts_per_epoch=2", "algo.group_size=2", "algo.sample_batch_size=4", "algo.train_batch_size=4",
    "algo.gradient_accumulation_steps=1", "progress=false",
]  # fmt: skip


def _max_error(out: str) -> float:
    line = next(line for line in out.splitlines() if "sampler): max error" in line)
    return float(line.split("max error")[1].split()[0])


def test_check_onpolicy_passes_on_the_shapesqa_base_and_fails_with_perturbed_weights(tmp_path: Path) -> None:
    code, out = run_cli("check-onpolicy", *ONPOLICY, f"hydra.run.dir={tmp_path / 'as_is'}")
    assert code == 0 and "PASS text (hf sampler)" in out, out
    assert _max_error(out) <= 1e-5  # fp32: KV-cache decoding vs the full forward, measured 1.4e-6
    perturbed = [*ONPOLICY, "check.perturb_weights=1e-3", f"hydra.run.dir={tmp_path / 'perturbed'}"]
    code, out = run_cli("check-onpolicy", *perturbed)
    assert code == 1 and "FAIL text (hf sampler)" in out, out
    assert _max_error(out) > 100 * 1e-5  # noise of std 1e-3 on every weight: measured 8.1e-3


HEADLINE_EPOCHS = 40
HEADLINE_GAIN = 0.03


@pytest.mark.slow
def test_stepgrpo_lifts_test_accuracy_over_the_sft_base(tmp_path: Path) -> None:
    code, out = run_cli(
        "eval", "experiment=shapesqa_eval", "progress=false", f"hydra.run.dir={tmp_path / 'base'}"
    )
    assert code == 0, out
    before = json.loads((tmp_path / "base" / "results.json").read_text())["accuracy"]
    run = tmp_path / "run"
    overrides = [
        f"epochs={HEADLINE_EPOCHS}",
        f"eval_every={HEADLINE_EPOCHS}",
        "save_every=0",
        "seed=42",
    ]  # as shipped
    code, out = run_cli(
        "train", "experiment=shapesqa_stepgrpo", "progress=false", *overrides, f"hydra.run.dir={run}"
    )
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    after = rows[-1]["eval/accuracy"]
    assert after - before >= HEADLINE_GAIN, f"test accuracy {before:.3f} -> {after:.3f}"
