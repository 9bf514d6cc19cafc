"""Per-tag tables of GenEval-style evaluations (one run's results, or before → after training), and the
end-of-run evaluation reports an experiment turns on with ``eval_report``.

Evaluation metrics are flat ``{key: value}`` dicts as the flow recipes log them:
``[eval/]reward/<reward>/<metric>/mean`` and, per prompt tag, ``[eval/]reward/<reward>/<metric>/tag/<tag>``
(see :func:`detail_summaries`). ShapesEval's headline metric is ``strict``; ``accuracy`` is GenEval's
binary (lenient) accuracy and ``n_extra`` the unrequested objects per image.

An evaluation report (:class:`EvalReport`) sees every evaluation of a training run and writes its files
when the run ends: ``none`` writes nothing, ``shapes`` (:class:`ShapesReport`) the ShapesEval curves and,
after an ``eval_before`` run, the before → after table and sample grid.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

log = logging.getLogger(__name__)

GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

SHAPES_COLUMNS: tuple[tuple[str, str], ...] = (
    ("strict", "strict"),
    ("accuracy", "lenient"),
    ("n_extra", "extra/img"),
)
"""(detail name, column title) of the ShapesEval tables."""

SHAPES_CURVES: tuple[tuple[str, str], ...] = (
    ("eval/reward/shapes_geneval/strict/mean", "strict accuracy (test, ODE)"),
    ("eval/reward/shapes_geneval/accuracy/mean", "lenient accuracy (test, ODE)"),
    ("eval/reward/shapes_geneval/n_extra/mean", "extra objects per image (test)"),
    ("reward/mean", "train reward"),
)
"""The curves of a ShapesEval run (``rlgen plot`` keys and titles)."""


def detail_summaries(details: Mapping[str, Any], by_tag: bool = False) -> dict[str, float]:
    """Means of a reward mix's float details (``"<reward>/<name>"`` → ``reward/<reward>/<name>/mean``);
    with ``by_tag``, also per tag when the reward reports one (``"<reward>/tag"``, GenEval-style):
    ``reward/<reward>/<name>/tag/<tag>``. NaN entries (a value that does not apply to that sample, e.g.
    another tag's slot of a per-tag list) are left out of the means; a mean over none is not reported."""
    out: dict[str, float] = {}
    for key, value in details.items():
        if "/" not in key or not isinstance(value, Tensor) or not value.is_floating_point():
            continue
        values = value.float()
        _put_mean(out, f"reward/{key}/mean", values)
        tags = details.get(f"{key.split('/')[0]}/tag")
        if by_tag and isinstance(tags, list) and len(tags) == len(values):
            for tag in sorted({t for t in tags if t is not None}):
                rows = torch.tensor([t == tag for t in tags])
                _put_mean(out, f"reward/{key}/tag/{tag}", values[rows])
    return out


def _put_mean(out: dict[str, float], key: str, values: Tensor) -> None:
    known = values[~values.isnan()]
    if known.numel():
        out[key] = float(known.mean())


def tags_of(metrics: Mapping[str, float], reward: str, metric: str, prefix: str = "eval/") -> list[str]:
    """The tags that ``metrics`` breaks ``metric`` down by: GenEval's in GenEval's order, then others."""
    head = f"{prefix}reward/{reward}/{metric}/tag/"
    found = {key[len(head) :] for key in metrics if key.startswith(head)}
    return [t for t in GENEVAL_TAGS if t in found] + sorted(found - set(GENEVAL_TAGS))


def _value(metrics: Mapping[str, float], reward: str, metric: str, tag: str, prefix: str) -> float:
    suffix = "mean" if tag == "overall" else f"tag/{tag}"
    return float(metrics.get(f"{prefix}reward/{reward}/{metric}/{suffix}", float("nan")))


def tag_table(
    metrics: Mapping[str, float],
    reward: str = "shapes_geneval",
    columns: Sequence[tuple[str, str]] = SHAPES_COLUMNS,
    prefix: str = "eval/",
) -> str:
    """One row per tag (then ``overall`` = mean over all samples) and one column per metric."""
    tags = tags_of(metrics, reward, columns[0][0], prefix) + ["overall"]
    lines = [f"{'tag':<14}" + "".join(f"{title:>12}" for _, title in columns)]
    for tag in tags:
        cells = "".join(f"{_value(metrics, reward, m, tag, prefix):>12.3f}" for m, _ in columns)
        lines.append(f"{tag:<14}{cells}")
    return "\n".join(lines)


def before_after_table(
    before: Mapping[str, float],
    after: Mapping[str, float],
    reward: str = "shapes_geneval",
    columns: Sequence[tuple[str, str]] = SHAPES_COLUMNS,
    prefix: str = "eval/",
) -> str:
    """Per tag and metric: ``before → after (Δ)``; accuracies in percent, extra objects as counts."""
    tags = tags_of(after, reward, columns[0][0], prefix) + ["overall"]
    width = 24
    lines = [f"{'tag':<14}" + "".join(f"{title:>{width}}" for _, title in columns)]
    for tag in tags:
        cells = []
        for metric, _ in columns:
            old = _value(before, reward, metric, tag, prefix)
            new = _value(after, reward, metric, tag, prefix)
            scale = 1.0 if metric == "n_extra" else 100.0
            cells.append(f"{old * scale:6.1f} → {new * scale:6.1f} ({(new - old) * scale:+6.1f})")
        lines.append(f"{tag:<14}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def has_tag_breakdown(metrics: Mapping[str, float], reward: str, metric: str, prefix: str = "eval/") -> bool:
    """Whether ``metrics`` holds a per-tag breakdown of ``reward``'s ``metric``."""
    return bool(tags_of(metrics, reward, metric, prefix))


BEFORE_AFTER_TABLE = "before_after.txt"
BEFORE_AFTER_GRID = "images/before_after.png"


def write_before_after(
    run_dir: Path,
    before: Mapping[str, float],
    after: Mapping[str, float],
    images_before: Tensor | None = None,
    images_after: Tensor | None = None,
    reward: str = "shapes_geneval",
) -> str | None:
    """The final report of a run evaluated before and after training: the per-tag table (written to
    ``before_after.txt`` and returned) and a grid with the before samples above the after samples of
    the same prompts and noise. ``None`` when the evaluation has no per-tag breakdown of ``reward``."""
    columns = [(m, t) for m, t in SHAPES_COLUMNS if has_tag_breakdown(after, reward, m)]
    if not columns:
        return None
    table = before_after_table(before, after, reward, columns)
    (run_dir / BEFORE_AFTER_TABLE).write_text(table + "\n", encoding="utf-8")
    if images_before is not None and images_after is not None:
        from rlgen_cli.training.images import save_grid

        n = min(len(images_before), len(images_after), 16)
        save_grid(
            torch.cat([images_before[:n], images_after[:n]]),
            run_dir / BEFORE_AFTER_GRID,
            columns=n,
            upscale=2,
        )
    return table


SHAPES_CURVE = "shapes_curves.png"


class EvalReport(Protocol):
    """Sees each evaluation's samples (``epoch`` −1: before training) and writes its files at the end."""

    def evaluated(self, epoch: int, images: Tensor) -> None: ...
    def write(self, before: Mapping[str, float] | None, after: Mapping[str, float]) -> None: ...


class NoReport:
    """``eval_report=none``: the metrics and eval grids every run writes, nothing more."""

    def __init__(self, run_dir: Path) -> None:
        del run_dir  # nothing to write

    def evaluated(self, epoch: int, images: Tensor) -> None:
        return None

    def write(self, before: Mapping[str, float] | None, after: Mapping[str, float]) -> None:
        return None


class ShapesReport:
    """``eval_report=shapes``: ``shapes_curves.png`` (strict / lenient accuracy, extra objects, train
    reward) when the last epoch evaluated, and after an ``eval_before`` run the per-tag before → after
    table (``before_after.txt``, also logged) with the grid of the same prompts and noise before and
    after (:func:`write_before_after`)."""

    def __init__(self, run_dir: Path, reward: str = "shapes_geneval") -> None:
        self.run_dir, self.reward = Path(run_dir), reward
        self.images_before: Tensor | None = None
        self.images_last: Tensor | None = None

    def evaluated(self, epoch: int, images: Tensor) -> None:
        if epoch < 0:
            self.images_before = images
        self.images_last = images

    def write(self, before: Mapping[str, float] | None, after: Mapping[str, float]) -> None:
        from rlgen_cli.training.plots import plot_runs

        if any(key.startswith(f"eval/reward/{self.reward}/") for key in after):
            plot_runs([self.run_dir], self.run_dir / SHAPES_CURVE, keys=SHAPES_CURVES)
        if before and "eval/reward/mean" in after:
            table = write_before_after(
                self.run_dir, before, after, self.images_before, self.images_last, self.reward
            )
            if table:
                log.info("test accuracy before → after training (%s):\n%s", self.run_dir, table)


EVAL_REPORTS = {"none": NoReport, "shapes": ShapesReport}


def eval_report(name: str, run_dir: Path) -> EvalReport:
    """The report ``eval_report=<name>`` writes into ``run_dir`` (names checked by the schema)."""
    return EVAL_REPORTS[name](run_dir)
