"""Prompt builders and answer parsers of the metadata-aware VLM judges (docs/rewards.md, "VLM judges").

A :class:`JudgeSpec` says how one OpenAI-compatible judge (:class:`~rlgen_cli.rewards.remote.OpenAIJudgeReward`)
is asked about an image and how its answer becomes a score. Unlike the rubric judges (``unifiedreward``,
``qwenvl``), these two need each sample's metadata:

* ``geneval_plus`` — GenEval++ (R3): a strict system prompt; the user text is
  ``Instruction: {prompt}\\n\\nExplanation: {checklist}``, the checklist listing every ``include`` item
  (colour, size, count, class, region) and every ``exclude`` item. The judge answers JSON
  ``{"correct": 1|0}``; the score is that bit.
* ``tiif`` — TIIF-Bench: the ``yn_question_list`` questions as ``Q1: …``, ``Q2: …``; the judge answers
  JSON ``{"Q1": "yes", …}``; the score is the fraction of answers equal to ``yn_answer_list``.

Parsing strips ``<think>…</think>`` and Markdown code fences, then reads the first ``{…}`` that is a JSON
object. An answer without such an object, with the wrong keys or with values outside the allowed set
raises :class:`ValueError`; the judge client counts it (``parse_failures``) and raises or scores ``NaN``
— never 0. Templates are filled with ``str.replace`` (not ``format``), so JSON braces in them are safe.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GENEVAL_PLUS_SYSTEM",
    "GENEVAL_PLUS_TEMPLATE",
    "JUDGES",
    "TIIF_TEMPLATE",
    "JudgeSpec",
    "extract_json_object",
    "geneval_plus_checklist",
    "geneval_plus_text",
    "parse_geneval_plus",
    "parse_tiif",
    "tiif_questions",
    "tiif_text",
]

Metadata = Mapping[str, Any] | None

GENEVAL_PLUS_SYSTEM = (
    "You are an expert evaluator of text-to-image generation. You are given an instruction, an explanation "
    "that lists what the image must contain, and the generated image. Decide whether the image satisfies the "
    "instruction and every item of the explanation: the object classes, the exact number of each object, "
    "their colours, their spatial position in the image, and their size or relative scale. The image must "
    "also be a natural, coherent, single photo-like image: a cartoon, sketch, painting, collage, grid of "
    "panels or split-screen composition is incorrect. Be strict: if any requirement is not clearly met, "
    'the image is incorrect. Answer with JSON only: {"correct": 1} if the image satisfies everything, '
    'otherwise {"correct": 0}.'
)
GENEVAL_PLUS_TEMPLATE = "Instruction: {prompt}\n\nExplanation: {checklist}"
TIIF_TEMPLATE = (
    "Look carefully at the image and answer each yes/no question about it.\n\n{questions}\n\n"
    'Answer with JSON only, one key per question and the value "yes" or "no", for example '
    '{"Q1": "yes", "Q2": "no"}. Do not write anything else.'
)

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[A-Za-z0-9_-]*")
_TRUE = {"1", "true", "yes", "correct"}
_FALSE = {"0", "false", "no", "incorrect"}


@dataclass(frozen=True)
class JudgeSpec:
    """How a judge is asked about one sample and how its answer is scored.

    Attributes:
        name: Parser name (``openai_judge(parser=name)``).
        template: Default user text; ``{prompt}`` and the spec's own slots are replaced by ``fill``.
        system_prompt: Default system message, or ``None``.
        fill: ``fill(template, prompt, metadata) -> user text``; raises :class:`ValueError` on bad metadata.
        parse: ``parse(answer, metadata) -> score``; raises :class:`ValueError` on an unusable answer.
        needs_metadata: Whether every sample must carry metadata.
    """

    name: str
    template: str
    system_prompt: str | None
    fill: Callable[[str, str, Metadata], str]
    parse: Callable[[str, Metadata], float]
    needs_metadata: bool = False


def plain_spec(
    name: str, template: str, parse: Callable[[str], float], system_prompt: str | None = None
) -> JudgeSpec:
    """Wrap a metadata-free parser (``parse(text) -> float``) and a ``{prompt}`` template into a spec.

    Args:
        name: Parser name, for logs.
        template: User text with a ``{prompt}`` slot.
        parse: Turns the answer into a score; raises :class:`ValueError` when it cannot.
        system_prompt: Optional system message.

    Returns:
        The spec.
    """
    return JudgeSpec(
        name=name,
        template=template,
        system_prompt=system_prompt,
        fill=lambda tmpl, prompt, _meta: tmpl.replace("{prompt}", prompt),
        parse=lambda text, _meta: parse(text),
    )


# ------------------------------------------------------------------------------------------ parsing
def extract_json_object(text: str) -> dict[str, Any]:
    """Return the first JSON object in a judge answer.

    ``<think>…</think>`` blocks and Markdown code fences are removed first; then each ``{`` is tried in
    order and the first one that starts a valid JSON object wins (nested braces are fine).

    Args:
        text: The judge's answer.

    Returns:
        The decoded object.

    Raises:
        ValueError: If the answer holds no JSON object.
    """
    cleaned = _FENCE.sub("", _THINK.sub("", text or ""))
    decoder = json.JSONDecoder()
    start = cleaned.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(cleaned, start)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
        start = cleaned.find("{", start + 1)
    raise ValueError(f"no JSON object in the judge answer: {(text or '')[:200]!r}")


def _as_bit(value: Any, key: str) -> int:
    """``1``/``0`` from a JSON value that means yes/no (1, 0, true, false, "1", "yes", …)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float) and value in (0, 1):
        return int(value)
    if isinstance(value, str):
        word = value.strip().strip(".").lower()
        if word in _TRUE:
            return 1
        if word in _FALSE:
            return 0
    raise ValueError(f"{key!r} must be 1/0 (or yes/no, true/false), got {value!r}")


def parse_geneval_plus(text: str, _metadata: Metadata = None) -> float:
    """Score a GenEval++ answer: ``{"correct": 1}`` → 1.0, ``{"correct": 0}`` → 0.0.

    Args:
        text: The judge's answer (code fences and surrounding prose are tolerated).
        _metadata: Unused (the verdict does not depend on it).

    Returns:
        1.0 or 0.0.

    Raises:
        ValueError: No JSON object, no ``correct`` key, or a value that is not a yes/no bit.
    """
    answer = extract_json_object(text)
    if "correct" not in answer:
        raise ValueError(f"judge JSON has no 'correct' key (keys: {sorted(answer)[:10]})")
    return float(_as_bit(answer["correct"], "correct"))


def _yes_no(value: Any, key: str) -> str:
    """Normalise a yes/no answer or reference value to ``"yes"``/``"no"``."""
    return "yes" if _as_bit(value, key) else "no"


def parse_tiif(text: str, metadata: Metadata) -> float:
    """Score a TIIF answer: the fraction of ``Q1..Qn`` answered as in ``yn_answer_list``.

    Args:
        text: The judge's answer, JSON ``{"Q1": "yes", …}`` (code fences and prose tolerated).
        metadata: The sample's TIIF record (``yn_question_list``, ``yn_answer_list``).

    Returns:
        Matching answers / questions, in [0, 1].

    Raises:
        ValueError: No JSON object, a missing ``Qi`` key, or an answer that is not yes/no.
    """
    _, expected = tiif_questions(metadata)
    answer = {str(k).strip().upper(): v for k, v in extract_json_object(text).items()}
    missing = [f"Q{i}" for i in range(1, len(expected) + 1) if f"Q{i}" not in answer]
    if missing:
        raise ValueError(f"judge JSON lacks {missing} (keys: {sorted(answer)[:10]})")
    hits = sum(_yes_no(answer[f"Q{i}"], f"Q{i}") == ref for i, ref in enumerate(expected, start=1))
    return hits / len(expected)


# --------------------------------------------------------------------------------------- prompts
def _require_metadata(metadata: Metadata, judge: str, fields: str) -> Mapping[str, Any]:
    if not isinstance(metadata, Mapping):
        raise ValueError(
            f"the {judge} judge needs each sample's metadata ({fields}), got {type(metadata).__name__}; "
            "train on a dataset that carries it"
        )
    return metadata


def _include_line(item: Mapping[str, Any]) -> str:
    """``- {color}-colored {size} {count} {class} located in the {region} part of the image.``"""
    words = []
    if item.get("color"):
        words.append(f"{item['color']}-colored")
    if item.get("size"):
        words.append(str(item["size"]))
    words += [str(item["count"]), str(item["class"])]
    line = "- " + " ".join(words)
    if item.get("region"):
        line += f" located in the {item['region']} part of the image"
    return line + "."


def _exclude_line(item: Mapping[str, Any]) -> str:
    """``- No more than {count−1} {class}s should appear.``"""
    return f"- No more than {int(item['count']) - 1} {item['class']}s should appear."


def _items(metadata: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = metadata.get(key) or []
    if not isinstance(items, list) or not all(
        isinstance(it, Mapping) and "class" in it and isinstance(it.get("count"), int) for it in items
    ):
        raise ValueError(f"GenEval++ metadata {key!r} must be a list of {{'class', 'count': int, …}} dicts")
    return items


def geneval_plus_checklist(metadata: Metadata) -> str:
    """The "Explanation" of a GenEval++ sample: one line per ``include`` and per ``exclude`` item.

    Args:
        metadata: GenEval++ record (``include`` items with optional ``color``, ``size``, ``region``;
            optional ``exclude`` items).

    Returns:
        ``"This image should contain:\\n- …"``.

    Raises:
        ValueError: If the metadata is missing or has no well-formed ``include`` items.
    """
    meta = _require_metadata(metadata, "geneval_plus", "GenEval++ 'include'/'exclude'")
    include, exclude = _items(meta, "include"), _items(meta, "exclude")
    if not include:
        raise ValueError("GenEval++ metadata has no 'include' items; nothing to check the image against")
    lines = [_include_line(it) for it in include] + [_exclude_line(it) for it in exclude]
    return "This image should contain:\n" + "\n".join(lines)


def geneval_plus_text(template: str, prompt: str, metadata: Metadata) -> str:
    """Fill ``{prompt}`` and ``{checklist}`` of a GenEval++ user template."""
    return template.replace("{checklist}", geneval_plus_checklist(metadata)).replace("{prompt}", prompt)


def tiif_questions(metadata: Metadata) -> tuple[list[str], list[str]]:
    """The TIIF questions and their expected ``"yes"``/``"no"`` answers.

    Raises:
        ValueError: If the lists are missing, empty, of different lengths, or an answer is not yes/no.
    """
    meta = _require_metadata(metadata, "tiif", "'yn_question_list', 'yn_answer_list'")
    questions, answers = meta.get("yn_question_list"), meta.get("yn_answer_list")
    if not isinstance(questions, Sequence) or isinstance(questions, str) or not questions:
        raise ValueError("TIIF metadata needs a non-empty 'yn_question_list'")
    if not isinstance(answers, Sequence) or isinstance(answers, str) or len(answers) != len(questions):
        raise ValueError(
            f"TIIF metadata needs one 'yn_answer_list' entry per question ({len(questions)} questions)"
        )
    return [str(q).strip() for q in questions], [_yes_no(a, "yn_answer_list") for a in answers]


def tiif_text(template: str, prompt: str, metadata: Metadata) -> str:
    """Fill ``{questions}`` (``Q1: …`` lines) and ``{prompt}`` of a TIIF user template."""
    questions, _ = tiif_questions(metadata)
    listed = "\n".join(f"Q{i}: {q}" for i, q in enumerate(questions, start=1))
    return template.replace("{questions}", listed).replace("{prompt}", prompt)


JUDGES: dict[str, JudgeSpec] = {
    "geneval_plus": JudgeSpec(
        "geneval_plus",
        GENEVAL_PLUS_TEMPLATE,
        GENEVAL_PLUS_SYSTEM,
        geneval_plus_text,
        parse_geneval_plus,
        True,
    ),
    "tiif": JudgeSpec("tiif", TIIF_TEMPLATE, None, tiif_text, parse_tiif, True),
}
