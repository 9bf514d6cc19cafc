"""qwenvl judge: pure parsers, message construction, and end to end on a tiny random Qwen-VL (offline)."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.vlm_judge import DEFAULT_RUBRIC, build_messages, parse_final_score, parse_score_tag


@pytest.mark.parametrize(
    "text,expected",
    [
        ("<Score>4</Score>", 4.0),
        ("<Thought>fine</Thought>\n<Score> 3 </Score>", 3.0),
        ("<score>2.5</score>", 2.5),
        ("template <Score>X</Score> then <Score>5</Score>", 5.0),  # last valid tag wins
        ("<Score>1</Score> … revised: <Score>2</Score>", 2.0),
        ("<Score>0</Score>", None),  # out of range
        ("<Score>6</Score>", None),
        ("<Score>X</Score>", None),
        ("Score: 4", None),
        ("", None),
    ],
)
def test_parse_score_tag(text, expected):
    assert parse_score_tag(text) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("The image is good.\nFinal Score: 4", 4.0),
        ("**Final Score:** 3.5", 3.5),
        ("final score: 5\n", 5.0),
        ("Final Score: 9", None),
        ("Score 4", None),
    ],
)
def test_parse_final_score(text, expected):
    assert parse_final_score(text) == expected


def test_parse_score_tag_custom_range():
    assert parse_score_tag("<Score>9</Score>", low=0, high=10) == 9.0


def test_build_messages_puts_image_then_rubric_and_fills_prompt():
    messages = build_messages("Does it show {prompt}? <Score>X</Score>", "a cat")
    assert messages == [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Does it show a cat? <Score>X</Score>"}],
        }
    ]
    assert build_messages(DEFAULT_RUBRIC, "x")[0]["content"][1]["text"] == DEFAULT_RUBRIC
    assert "<Score>" in DEFAULT_RUBRIC


def test_factory_validates_without_loading():
    judge = build_reward("qwenvl", model_path="/nonexistent", device="cpu", local_files_only=True)
    assert judge.name == "qwenvl" and judge._model is None
    with pytest.raises(ValueError, match="max_new_tokens"):
        build_reward("qwenvl", max_new_tokens=0)
    with pytest.raises(ValueError, match="needs images"):
        judge.score(RewardBatch(prompts=["a"]))


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory):
    from rlgen_cli.models.tiny import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_qwen25vl"), kind="qwen2_5_vl")


def _judge(path, **kwargs):
    kwargs = {
        "device": "cpu",
        "dtype": "float32",
        "local_files_only": True,
        "max_new_tokens": 6,
        "batch_size": 2,
    } | kwargs
    return build_reward("qwenvl", model_path=str(path), **kwargs)


def test_tiny_vlm_judge_runs_end_to_end(tiny_vlm_dir):
    judge = _judge(tiny_vlm_dir)
    result = judge.score(RewardBatch(prompts=["a cat", "a dog", "a cow"], images=torch.rand(3, 3, 20, 28)))
    scores, unparsed = result.scores, result.details["unparsed"]
    assert scores.shape == (3,) and len(result.details["answers"]) == 3
    for score, bad in zip(scores.tolist(), unparsed.tolist()):
        assert (bad == 1.0 and math.isnan(score)) or (bad == 0.0 and 0.2 <= score <= 1.0)
    assert not (scores == 0).any()  # an unparsable answer is NaN, never 0
    vision_ids = set(judge._suppressed_ids(judge._processor.tokenizer))
    assert len(vision_ids) == 4


def test_tiny_vlm_judge_decodes_and_scores_a_scripted_answer(tiny_vlm_dir, monkeypatch):
    """Replace only ``generate``: checks greedy kwargs, left-padding slicing, decoding and X/5."""
    judge = _judge(tiny_vlm_dir)
    model, processor = judge.load()
    answers = iter(["<Score>4</Score>", "no idea", "<Score>2</Score>"])
    seen: list[dict] = []

    def fake_generate(input_ids, **kwargs):
        seen.append(kwargs)
        rows = [
            processor.tokenizer(next(answers) + "<|im_end|>")["input_ids"] for _ in range(input_ids.shape[0])
        ]
        width = max(map(len, rows))
        pad = processor.tokenizer.pad_token_id
        new = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        return torch.cat([input_ids, new], dim=1)

    monkeypatch.setattr(model, "generate", fake_generate)
    result = judge.score(RewardBatch(prompts=["long " * 10, "b", "c"], images=torch.rand(3, 1, 16, 24)))
    assert result.scores[0].item() == pytest.approx(0.8) and result.scores[2].item() == pytest.approx(0.4)
    assert math.isnan(result.scores[1].item()) and result.details["unparsed"].tolist() == [0.0, 1.0, 0.0]
    assert seen[0]["do_sample"] is False and seen[0]["max_new_tokens"] == 6
    assert {"top_k", "top_p", "temperature"} <= set(seen[0]) and seen[0]["suppress_tokens"]
    assert processor.tokenizer.padding_side == "left"


def test_tiny_qwen2_vl_family_loads_through_auto_classes(tmp_path):
    from rlgen_cli.models.tiny import save_tiny_vlm

    judge = _judge(save_tiny_vlm(tmp_path / "q2", kind="qwen2_vl"), batch_size=1)
    result = judge.score(RewardBatch(prompts=["a"], images=torch.rand(1, 3, 16, 16)))
    assert result.scores.shape == (1,) and result.details["unparsed"].numel() == 1
    assert type(judge._model).__name__ == "Qwen2VLForConditionalGeneration"
