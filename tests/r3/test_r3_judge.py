"""The R3 judge path: GenEval++ and TIIF rows from the R3 loaders, judged by the OpenAI-compatible client
against a loopback judge server, and the scores turned into stage rewards."""

from __future__ import annotations

import json

import pytest
import torch

from rlgen_cli.r3.data import load_r3_dataset
from rlgen_cli.r3.rewards import reason_rewards, refine_rewards, track_advantages
from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.judge_prompts import GENEVAL_PLUS_SYSTEM, GENEVAL_PLUS_TEMPLATE, geneval_plus_text
from rlgen_cli.server.runner import BackgroundServer
from tests.rewards.test_judge_prompts import _fake_judge


def _batch(samples) -> RewardBatch:
    n = len(samples)
    return RewardBatch(
        prompts=[s.prompt for s in samples],
        images=torch.rand(n, 3, 16, 16),
        metadata=[s.metadata for s in samples],
    )


def test_geneval_plus_rows_judged_and_rewarded():
    samples = load_r3_dataset("builtin:r3_geneval_plus_tiny.jsonl", "geneval_plus")
    # The fake judge answers by the prompt's first word: "three" / "two" correct, "a" incorrect.
    answers = {
        "three": '{"correct": 1}',
        "two": 'All present. {"correct": 1}',
        "a": '```json\n{"correct": 0}\n```',
    }
    seen: list[dict] = []
    with BackgroundServer(_fake_judge(answers, seen)) as server:
        judge = build_reward("geneval_plus", endpoints=[server.url + "/v1"], backoff_s=0.01)
        result = judge.score(_batch(samples))
    expected = [float(answers[s.prompt.split()[0]] != answers["a"]) for s in samples]
    assert result.scores.tolist() == expected == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert judge.stats().get("parse_failures", 0) == 0
    sent = sorted(body["messages"][1]["content"][-1]["text"] for body in seen)
    assert sent == sorted(geneval_plus_text(GENEVAL_PLUS_TEMPLATE, s.prompt, s.metadata) for s in samples)
    assert all(body["messages"][0] == {"role": "system", "content": GENEVAL_PLUS_SYSTEM} for body in seen)

    # reason stage: two completions lose the format, so their text reward is 0 whatever the verdict
    texts = [
        "<think>three apples</think>",
        "no tags",
        "<think>p</think>",
        "<think>p</think>tail",
        "<think>q</think>",
    ]
    rewards = reason_rewards(texts, result.scores, format_weight=0.5)
    assert rewards.text.tolist() == [1.5, 0.0, 0.5, 0.0, 1.5]
    adv = track_advantages(rewards.text, torch.zeros(5, dtype=torch.long))
    assert adv.tolist() == pytest.approx([0.8, -0.7, -0.2, -0.7, 0.8])  # mean 0.7


def test_tiif_rows_judged_and_rewarded():
    samples = load_r3_dataset("builtin:r3_tiif_tiny.jsonl", "tiif")
    answers = {"tiif": json.dumps({"Q1": "yes", "Q2": "yes", "Q3": "no", "Q4": "yes"})}
    seen: list[dict] = []
    with BackgroundServer(_fake_judge(answers, seen)) as server:
        judge = build_reward("tiif", endpoints=[server.url + "/v1"], model="judge", backoff_s=0.01)
        result = judge.score(_batch(samples))
    # expected answers per row vs the judge's yes/yes/no/yes:
    # [y,y,y] → 2/3; [y,y,n] → 1; [y,y,n,y] → 1; [y,n] → 1/2; [y,y,n] → 1
    assert result.scores.tolist() == pytest.approx([2 / 3, 1.0, 1.0, 0.5, 1.0])
    texts = {body["messages"][0]["content"][-1]["text"] for body in seen}
    assert any("Q4: Are the oranges in the bowl?" in t for t in texts) and len(seen) == len(samples)

    # refine stage from the same rows: previous images scored 0.5 each, judged again after an edit
    completions = [
        "<think>wall colour off</think>Make the wall yellow.",
        "<think>looks right</think>No further edit needed.",
        "<think>fine</think>no further edit needed",
        "Remove the people.",
        "<think>sign</think>Write OPEN on the sign.",
    ]
    prev_perfect = torch.tensor([False, True, False, False, False])
    out = refine_rewards(completions, torch.full((5,), 0.5), result.scores, prev_perfect, format_weight=0.0)
    assert out.delta.tolist() == pytest.approx([1 / 6, 1.0, 0.0, 0.0, 0.5])
    assert out.text.tolist() == pytest.approx([1 / 6, 1.0, 0.0, 0.0, 0.5])  # row 3 has no <think>: f = 0
    assert out.image_mask.tolist() == [True, False, False, True, True]
