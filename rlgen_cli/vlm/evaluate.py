"""``rlgen eval`` for VLMs: MathVista-style accuracy, overall and per category.

The model answers each question with near-greedy decoding (``model.vlm.eval_*``: Qwen2-VL's own
temperature 0.01 / top-p 0.001 / top-k 1); the answer is the rest of the line after the last
"The final answer is:" (R1-VL's format, Zhang et al. 2025), compared with the ground truth by
math-verify when installed, else by :func:`rlgen_cli.rewards.r1vl.answers_match`. A response without
that phrase scores 0. Writes ``results.json`` (accuracy, per-category accuracy and counts, reward-mix
means, decoding settings) and ``samples.jsonl`` (one row per question), and prints a rich table.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.r1vl import TEXT_REWARDS, answer_accuracy, answers_match
from rlgen_cli.training.reporting.progress import Progress
from rlgen_cli.vlm.data import VLMExample, load_vlm_examples, prompt_text
from rlgen_cli.vlm.policy import VLMPolicy
from rlgen_cli.vlm.rollout import SamplingOptions, encode_prompts, generate, load_image

log = logging.getLogger(__name__)

__all__ = ["Answer", "answer_examples", "evaluate", "extract_final_answer", "summarise"]

RESULTS, SAMPLES = "results.json", "samples.jsonl"
_FINAL = re.compile(r"The final answer is:\s*(.*)", re.IGNORECASE)


@dataclass
class Answer:
    """One evaluated question."""

    example: VLMExample
    response: str
    prediction: str | None
    correct: bool


def extract_final_answer(response: str) -> str | None:
    """The rest of the line after the LAST "The final answer is:" (``###`` optional); None if absent."""
    matches = _FINAL.findall(response)
    if not matches:
        return None
    answer = matches[-1].strip().rstrip("#").strip()
    return answer or None


def is_correct(prediction: str | None, truth: str) -> bool:
    """math-verify (when installed) or the documented normaliser, on the extracted answer."""
    if prediction is None:
        return False
    return bool(answer_accuracy(f"### The final answer is: {prediction}", truth)) or answers_match(
        prediction, truth
    )


def sampling_options(policy: VLMPolicy) -> SamplingOptions:
    vlm = policy.cfg.vlm
    return SamplingOptions(vlm.eval_temperature, vlm.eval_top_p, vlm.eval_top_k, vlm.eval_max_new_tokens)


@torch.no_grad()
def answer_examples(
    policy: VLMPolicy, examples: list[VLMExample], batch_size: int, seed: int, progress: Progress
) -> list[Answer]:
    """Decode an answer for every example (batches of ``batch_size``) and grade it."""
    from rlgen_cli.vlm.rollout import check_context

    options = sampling_options(policy)
    vlm = policy.cfg.vlm
    answers: list[Answer] = []
    task = progress.task("eval", total=len(examples))
    for start in range(0, len(examples), batch_size):
        part = examples[start : start + batch_size]
        prompts = [prompt_text(policy.processor, ex, vlm.prompt_format, vlm.system_prompt) for ex in part]
        encoded = encode_prompts(policy, prompts, [load_image(ex.image) for ex in part])
        check_context(policy, encoded, options.max_new_tokens, [f"test #{ex.index}" for ex in part])
        done = generate(policy, encoded, options, seed=seed + start, record_logprobs=False)
        for ex, ids in zip(part, done.ids, strict=True):
            response = policy.tokenizer.decode(ids, skip_special_tokens=True)
            prediction = extract_final_answer(response)
            answers.append(Answer(ex, response, prediction, is_correct(prediction, ex.solution)))
        progress.advance(task, len(part))
    progress.remove(task)
    return answers


def summarise(answers: list[Answer]) -> dict[str, Any]:
    """Accuracy overall and per category (with counts)."""
    by_category: dict[str, list[bool]] = defaultdict(list)
    for answer in answers:
        by_category[answer.example.category or "all"].append(answer.correct)
    return {
        "accuracy": sum(a.correct for a in answers) / max(len(answers), 1),
        "num_samples": len(answers),
        "answered": sum(a.prediction is not None for a in answers) / max(len(answers), 1),
        "categories": {
            k: {"accuracy": sum(v) / len(v), "count": len(v)} for k, v in sorted(by_category.items())
        },
    }


def _reward_means(cfg: Any, answers: list[Answer]) -> dict[str, float]:
    """Means of the configured reward mix, which must score texts (``reward=r1vl`` or its parts)."""
    from rlgen_cli.rewards import RewardBatch, build_mix

    names = sorted(cfg.reward.weights)
    if not set(names) <= set(TEXT_REWARDS):
        raise UserError(
            f"reward.weights {names} score images; VLM evaluation scores texts: use reward=r1vl or any of "
            f"{', '.join(TEXT_REWARDS)}"
        )
    mix = build_mix(dict(cfg.reward.weights), **{k: dict(v) for k, v in cfg.reward.kwargs.items()})
    batch = RewardBatch(
        prompts=[a.example.problem for a in answers],
        texts=[a.response for a in answers],
        metadata=[dict(a.example.metadata) for a in answers],
    )
    result = mix.score(batch)
    return {"mix": result.scores.mean().item(), **{k: result.details[k].mean().item() for k in mix.rewards}}


def evaluate(cfg: Any, raw_cfg: Any) -> float:
    """``rlgen eval`` for a VLM (``EvalConfig``): results JSON + table; returns the overall accuracy."""
    from rlgen_cli.models.base import resolve_device
    from rlgen_cli.vlm.policy import load_vlm

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    examples = load_vlm_examples(cfg.data.test)
    examples = examples[: cfg.max_prompts or len(examples)]
    policy = load_vlm(cfg.model, cfg.checkpoint, resolve_device(cfg.device))
    with Progress(cfg.progress) as progress:
        answers = answer_examples(policy, examples, cfg.batch_size, cfg.seed, progress)
    summary = summarise(answers)
    summary |= {"rewards": _reward_means(cfg, answers), "checkpoint": cfg.checkpoint, "data": cfg.data.test}
    summary["decoding"] = sampling_options(policy).__dict__
    (run_dir / RESULTS).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    with (run_dir / SAMPLES).open("w", encoding="utf-8") as out:
        for a in answers:
            row = {"index": a.example.index, "category": a.example.category, "question": a.example.problem,
                   "answer": a.example.solution, "prediction": a.prediction, "correct": a.correct,
                   "response": a.response}  # fmt: skip
            out.write(json.dumps(row) + "\n")
    _print_table(summary, run_dir)
    return summary["accuracy"]


def _print_table(summary: dict[str, Any], run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"rlgen eval (VLM) — {summary['num_samples']} questions")
    for column in ("category", "accuracy", "count"):
        table.add_column(column, justify="left" if column == "category" else "right")
    for name, stats in summary["categories"].items():
        table.add_row(name, f"{stats['accuracy']:.2%}", str(stats["count"]))
    table.add_row("overall", f"{summary['accuracy']:.2%}", str(summary["num_samples"]), style="bold")
    console = Console()
    console.print(table)
    console.print(f"results: {run_dir / RESULTS}")
