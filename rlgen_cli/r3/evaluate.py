"""Multi-round evaluation of a unified policy: generate, then up to ``eval_rounds`` reflect → refine rounds.

Round 0 plans (greedy text) and draws (ODE) an image per prompt. Each later round reflects on every
unfinished sample's current image; a sample that answers "no further edit needed" stops and keeps its
image (auto-stop), the others are edited (ODE) and rescored. Sample i's noise is stream (seed, round, i),
so two evaluations of the same weights agree. ``r3/metrics.py`` turns the per-round scores into accuracy
per round and tag, improved / worse / unchanged fractions and the finish rate; :func:`save_strips` writes
one row per sample and one column per round.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlgen_cli.r3.data import R3Sample
from rlgen_cli.r3.metrics import (
    RoundMetrics,
    carry_forward,
    format_round_table,
    round_metrics,
    save_round_strips,
)
from rlgen_cli.r3.policy import EDIT, GENERATE, UnifiedPolicy
from rlgen_cli.r3.rewards import NO_EDIT, extract_instruction, extract_plan, is_no_edit
from rlgen_cli.r3.rollout import image_rollout, text_rollout
from rlgen_cli.r3.scoring import R3Scorer
from rlgen_cli.schema.r3 import R3Config
from rlgen_cli.sde.rollout import StepSpec
from rlgen_cli.sde.window import WindowPlan
from rlgen_cli.vlm.rollout import SamplingOptions

__all__ = ["RoundResult", "build_unified", "evaluate_rounds", "load_unified", "run_evaluation", "save_strips"]

ODE = StepSpec("ode", 0.0)
RESULTS, SAMPLES, STRIPS = "results.json", "samples.jsonl", "round_strips.png"


@dataclass
class RoundResult:
    """Everything a multi-round evaluation produced; R = rounds + 1, N samples.

    Attributes:
        metrics: Accuracy per round and tag, change fractions, finish rate.
        scores: (R, N) the score of the image each sample holds after each round.
        stop_round: (N,) the round whose reflection stopped the sample (R when it never stopped).
        images: R tensors (N, 3, H, W): the image each sample holds after each round.
        texts: R lists of N texts: the plan (round 0), then each round's reflection ("" once stopped).
    """

    metrics: RoundMetrics
    scores: Tensor
    stop_round: Tensor
    images: list[Tensor]
    texts: list[list[str]]


def _greedy(max_new_tokens: int) -> SamplingOptions:
    return SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens)


def _ode(
    policy: UnifiedPolicy, encode, stage: str, steps: int, rows: list[int], seed: int, round_: int
) -> Tensor:
    """ODE images of ``rows`` (their own noise streams), on the CPU."""
    plan = WindowPlan(steps, (), ())
    return image_rollout(policy, encode, stage, plan, ODE, rows, rows, seed, round_, None).images


def _generate(policy: UnifiedPolicy, prompts: list[str], r3: R3Config, seed: int) -> tuple[Tensor, list[str]]:
    n = len(prompts)
    thoughts = text_rollout(
        lambda rows, s: policy.think(prompts[rows], _greedy(r3.max_output_token_n_gen), s),
        n,
        None,
        seed,
        0,
        0,
    )
    plans = [extract_plan(t) for t in thoughts.texts]
    images = _ode(
        policy,
        lambda rows: policy.encode_generate(prompts[rows], plans[rows]),
        GENERATE,
        r3.steps_gen,
        list(range(n)),
        seed,
        0,
    )
    return images, thoughts.texts


def _refine_round(
    policy: UnifiedPolicy,
    images: Tensor,
    prompts: list[str],
    rows: list[int],
    r3: R3Config,
    seed: int,
    round_: int,
) -> tuple[list[str], Tensor, Tensor]:
    """Reflections of ``images`` (the M samples ``rows``), which of them stop, and the edits of all."""
    m = len(prompts)
    thoughts = text_rollout(
        lambda rows, s: policy.reflect(images[rows], prompts[rows], _greedy(r3.max_output_token_n_edit), s),
        m,
        None,
        seed,
        round_,
        0,
    )
    stop = torch.tensor([is_no_edit(t) for t in thoughts.texts], dtype=torch.bool)
    instructions = [extract_instruction(t) or NO_EDIT for t in thoughts.texts]
    edited = _ode(
        policy,
        lambda part: policy.encode_edit(images[part], instructions[part]),
        EDIT,
        r3.steps_edit,
        rows,
        seed,
        round_,
    )
    return thoughts.texts, stop, edited


def _resize(images: Tensor, like: Tensor) -> Tensor:
    if images.shape[-2:] == like.shape[-2:]:
        return images
    return F.interpolate(images, size=like.shape[-2:], mode="bilinear", antialias=True).clamp(0, 1)


@torch.no_grad()
def evaluate_rounds(
    policy: UnifiedPolicy, samples: Sequence[R3Sample], scorer: R3Scorer, r3: R3Config, seed: int
) -> RoundResult:
    """Generate, then up to ``r3.eval_rounds`` reflect → refine rounds with auto-stop (see the module)."""
    samples = list(samples)
    n, rounds = len(samples), r3.eval_rounds + 1
    prompts = [s.prompt for s in samples]
    current, plans = _generate(policy, prompts, r3, seed)
    scores = torch.zeros(rounds, n)
    scores[0] = scorer.score(current, samples)
    stop_round = torch.full((n,), rounds, dtype=torch.long)
    history, texts = [current.clone()], [plans]
    for round_ in range(1, rounds):
        active = (stop_round == rounds).nonzero().squeeze(1).tolist()
        said, current = [""] * n, current.clone()
        scores[round_] = scores[round_ - 1]
        if active:
            reflections, stop, edited = _refine_round(
                policy, current[active], [prompts[i] for i in active], active, r3, seed, round_
            )
            for j, i in enumerate(active):
                said[i] = reflections[j]
                if stop[j]:
                    stop_round[i] = round_
            changed = [i for j, i in enumerate(active) if not stop[j]]
            if changed:
                new = _resize(edited[~stop], current)
                current[changed] = new
                scores[round_, changed] = scorer.score(new, [samples[i] for i in changed])
        history.append(current.clone())
        texts.append(said)
    carried, finished = carry_forward(scores, stop_round)
    metrics = round_metrics(carried, [s.tag for s in samples], finished)
    return RoundResult(metrics, carried, stop_round, history, texts)


def save_strips(result: RoundResult, path: Path) -> Path:
    """One PNG: a row per sample, a column per round (small images enlarged)."""
    side = result.images[0].shape[-1]
    return save_round_strips(result.images, Path(path), upscale=max(1, 128 // side))


def build_unified(family: str, policy: Any, device: torch.device) -> UnifiedPolicy:
    """The unified policy ``model.family`` names, built from the ``r3.policy`` section ``policy``."""
    if family == "r3_bagel":
        from rlgen_cli.r3.bagel import build_bagel_unified

        return build_bagel_unified(policy, device)
    from rlgen_cli.r3.composite import build_composite

    return build_composite(policy, device)


def load_unified(
    cfg: R3Config, checkpoint: str | None, device: torch.device, family: str = "r3_composite"
) -> UnifiedPolicy:
    """The unified policy of ``cfg.policy``, or of ``checkpoint``'s own ``r3.policy`` with its trained
    weights (``family``: ``model.family``, which decides the kind)."""
    if checkpoint is None:
        return build_unified(family, cfg.policy, device)
    from omegaconf import OmegaConf

    from rlgen_cli.schema.r3 import typed_policy
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    ckpt = open_checkpoint(checkpoint)
    saved = typed_policy(family, ckpt.config().r3.policy)
    policy = build_unified(family, OmegaConf.to_object(saved), device)
    policy.load_trainable(ckpt.weights)
    return policy


def run_evaluation(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """``rlgen eval`` of a unified policy: results.json, samples.jsonl, round strips; returns the summary."""
    from rlgen_cli.models import resolve_device
    from rlgen_cli.r3.data import load_r3_dataset

    r3 = cfg.r3
    samples = load_r3_dataset(r3.data_paths()[1], r3.dataset_name)[: cfg.max_prompts or None]
    policy = load_unified(r3, cfg.checkpoint, resolve_device(cfg.device), cfg.model.family)
    result = evaluate_rounds(policy, samples, R3Scorer(r3, cfg.reward), r3, cfg.seed)
    summary = {**result.metrics.to_dict(), "checkpoint": cfg.checkpoint, "rounds": r3.eval_rounds}
    (run_dir / RESULTS).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    with (run_dir / SAMPLES).open("w", encoding="utf-8") as out:
        for i, sample in enumerate(samples):
            row = {"index": sample.index, "tag": sample.tag, "prompt": sample.prompt,
                   "scores": result.scores[:, i].tolist(), "stop_round": int(result.stop_round[i]),
                   "texts": [texts[i] for texts in result.texts]}  # fmt: skip
            out.write(json.dumps(row) + "\n")
    if cfg.save_images:
        save_strips(result, run_dir / STRIPS)
    return summary | {"table": format_round_table(result.metrics)}
