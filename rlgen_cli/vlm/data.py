"""Datasets of the VLM recipes, from local files: R1-VL-10K, MathVista-style eval sets, ShareGPT SFT.

* **R1-VL-10K** (Zhang et al. 2025) — a json list (or jsonl) of ``{"image_path", "problem", "solution",
  "key_steps": {"Steps": [group, …]}}``; groups are normalised to lists of equivalent phrasings.
* **MathVista-style eval** — jsonl rows with an image (``image`` / ``image_path``), a question
  (``query`` / ``question`` / ``problem``), an ``answer`` (or ``solution``) and optionally a category
  (``category`` / ``task`` / ``question_type``; MathVista's ``metadata.task`` too).
* **ShareGPT SFT** (LLaMA-Factory ``sharegpt`` format, as R1-VL's warm-up) — jsonl (or a json list) of
  ``{"messages": [{"role", "content"}, …], "images": [path, …]}`` with one ``<image>`` placeholder per
  image in the user turns.

Relative image paths resolve against the data file's directory. ``builtin:NAME`` names a file shipped in
``rlgen_cli/assets/vlm`` (the tiny synthetic sets). Prompts are built as chat messages; the
``mulberry`` prompt format prefixes R1-VL's step-format instructions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlgen_cli.data.paths import read_utf8
from rlgen_cli.errors import UserError
from rlgen_cli.rewards.r1vl import normalize_key_steps

__all__ = [
    "SFTExample",
    "VLMExample",
    "build_messages",
    "drop_reflective",
    "load_sft",
    "load_vlm_examples",
    "prompt_text",
]

BUILTIN_PREFIX = "builtin:"
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "vlm"
IMAGE_PLACEHOLDER = "<image>"
MULBERRY_INSTRUCTIONS = (
    "Generate an image description based on the question.\n"
    "Then, provide a rationale to analyze the question.\n"
    "Next, generate a step-by-step reasoning process to solve the problem. Ensure the steps are logical "
    "and concise.\n"
    "Finally, provide a concise summary of the final answer in the following format: "
    "'The final answer is: xxx'.\n\n"
    "Format your response with the following sections, separated by ###:\n"
    "### Image Description:\n### Rationales:\n### Let's think step by step.\n### Step 1:\n### Step 2:\n...\n"
    "### The final answer is: \n\nQuestion: "
)
_QUESTION_KEYS = ("problem", "query", "question")
_ANSWER_KEYS = ("solution", "answer")
_IMAGE_KEYS = ("image_path", "image")
_CATEGORY_KEYS = ("category", "task", "question_type")


@dataclass(frozen=True)
class VLMExample:
    """One prompt of an RL or eval set.

    Attributes:
        index: Position in the file (the GRPO group key).
        problem: The question text.
        image: Absolute image path, or None for a text-only prompt.
        solution: Ground truth (R1-VL: the reference answer, possibly with ``### The final answer is:``).
        category: Eval category (MathVista task), or None.
        metadata: Reward inputs: ``solution``, ``key_steps`` (lists of variants), plus the raw row's extras.
    """

    index: int
    problem: str
    image: Path | None
    solution: str = ""
    category: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SFTExample:
    """One ShareGPT conversation: chat messages (images as ``{"type": "image"}`` parts) and their paths."""

    index: int
    messages: list[dict[str, Any]]
    images: list[Path]


def resolve_vlm_path(spec: str) -> Path:
    """``builtin:NAME`` → the packaged file under ``assets/vlm``; anything else → that existing path."""
    if spec.startswith(BUILTIN_PREFIX):
        path = ASSETS / spec[len(BUILTIN_PREFIX) :]
        if not path.is_file():
            shipped = ", ".join(sorted(p.name for p in ASSETS.glob("*.json*")))
            raise UserError(f"no built-in VLM data file {spec!r}; shipped: {shipped}")
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"VLM data file {spec!r} does not exist (looked at {path.resolve()})")
    return path


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a json list or a jsonl file; errors name the file and line."""
    text = read_utf8(path)
    try:
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: invalid JSON at line {err.lineno} ({err.msg})") from err
    if not all(isinstance(row, dict) for row in rows):
        raise UserError(f"{path}: every row must be a JSON object")
    return rows


def _first(row: dict[str, Any], keys: tuple[str, ...], *, where: str, required: bool = True) -> Any:
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    if required:
        raise UserError(f"{where}: no {' / '.join(keys)} field (has {sorted(row)})")
    return None


def _image_path(value: Any, root: Path, where: str) -> Path | None:
    if value is None:
        return None
    path = Path(value) if Path(value).is_absolute() else root / value
    if not path.is_file():
        raise UserError(f"{where}: image {value!r} not found (looked at {path})")
    return path


def load_vlm_examples(spec: str) -> list[VLMExample]:
    """An R1-VL-10K or MathVista-style file as :class:`VLMExample` rows (validated, images checked)."""
    path = resolve_vlm_path(spec)
    examples = []
    for i, row in enumerate(read_rows(path)):
        where = f"{path}, row {i}"
        category = _first(row, _CATEGORY_KEYS, where=where, required=False)
        if category is None and isinstance(row.get("metadata"), dict):
            category = row["metadata"].get("task")
        solution = str(_first(row, _ANSWER_KEYS, where=where))
        try:
            key_steps = normalize_key_steps(row.get("key_steps"))
        except ValueError as err:
            raise UserError(f"{where}: {err}") from err
        extras = {
            k: v for k, v in row.items() if isinstance(v, str | int | float | bool) and k not in _IMAGE_KEYS
        }
        examples.append(
            VLMExample(
                index=i,
                problem=str(_first(row, _QUESTION_KEYS, where=where)),
                image=_image_path(_first(row, _IMAGE_KEYS, where=where, required=False), path.parent, where),
                solution=solution,
                category=None if category is None else str(category),
                metadata={**extras, "solution": solution, "key_steps": key_steps},
            )
        )
    if not examples:
        raise UserError(f"{path} holds no examples")
    return examples


def build_messages(
    problem: str, has_image: bool, prompt_format: str, system_prompt: str | None
) -> list[dict]:
    """The chat messages of one prompt: optional system message, then the image and the question."""
    text = MULBERRY_INSTRUCTIONS + problem if prompt_format == "mulberry" else problem
    content: list[dict[str, Any]] = ([{"type": "image"}] if has_image else []) + [
        {"type": "text", "text": text}
    ]
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": content}]


def prompt_text(processor: Any, example: VLMExample, prompt_format: str, system_prompt: str | None) -> str:
    """The chat-templated prompt string of ``example``, ending with the assistant header."""
    messages = build_messages(example.problem, example.image is not None, prompt_format, system_prompt)
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _sharegpt_content(content: str, role: str) -> str | list[dict[str, Any]]:
    """A user turn's ``<image>`` placeholders become image parts; other turns stay strings."""
    if role != "user" or IMAGE_PLACEHOLDER not in content:
        return content
    parts: list[dict[str, Any]] = []
    for k, chunk in enumerate(content.split(IMAGE_PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if chunk.strip():
            parts.append({"type": "text", "text": chunk})
    return parts


def load_sft(spec: str) -> list[SFTExample]:
    """A ShareGPT jsonl as :class:`SFTExample` rows; placeholder and image counts must agree."""
    path = resolve_vlm_path(spec)
    examples = []
    for i, row in enumerate(read_rows(path)):
        where = f"{path}, row {i}"
        messages = row.get("messages")
        if not isinstance(messages, list) or not any(m.get("role") == "assistant" for m in messages):
            raise UserError(f"{where}: 'messages' must be a list of turns with at least one assistant turn")
        images = [_image_path(p, path.parent, where) for p in row.get("images", [])]
        placeholders = sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in messages)
        if placeholders != len(images):
            raise UserError(f"{where}: {placeholders} <image> placeholders but {len(images)} images")
        turns = [
            {"role": m["role"], "content": _sharegpt_content(str(m["content"]), m["role"])} for m in messages
        ]
        examples.append(SFTExample(index=i, messages=turns, images=[p for p in images if p is not None]))
    return examples


def drop_reflective(examples: list[SFTExample], markers: list[str]) -> tuple[list[SFTExample], int]:
    """Drop conversations whose assistant turns contain any of ``markers`` (R1-VL's warm-up filter).

    Returns:
        ``(kept, number_dropped)``.
    """
    if not markers:
        return examples, 0

    def reflective(example: SFTExample) -> bool:
        answers = " ".join(str(m["content"]) for m in example.messages if m["role"] == "assistant")
        return any(marker in answers for marker in markers)

    kept = [ex for ex in examples if not reflective(ex)]
    return kept, len(examples) - len(kept)
