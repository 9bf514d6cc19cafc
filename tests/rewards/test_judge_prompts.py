"""GenEval++ and TIIF judge prompts and parsers, and ``openai_judge`` using them against a fake judge server."""

from __future__ import annotations

import json
import math

import pytest
import torch
from aiohttp import web

from rlgen_cli.errors import UserError
from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.judge_prompts import (
    GENEVAL_PLUS_SYSTEM,
    extract_json_object,
    geneval_plus_checklist,
    geneval_plus_text,
    parse_geneval_plus,
    parse_tiif,
    tiif_text,
)
from rlgen_cli.rewards.remote import RemoteRewardError
from rlgen_cli.server.runner import BackgroundServer

GENEVAL_PLUS_META = {
    "tag": "counting",
    "include": [
        {"class": "dog", "count": 2, "color": "brown", "size": "larger", "region": "left"},
        {"class": "cat", "count": 1},
    ],
    "exclude": [{"class": "dog", "count": 3}],
    "prompt": "a photo of two brown dogs and a cat",
}
TIIF_META = {
    "type": "2d_spatial_relation",
    "short_description": "a cup left of a book",
    "yn_question_list": ["Is there a cup?", "Is the cup left of the book?", "Is the book red?"],
    "yn_answer_list": ["yes", "yes", "no"],
}


# ------------------------------------------------------------------------------------ prompt builders
def test_geneval_plus_checklist_golden():
    assert geneval_plus_checklist(GENEVAL_PLUS_META) == (
        "This image should contain:\n"
        "- brown-colored larger 2 dog located in the left part of the image.\n"
        "- 1 cat.\n"
        "- No more than 2 dogs should appear."
    )
    text = geneval_plus_text(
        "Instruction: {prompt}\n\nExplanation: {checklist}", "two dogs", GENEVAL_PLUS_META
    )
    assert text.startswith("Instruction: two dogs\n\nExplanation: This image should contain:\n- brown")
    for requirement in ("classes", "colours", "spatial", "size", "cartoon", "collage", "strict", '"correct"'):
        assert requirement in GENEVAL_PLUS_SYSTEM


def test_tiif_text_golden():
    text = tiif_text("{questions}", "ignored", TIIF_META)
    assert text == "Q1: Is there a cup?\nQ2: Is the cup left of the book?\nQ3: Is the book red?"


@pytest.mark.parametrize(
    "meta",
    [
        None,
        {},
        {"include": []},
        {"include": [{"class": "dog"}]},  # no count
        {"include": [{"count": 1}]},  # no class
        {"include": "dog"},
        {"include": [{"class": "dog", "count": 1}], "exclude": [{"class": "cat", "count": "2"}]},
    ],
)
def test_geneval_plus_rejects_bad_metadata(meta):
    with pytest.raises(ValueError, match="GenEval\\+\\+|geneval_plus"):
        geneval_plus_checklist(meta)


@pytest.mark.parametrize(
    "meta",
    [
        None,
        {"yn_question_list": [], "yn_answer_list": []},
        {"yn_question_list": ["a?"], "yn_answer_list": []},
        {"yn_question_list": "a?", "yn_answer_list": ["yes"]},
        {"yn_question_list": ["a?"], "yn_answer_list": ["maybe"]},
    ],
)
def test_tiif_rejects_bad_metadata(meta):
    with pytest.raises(ValueError):
        tiif_text("{questions}", "", meta)


# ------------------------------------------------------------------------------------------- parsers
@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ('{"correct": 1}', 1.0),
        ('{"correct": 0}', 0.0),
        ('```json\n{"correct": 1}\n```', 1.0),
        ('```\n{ "correct" : 0 }\n```', 0.0),
        ('The dogs are brown and on the left. {"correct": 1} Done.', 1.0),
        ('<think>is {it} right? {"correct": 0}</think>\n{"correct": 1}', 1.0),
        ('{"reason": "no {cat}", "correct": "0"}', 0.0),
        ('{"correct": true}', 1.0),
        ('{"correct": 1.0, "extra": {"nested": [1, 2]}}', 1.0),
        ('not json {broken} then {"correct": 0}', 0.0),
    ],
)
def test_parse_geneval_plus_golden(answer, expected):
    assert parse_geneval_plus(answer) == expected


@pytest.mark.parametrize(
    "answer",
    [
        "",
        "Yes, the image is correct.",
        "correct: 1",
        '{"correct": 1',  # truncated
        '{"Correct ": 1}',  # wrong key
        '{"answer": 1}',
        '{"correct": 2}',
        '{"correct": "maybe"}',
        '{"correct": null}',
        '["correct", 1]',
        "```json\n```",
    ],
)
def test_parse_geneval_plus_malformed_raises(answer):
    with pytest.raises(ValueError):
        parse_geneval_plus(answer)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ('{"Q1": "yes", "Q2": "yes", "Q3": "no"}', 1.0),
        ('{"Q1": "yes", "Q2": "no", "Q3": "no"}', 2 / 3),
        ('{"Q1": "no", "Q2": "no", "Q3": "yes"}', 0.0),
        ('```json\n{"q1": "Yes", "q2": "YES.", "q3": "No"}\n```', 1.0),
        ('Answers: {"Q1": true, "Q2": false, "Q3": false, "Q4": "yes"}', 2 / 3),
    ],
)
def test_parse_tiif_golden(answer, expected):
    assert parse_tiif(answer, TIIF_META) == pytest.approx(expected)


@pytest.mark.parametrize(
    "answer",
    [
        "",
        "Q1: yes\nQ2: yes\nQ3: no",
        '{"Q1": "yes", "Q2": "yes"}',
        '{"1": "yes", "2": "yes", "3": "no"}',
        '{"Q1": "yes", "Q2": "perhaps", "Q3": "no"}',
        '{"Q1": "yes", "Q2": "yes", "Q3": "no"',
    ],
)
def test_parse_tiif_malformed_raises(answer):
    with pytest.raises(ValueError):
        parse_tiif(answer, TIIF_META)


def test_extract_json_object_prefers_the_first_object():
    assert extract_json_object('a {"x": {"y": 1}} b {"z": 2}') == {"x": {"y": 1}}
    with pytest.raises(ValueError, match="no JSON object"):
        extract_json_object("[1, 2]")


# ------------------------------------------------------------------------- the judge client, end to end
def _fake_judge(answers: dict[str, str], seen: list[dict]) -> web.Application:
    """An OpenAI-compatible judge that answers with ``answers[key]``, key = the first prompt word."""

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "judge"}]})

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        text = body["messages"][-1]["content"][-1]["text"]
        key = text.split("Instruction: ", 1)[-1].split()[0] if "Instruction: " in text else "tiif"
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": answers[key]}}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def test_geneval_plus_judge_scores_and_counts_malformed_answers():
    answers = {
        "good": '```json\n{"correct": 1}\n```',
        "bad": 'The cat is missing. {"correct": 0}',
        "fenced": "```\nI think it is correct\n```",
        "wrongkey": '{"verdict": 1}',
    }
    seen: list[dict] = []
    meta = [GENEVAL_PLUS_META] * 4
    batch = RewardBatch(prompts=list(answers), images=torch.rand(4, 3, 16, 16), metadata=meta)
    with BackgroundServer(_fake_judge(answers, seen)) as server:
        strict = build_reward("geneval_plus", endpoints=[server.url + "/v1"], backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match="unparsable judge answer"):
            strict.score(batch)
        lenient = build_reward(
            "openai_judge", parser="geneval_plus", endpoints=[server.url + "/v1"], on_failure="nan"
        )
        result = lenient.score(batch)
    assert result.scores[:2].tolist() == [1.0, 0.0]
    assert torch.isnan(result.scores[2:]).all()  # counted failures, never 0
    stats = lenient.stats()
    assert stats["parse_failures"] == 2 and stats["nan_samples"] == 2
    assert strict.name == "geneval_plus" and lenient.name == "openai_judge"
    system, user = seen[-1]["messages"]
    assert system == {"role": "system", "content": GENEVAL_PLUS_SYSTEM}
    image_part, text_part = user["content"]
    assert image_part["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert text_part["text"].endswith("- No more than 2 dogs should appear.")
    assert seen[-1]["temperature"] == 0.0 and seen[-1]["max_tokens"] == 4096


def test_tiif_judge_scores_fractions():
    seen: list[dict] = []
    answers = {"tiif": json.dumps({"Q1": "yes", "Q2": "no", "Q3": "no"})}
    batch = RewardBatch(prompts=["a cup left of a book"], images=torch.rand(1, 3, 8, 8), metadata=[TIIF_META])
    with BackgroundServer(_fake_judge(answers, seen)) as server:
        judge = build_reward("tiif", endpoints=[server.url + "/v1"], model="judge")
        result = judge.score(batch)
    assert result.scores.tolist() == pytest.approx([2 / 3])
    assert len(seen[0]["messages"]) == 1  # no system prompt
    assert "Q2: Is the cup left of the book?" in seen[0]["messages"][0]["content"][-1]["text"]


def test_metadata_judges_fail_fast_without_metadata():
    judge = build_reward("tiif", endpoints=["http://127.0.0.1:9"])
    batch = RewardBatch(prompts=["x"], images=torch.rand(1, 3, 8, 8))
    with pytest.raises(ValueError, match="sample 0.*yn_question_list"):
        judge.score(batch)  # before any network call
    assert judge.stats().get("requests", 0) == 0


def test_templates_can_be_overridden_and_unknown_parsers_are_named():
    judge = build_reward(
        "openai_judge",
        parser="geneval_plus",
        endpoints=["h:1"],
        prompt_template="{checklist}",
        system_prompt="S",
    )
    batch = RewardBatch(prompts=["p"], images=torch.rand(1, 3, 8, 8), metadata=[GENEVAL_PLUS_META])
    assert judge.user_texts(batch)[0].startswith("This image should contain:") and judge.system_prompt == "S"
    with pytest.raises(UserError, match="geneval_plus, tiif"):
        build_reward("openai_judge", parser="nope", endpoints=["h:1"], prompt_template="{prompt}")
    assert not math.isnan(parse_geneval_plus('{"correct": 0}'))
