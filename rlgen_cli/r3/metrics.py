"""Multi-round evaluation of R3: accuracy per round and tag, improvement and finish rates, image strips.

``rlgen eval`` of an R3 policy generates an image per prompt (round 0), then runs up to ``eval_rounds``
reflect → refine rounds with auto-stop: a sample whose reflection says "no further edit needed" is
finished and keeps its image (and its score) for the remaining rounds, as upstream does. From the
scores of every round this module computes:

* accuracy per round and tag — the mean score of each tag's samples (the rewards' scores are GenEval
  correctness, the GenEval++ verdict bit, or TIIF's fraction of answered questions), and ``overall`` = the
  mean over tags (GenEval's convention: each tag weighs the same);
* the fractions of samples whose final score is higher / lower / equal to their round-0 score;
* the finish rate: the fraction of samples that stopped on their own within the rounds.

Everything is pure: tensors and lists in, a :class:`RoundMetrics` (and a plain-text table) out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "OVERALL",
    "RoundMetrics",
    "carry_forward",
    "format_round_table",
    "round_metrics",
    "round_strip",
    "save_round_strips",
]

OVERALL = "overall"


@dataclass(frozen=True)
class RoundMetrics:
    """Summary of a multi-round evaluation.

    Attributes:
        accuracy: One ``{tag: mean score, …, "overall": mean over tags}`` per round (round 0 first).
        counts: Samples per tag.
        improved: Fraction of samples whose final score exceeds their round-0 score.
        worse: Fraction whose final score is below it.
        unchanged: Fraction within ``tolerance`` of it.
        finish_rate: Fraction of samples that answered "no further edit needed" within the rounds.
        num_samples: N.
    """

    accuracy: list[dict[str, float]]
    counts: dict[str, int]
    improved: float
    worse: float
    unchanged: float
    finish_rate: float
    num_samples: int

    @property
    def rounds(self) -> int:
        """Number of rounds, the generation round included."""
        return len(self.accuracy)

    def to_dict(self) -> dict[str, Any]:
        """Flat metrics for ``results.json`` and loggers: ``round_{r}/{tag}`` plus the fractions."""
        flat: dict[str, Any] = {
            f"round_{r}/{tag}": value
            for r, by_tag in enumerate(self.accuracy)
            for tag, value in by_tag.items()
        }
        return flat | {
            "improved": self.improved,
            "worse": self.worse,
            "unchanged": self.unchanged,
            "finish_rate": self.finish_rate,
            "num_samples": self.num_samples,
        }


def _check_scores(scores: Tensor, tags: Sequence[str], finished: Tensor) -> None:
    """Raise ``ValueError`` unless scores is (R, N) finite float and tags / finished have N entries."""
    if scores.ndim != 2 or scores.shape[0] < 1 or scores.shape[1] < 1:
        raise ValueError(f"scores must be (rounds, N) with rounds, N >= 1, got shape {tuple(scores.shape)}.")
    n = scores.shape[1]
    if len(tags) != n or finished.shape != (n,):
        raise ValueError(
            f"scores has N={n} samples but tags has {len(tags)} and finished has shape "
            f"{tuple(finished.shape)}; pass one tag and one finished flag per sample."
        )
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(
            "scores hold NaN or infinite values; count failed judge calls explicitly and drop those samples "
            "before summarising."
        )


def _accuracy_by_tag(row: Tensor, tags: Sequence[str], order: Sequence[str]) -> dict[str, float]:
    """Mean of ``row`` (N,) per tag in ``order``, plus the mean over tags."""
    by_tag = {}
    for tag in order:
        members = torch.tensor([t == tag for t in tags])
        by_tag[tag] = float(row[members].double().mean())
    by_tag[OVERALL] = sum(by_tag.values()) / len(by_tag)
    return by_tag


def round_metrics(
    scores: Tensor, tags: Sequence[str], finished: Tensor, tolerance: float = 1e-6
) -> RoundMetrics:
    """Summarise a multi-round evaluation.

    Args:
        scores: (R, N) score of the image each sample holds after round r (round 0 = the generated
            image); a finished sample repeats its last score (see :func:`carry_forward`).
        tags: N tags (GenEval ``tag``, TIIF ``type``).
        finished: (N,) bool, True for samples that stopped with "no further edit needed".
        tolerance: Score changes within ±tolerance count as unchanged.

    Returns:
        The metrics; tags appear in sorted order.

    Raises:
        ValueError: On mismatched shapes or non-finite scores.
    """
    finished = torch.as_tensor(finished).bool().cpu()
    scores = torch.as_tensor(scores).detach().cpu().double()
    _check_scores(scores, tags, finished)
    order = sorted(set(tags))
    change = scores[-1] - scores[0]  # (N,)
    return RoundMetrics(
        accuracy=[_accuracy_by_tag(row, tags, order) for row in scores],
        counts={tag: sum(t == tag for t in tags) for tag in order},
        improved=float((change > tolerance).double().mean()),
        worse=float((change < -tolerance).double().mean()),
        unchanged=float((change.abs() <= tolerance).double().mean()),
        finish_rate=float(finished.double().mean()),
        num_samples=scores.shape[1],
    )


def carry_forward(scores: Tensor, stop_round: Tensor) -> tuple[Tensor, Tensor]:
    """Repeat each finished sample's last score over the rounds after it stopped.

    Args:
        scores: (R, N) scores per round; entries from a sample's stop round on are ignored.
        stop_round: (N,) int, the round (≥ 1) whose reflection said "no further edit needed"; any value
            ≥ R (or < 1) means the sample never stopped.

    Returns:
        ``(scores, finished)``: (R, N) scores where rounds ≥ stop round hold the score of the round before,
        and (N,) bool finished flags.
    """
    rounds = scores.shape[0]
    stop = torch.as_tensor(stop_round).long().cpu()
    finished = (stop >= 1) & (stop < rounds)
    last = torch.where(finished, stop - 1, torch.full_like(stop, rounds - 1))  # (N,) last image's round
    steps = torch.arange(rounds).unsqueeze(1)  # (R, 1)
    source = torch.minimum(steps.expand(-1, stop.numel()), last.unsqueeze(0))  # (R, N)
    return scores.gather(0, source.to(scores.device)), finished


def format_round_table(metrics: RoundMetrics) -> str:
    """A plain-text table: one row per tag (and ``overall``), one column per round, then the fractions.

    Args:
        metrics: What :func:`round_metrics` returned.

    Returns:
        The table, lines joined by newlines (no trailing newline).
    """
    tags = [*metrics.counts, OVERALL]
    width = max(len(t) for t in [*tags, "tag"])
    header = f"{'tag':<{width}}  {'n':>5}  " + "  ".join(f"{f'round {r}':>8}" for r in range(metrics.rounds))
    lines = [header, "-" * len(header)]
    for tag in tags:
        count = metrics.counts.get(tag, metrics.num_samples)
        cells = "  ".join(f"{by_tag[tag]:>8.2%}" for by_tag in metrics.accuracy)
        lines.append(f"{tag:<{width}}  {count:>5}  {cells}")
    lines.append(
        f"final vs round 0: improved {metrics.improved:.1%} · worse {metrics.worse:.1%} · "
        f"unchanged {metrics.unchanged:.1%} · finished {metrics.finish_rate:.1%}"
    )
    return "\n".join(lines)


def round_strip(images_per_round: list[Tensor]) -> Tensor:
    """Tile each sample's rounds side by side.

    Args:
        images_per_round: R tensors (N, C, H, W), round 0 first.

    Returns:
        (N, C, H, R·W): row i shows sample i's images from left (round 0) to right.

    Raises:
        ValueError: With no rounds or rounds of different shapes.
    """
    if not images_per_round:
        raise ValueError("images_per_round is empty; pass at least the round-0 images.")
    shapes = {tuple(images.shape) for images in images_per_round}
    if len(shapes) != 1 or len(next(iter(shapes))) != 4:
        raise ValueError(f"every round must hold (N, C, H, W) images of one shape, got {sorted(shapes)}.")
    return torch.cat(list(images_per_round), dim=-1)


def save_round_strips(images_per_round: list[Tensor], path: Path, upscale: int = 1) -> Path:
    """Save one PNG with a row per sample and a column per round.

    Args:
        images_per_round: R tensors (N, 3, H, W) in [0, 1], round 0 first.
        path: The PNG to write (parent directories are created).
        upscale: Nearest-neighbour enlargement for tiny images.

    Returns:
        ``path``.
    """
    from rlgen_cli.training.reporting.images import save_grid

    strips = round_strip(images_per_round)  # (N, 3, H, R·W)
    return save_grid(strips, Path(path), columns=1, upscale=upscale)
