"""Rule rewards of R1-VL (Zhang et al. 2025, "R1-VL: Learning to Reason with Multimodal Large Language
Models via Step-wise Group Relative Policy Optimization") and the usual GRPO text rewards.

Every reward exists twice: a TRL-compatible function ``(completions, **columns) -> list[float]`` (so it
plugs into ``trl.GRPOTrainer(reward_funcs=[...])`` as-is; completions may be strings or chat messages)
and an rlgen :class:`~rlgen_cli.rewards.base.Reward` in the registry, which reads the generated texts from
``RewardBatch.texts`` and the dataset columns (``solution``, ``key_steps``) from ``RewardBatch.metadata``.

* ``answer_accuracy`` — 1 if the answer is right. ``math_verify`` (a default dependency; ``auto`` picks
  it when importable) is upstream's order: the whole completion is parsed and verified against the
  solution, else the rest of the answer line (or the whole stripped text when there is no answer
  header) must equal the solution's, an empty answer matching an empty ground truth; ``exact`` is that
  string fallback alone; ``normalizer`` compares the text after ``### The final answer is:`` with
  :func:`answers_match` (boxed/text/dollar unwrapping, case, trailing dot, thousands commas, numeric
  equality incl. simple fractions, option letters) and pays 0 without an answer.
* ``step_rar`` — StepRAR: the ``### Step N:`` bodies are joined and lower-cased; a key-step group (a list
  of equivalent phrasings) matches when any variant is a substring; reward ``scale · matched/total``
  (0.1·k). ``mode=r1vl`` pays it even without a final answer (upstream code); ``mode=paper`` pays 0 then.
* ``step_rvr`` — StepRVR: 1 iff ``### Image Description:``, ``### Rationales:``, ``### Step 1:`` and
  ``### The final answer is:`` are present (upstream's four), the steps are numbered 1..N in order and
  the (first) answer header comes after the last step; else 0. ``mode=r1vl`` (upstream code) waives
  the last condition when the completion ends with an empty answer header; ``strict`` never does.
* ``think_format`` — 1 iff the completion is ``<think>…</think><answer>…</answer>`` (R1-V / TRL format).
* ``length`` — ``min(len, target) / target`` in characters or whitespace words (a reward that varies,
  for smoke tests and length shaping).

R1-VL's reward is ``answer_accuracy + step_rar + step_rvr`` ∈ [0, 2.1] (``reward=r1vl``).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.registry import NoKwargs, register

__all__ = [
    "FINAL_ANSWER",
    "REQUIRED_HEADERS",
    "accuracy_reward",
    "answer_accuracy",
    "answers_match",
    "extract_answer",
    "key_step_fraction",
    "length_reward",
    "length_score",
    "normalize_key_steps",
    "step_rar",
    "step_rar_reward",
    "step_rvr",
    "step_rvr_reward",
    "think_format",
    "think_format_reward",
]

FINAL_ANSWER = "### The final answer is:"
REQUIRED_HEADERS = ("### Image Description:", "### Rationales:", "### Step 1:", FINAL_ANSWER)
ACCURACY_BACKENDS = ("auto", "math_verify", "normalizer", "exact")
RAR_MODES = ("r1vl", "paper")
RVR_MODES = ("r1vl", "strict")
_STEP_HEADER = re.compile(r"### Step (\d+):")
_STEP_BODY = re.compile(r"### Step \d+:\s*(.*?)(?=\n###|\Z)", re.DOTALL)
_ANSWER_LINE = re.compile(r"### The final answer is:\s*\n?(.*)")
_THINK_ANSWER = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_WRAPPERS = re.compile(r"\\(?:boxed|text|mathrm|textbf|mathbf|operatorname)\{([^{}]*)\}")
_FRAC = re.compile(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}")
_LATEX_NOISE = re.compile(r"\\left|\\right|\\[,!;: ]|\^\{?\\circ\}?|°|\\%|%|\$|\\\(|\\\)|\\\[|\\\]")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_CHOICE = re.compile(r"^\(?([a-z])\)?(?:[.:)]|\s|$)")
_TRAILING_ZEROS = re.compile(r"(\d+)\.(\d*?)0+\b")
_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:/[-+]?(?:\d+\.?\d*|\.\d+))?$")


# -- parsing --------------------------------------------------------------------------------------
def completion_text(completion: Any) -> str:
    """The text of one completion: a string, or TRL's chat form ``[{"role": …, "content": …}]``."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        content = completion[-1].get("content", "")
        if isinstance(content, str):
            return content
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    raise TypeError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}; "
        "pass the decoded completion texts"
    )


def extract_answer(text: str) -> str | None:
    """The rest of the line after the first ``### The final answer is:`` (None when absent or empty)."""
    match = _ANSWER_LINE.search(text)
    if match is None:
        return None
    answer = match.group(1).strip()
    return answer or None


def normalize_key_steps(value: Any) -> list[list[str]]:
    """R1-VL-10K ``key_steps`` (``{"Steps": [group, …]}`` or the list itself) as lists of variants.

    ``value`` may also be that object or list serialised as a JSON string: dataset libraries that need one
    type per column (R1-VL-10K mixes strings and lists inside ``Steps``) store it that way.

    Raises:
        ValueError: If a string is not such JSON, or a group is neither a string nor a list of strings.
    """
    if isinstance(value, str):
        value = _decoded_key_steps(value)
    groups = value.get("Steps", []) if isinstance(value, Mapping) else (value or [])
    out: list[list[str]] = []
    for group in groups:
        variants = [group] if isinstance(group, str) else list(group)
        if not variants or not all(isinstance(v, str) for v in variants):
            raise ValueError(
                f"key-step group {group!r} must be a string or a non-empty list of strings "
                "(R1-VL-10K: key_steps.Steps = [group, …])"
            )
        out.append(variants)
    return out


def _decoded_key_steps(text: str) -> Any:
    """A JSON-encoded ``key_steps`` decoded; never iterated as characters."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        value, reason = None, f"not JSON ({err.msg} at character {err.pos})"
    else:
        reason = f"JSON of a {type(value).__name__}"
    if not isinstance(value, Mapping | list):
        raise ValueError(
            f'key_steps is a string, {reason}: {text[:80]!r}; give {{"Steps": [group, …]}} or the list of '
            "groups, as an object or as its JSON encoding"
        )
    return value


# -- answer normalisation -------------------------------------------------------------------------
def _unwrap_latex(text: str) -> str:
    previous = None
    while previous != text:  # nested wrappers unwrap from the inside out
        previous = text
        text = _WRAPPERS.sub(r"\1", text)
        text = _FRAC.sub(r"\1/\2", text)
    return _LATEX_NOISE.sub("", text)


def normalize_answer(text: str) -> str:
    """Canonical form used by the ``normalizer`` backend (documented in the module docstring)."""
    text = _unwrap_latex(text.strip())
    text = _THOUSANDS.sub("", text).lower().strip()
    text = re.sub(r"\s+", " ", text).rstrip(".").strip()
    return text


def _as_number(text: str) -> float | None:
    compact = text.replace(" ", "")
    if not _NUMBER.match(compact):
        return None
    num, _, den = compact.partition("/")
    try:
        return float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(prediction: str, truth: str) -> bool:
    """Whether two final answers agree after :func:`normalize_answer` (numbers compared as numbers)."""
    pred, gold = normalize_answer(prediction), normalize_answer(truth)
    if pred == gold or pred.replace(" ", "") == gold.replace(" ", ""):
        return True
    pred_num, gold_num = _as_number(pred), _as_number(gold)
    if pred_num is not None and gold_num is not None:
        return math.isclose(pred_num, gold_num, rel_tol=1e-6, abs_tol=1e-9)
    pred_choice, gold_choice = _CHOICE.match(pred), _CHOICE.match(gold)
    if pred_choice and gold_choice and (len(gold) == 1 or len(pred) == 1):
        return pred_choice.group(1) == gold_choice.group(1)
    return False


def _math_verify(completion: str, solution: str) -> bool:
    from math_verify import parse, verify

    try:
        return float(verify(parse(completion), parse(solution))) > 0
    except Exception:  # noqa: BLE001 — math-verify raises on unparsable text; upstream treats it as "no"
        return False


@functools.cache
def _has_math_verify() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _answer_or_whole(text: str) -> str:
    """R1-VL's string fallback operand: the (possibly empty) rest of the answer line, or the whole text
    stripped when there is no answer header. An empty answer is kept as "" (it equals an empty truth)."""
    match = _ANSWER_LINE.search(text)
    return match.group(1).strip() if match else text.strip()


def answer_accuracy(completion: str, solution: str, backend: str = "auto") -> float:
    """1.0 if ``completion`` answers ``solution`` correctly, else 0.0 (see the module docstring)."""
    if backend not in ACCURACY_BACKENDS:
        raise ValueError(f"answer_accuracy backend={backend!r}; choose one of {', '.join(ACCURACY_BACKENDS)}")
    if backend == "math_verify" and not _has_math_verify():
        raise ImportError("answer_accuracy backend=math_verify needs `pip install math-verify`")
    if backend in ("auto", "math_verify") and _has_math_verify() and _math_verify(completion, solution):
        return 1.0
    if backend == "exact" or (backend in ("auto", "math_verify") and _has_math_verify()):
        return float(_answer_or_whole(completion) == _answer_or_whole(solution))  # upstream's fallback
    answer, truth = extract_answer(completion), extract_answer(solution) or solution.strip()
    return float(answer is not None and answers_match(answer, truth))


# -- StepRAR / StepRVR ----------------------------------------------------------------------------
def _match_form(text: str, whitespace: bool, latex: bool, numbers: bool) -> str:
    text = text.lower()
    if latex:
        text = _unwrap_latex(text)
    if numbers:  # 1,000 → 1000; 3.50 → 3.5; 3.0 → 3
        text = _TRAILING_ZEROS.sub(lambda m: m.group(1) + (f".{m.group(2)}" if m.group(2) else ""), text)
        text = _THOUSANDS.sub("", text)
    if whitespace:
        text = re.sub(r"\s+", " ", text).strip()
    return text


def key_step_fraction(
    completion: str, key_steps: Any, *, whitespace: bool = False, latex: bool = False, numbers: bool = False
) -> float:
    """k = matched key-step groups / total groups over the joined ``### Step N:`` bodies (0 if none)."""
    groups = normalize_key_steps(key_steps)
    if not groups:
        return 0.0
    steps = " ".join(_STEP_BODY.findall(completion))
    haystack = _match_form(steps, whitespace, latex, numbers)
    matched = sum(
        any(_match_form(v, whitespace, latex, numbers) in haystack for v in variants) for variants in groups
    )
    return matched / len(groups)


def step_rar(
    completion: str, key_steps: Any, *, mode: str = "r1vl", scale: float = 0.1, **norm: bool
) -> float:
    """StepRAR bonus ``scale · k``; ``mode=paper`` pays 0 when there is no final answer."""
    if mode not in RAR_MODES:
        raise ValueError(f"step_rar mode={mode!r}; choose one of {', '.join(RAR_MODES)}")
    if mode == "paper" and extract_answer(completion) is None:
        return 0.0
    return scale * key_step_fraction(completion, key_steps, **norm)


def step_rvr(completion: str, mode: str = "r1vl") -> float:
    """StepRVR: 1.0 iff complete (four headers) and logical (steps 1..N, answer after the last step).

    ``mode=r1vl`` skips the answer-after-the-last-step check when the completion ends with an empty
    answer header (upstream code); ``strict`` always applies it.
    """
    if mode not in RVR_MODES:
        raise ValueError(f"step_rvr mode={mode!r}; choose one of {', '.join(RVR_MODES)}")
    if any(header not in completion for header in REQUIRED_HEADERS):
        return 0.0
    steps = list(_STEP_HEADER.finditer(completion))
    if [int(m.group(1)) for m in steps] != list(range(1, len(steps) + 1)):
        return 0.0
    if mode == "r1vl" and completion.strip().endswith(FINAL_ANSWER):
        return 1.0
    return float(completion.find(FINAL_ANSWER) >= steps[-1].end())


def think_format(completion: str) -> float:
    """1.0 iff the completion is exactly ``<think>…</think><answer>…</answer>`` (whitespace around ok)."""
    return float(_THINK_ANSWER.fullmatch(completion.strip()) is not None)


def length_score(completion: str, target: int = 256, unit: str = "chars") -> float:
    """``min(len, target) / target`` with ``len`` in characters (``chars``) or words (``words``)."""
    if unit not in ("chars", "words") or target <= 0:
        raise ValueError(f"length reward needs unit in (chars, words) and target > 0, got {unit!r}, {target}")
    size = len(completion) if unit == "chars" else len(completion.split())
    return min(size, target) / target


# -- TRL-compatible functions ---------------------------------------------------------------------
def accuracy_reward(
    completions: Sequence[Any], solution: Sequence[str], backend: str = "auto", **_: Any
) -> list[float]:
    """TRL reward function: :func:`answer_accuracy` per completion (dataset column ``solution``)."""
    return [
        answer_accuracy(completion_text(c), s, backend) for c, s in zip(completions, solution, strict=True)
    ]


def step_rar_reward(completions: Sequence[Any], key_steps: Sequence[Any], **kwargs: Any) -> list[float]:
    """TRL reward function: :func:`step_rar` per completion (dataset column ``key_steps``)."""
    options = {k: kwargs[k] for k in ("mode", "scale", "whitespace", "latex", "numbers") if k in kwargs}
    return [step_rar(completion_text(c), k, **options) for c, k in zip(completions, key_steps, strict=True)]


def step_rvr_reward(completions: Sequence[Any], mode: str = "r1vl", **_: Any) -> list[float]:
    """TRL reward function: :func:`step_rvr` per completion."""
    return [step_rvr(completion_text(c), mode) for c in completions]


def think_format_reward(completions: Sequence[Any], **_: Any) -> list[float]:
    """TRL reward function: :func:`think_format` per completion."""
    return [think_format(completion_text(c)) for c in completions]


def length_reward(
    completions: Sequence[Any], target: int = 256, unit: str = "chars", **_: Any
) -> list[float]:
    """TRL reward function: :func:`length_score` per completion."""
    return [length_score(completion_text(c), target, unit) for c in completions]


# -- rlgen rewards --------------------------------------------------------------------------------
@dataclass
class TextRuleReward:
    """An rlgen reward scoring ``RewardBatch.texts`` with ``fn(text, metadata) -> float``.

    Attributes:
        name: Registry name (log key).
        fn: Per-sample scorer.
        needs: Metadata keys every sample must carry.
    """

    name: str
    fn: Callable[[str, Mapping[str, Any]], float]
    needs: tuple[str, ...] = field(default=())

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score every generated text of ``batch``.

        Raises:
            ValueError: If the batch has no texts or a sample lacks a needed metadata key.
        """
        if batch.texts is None:
            raise ValueError(f"reward {self.name!r} scores generated texts but RewardBatch.texts is None")
        metadata = batch.metadata or [{} for _ in batch.texts]
        for i, meta in enumerate(metadata):
            missing = [key for key in self.needs if key not in meta]
            if missing:
                raise ValueError(
                    f"reward {self.name!r} needs metadata {missing} but sample {i} has {sorted(meta)}; "
                    "use a dataset that carries them (R1-VL-10K json: solution, key_steps)"
                )
        scores = [self.fn(text, meta) for text, meta in zip(batch.texts, metadata, strict=True)]
        return RewardResult(scores=torch.tensor(scores, dtype=torch.float32))


@dataclass
class AnswerAccuracyKwargs:
    """``reward.kwargs.answer_accuracy``."""

    backend: str = "auto"
    """How answers are compared (see :func:`answer_accuracy`)."""


@dataclass
class StepRARKwargs:
    """``reward.kwargs.step_rar`` (see :func:`step_rar`)."""

    mode: str = "r1vl"
    scale: float = 0.1
    whitespace: bool = False
    latex: bool = False
    numbers: bool = False


@dataclass
class StepRVRKwargs:
    """``reward.kwargs.step_rvr`` (see :func:`step_rvr`)."""

    mode: str = "r1vl"


@dataclass
class LengthKwargs:
    """``reward.kwargs.length`` (see :func:`length_score`)."""

    target: int = 256
    unit: str = "chars"


@register("answer_accuracy", kwargs=AnswerAccuracyKwargs)
def build_answer_accuracy(backend: str = "auto") -> TextRuleReward:
    """``answer_accuracy``: 0/1 against ``metadata["solution"]``."""
    answer_accuracy("", "", backend)  # validates the backend now, not at the first rollout
    return TextRuleReward(
        "answer_accuracy", lambda t, m: answer_accuracy(t, m["solution"], backend), ("solution",)
    )


@register("step_rar", kwargs=StepRARKwargs)
def build_step_rar(
    mode: str = "r1vl",
    scale: float = 0.1,
    whitespace: bool = False,
    latex: bool = False,
    numbers: bool = False,
) -> TextRuleReward:
    """``step_rar``: StepRAR bonus against ``metadata["key_steps"]``."""
    score = partial(step_rar, mode=mode, scale=scale, whitespace=whitespace, latex=latex, numbers=numbers)
    score("", [])  # validates the mode
    return TextRuleReward("step_rar", lambda t, m: score(t, m["key_steps"]), ("key_steps",))


@register("step_rvr", kwargs=StepRVRKwargs)
def build_step_rvr(mode: str = "r1vl") -> TextRuleReward:
    """``step_rvr``: StepRVR validity."""
    step_rvr("", mode)  # validates the mode
    return TextRuleReward("step_rvr", lambda t, m: step_rvr(t, mode))


@register("think_format", kwargs=NoKwargs)
def build_think_format() -> TextRuleReward:
    """``think_format``: ``<think>…</think><answer>…</answer>``."""
    return TextRuleReward("think_format", lambda t, m: think_format(t))


@register("length", kwargs=LengthKwargs)
def build_length(target: int = 256, unit: str = "chars") -> TextRuleReward:
    """``length``: ``min(len, target) / target``."""
    length_score("", target, unit)  # validates the options
    return TextRuleReward("length", lambda t, m: length_score(t, target, unit))


TEXT_REWARDS = ("answer_accuracy", "step_rar", "step_rvr", "think_format", "length", "char_fraction")
"""Rewards that score generated texts only (the VLM recipes accept these)."""
