"""Per-tag tables of GenEval-style evaluations (one run's results, or before → after training), and the
end-of-run evaluation reports an experiment turns on with ``eval_report``.

Evaluation metrics are flat ``{key: value}`` dicts as the flow recipes log them:
``[eval/]reward/<reward>/<metric>/mean`` and, per prompt tag, ``[eval/]reward/<reward>/<metric>/tag/<tag>``
(see :func:`detail_summaries`). ShapesEval's headline metric is ``strict``; ``accuracy`` is GenEval's
binary (lenient) accuracy and ``n_extra`` the unrequested objects per image.

An evaluation report (:class:`EvalReport`) sees every evaluation of a training run, says how its grids
are captioned, and writes its files when the run ends: ``none`` writes nothing and leaves the grids
bare, ``shapes`` (:class:`ShapesReport`) captions every evaluation grid with the prompts and a pass /
fail border from each sample's strict score, and writes the ShapesEval curves and, after an
``eval_before`` run, the before → after table and sample grid. With ``eval_heldout`` the table ends with
an ``unseen`` row: the overall before → after of the split of prompt combinations never trained on
(``eval_heldout/…`` metrics, evaluated only at those two points), and a line saying how many samples it
holds. "Unseen" names that split; "held-out" is the guard's (held-out rewards, ``training/control/hacking_guard.py``).
"""

from __future__ import annotations

import logging
import math
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
    """Per tag and metric: ``before → after (Δ)``; accuracies in percent, extra objects as counts. When
    both hold the ``eval_heldout/`` split, a last ``unseen`` row gives its overall values, and a line
    under the table its number of samples."""
    tags = tags_of(after, reward, columns[0][0], prefix) + ["overall"]
    lines = [f"{'tag':<14}" + "".join(f"{title:>{CELL}}" for _, title in columns)]
    lines += [_before_after_row(tag, before, after, reward, columns, prefix, tag) for tag in tags]
    if has_heldout(before, reward) and has_heldout(after, reward):
        lines.append(_before_after_row(UNSEEN, before, after, reward, columns, HELDOUT_PREFIX, "overall"))
        count = int(after.get(f"{HELDOUT_PREFIX}num_samples", 0))
        lines.append(f"{UNSEEN}: {count} samples of prompt combinations never trained on (eval_heldout)")
    return "\n".join(lines)


CELL = 24  # width of a before → after cell
UNSEEN = "unseen"  # the row of the eval_heldout split (combinations never trained on)
HELDOUT_PREFIX = "eval_heldout/"
"""Metric prefix of the ``eval_heldout`` split (``recipes/flow_run.py: evaluate``)."""


def has_heldout(metrics: Mapping[str, float], reward: str = "shapes_geneval") -> bool:
    """Whether ``metrics`` hold an evaluation of the ``eval_heldout`` split scored by ``reward``."""
    return any(key.startswith(f"{HELDOUT_PREFIX}reward/{reward}/") for key in metrics)


def _before_after_row(
    label: str,
    before: Mapping[str, float],
    after: Mapping[str, float],
    reward: str,
    columns: Sequence[tuple[str, str]],
    prefix: str,
    tag: str,
) -> str:
    cells = []
    for metric, _ in columns:
        old = _value(before, reward, metric, tag, prefix)
        new = _value(after, reward, metric, tag, prefix)
        scale = 1.0 if metric == "n_extra" else 100.0
        cells.append(f"{old * scale:6.1f} → {new * scale:6.1f} ({(new - old) * scale:+6.1f})")
    return f"{label:<14}" + "".join(f"{c:>{CELL}}" for c in cells)


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
    labels_before: Mapping[str, Sequence[Any]] | None = None,
    labels_after: Mapping[str, Sequence[Any]] | None = None,
) -> str | None:
    """The final report of a run evaluated before and after training: the per-tag table (written to
    ``before_after.txt`` and returned) and a grid with the before samples above the after samples of
    the same prompts and noise, captioned by ``labels_before`` / ``labels_after`` (``save_grid``'s
    ``captions`` and ``passed``, one per sample) when given. ``None`` when the evaluation has no
    per-tag breakdown of ``reward``."""
    columns = [(m, t) for m, t in SHAPES_COLUMNS if has_tag_breakdown(after, reward, m)]
    if not columns:
        return None
    table = before_after_table(before, after, reward, columns)
    (run_dir / BEFORE_AFTER_TABLE).write_text(table + "\n", encoding="utf-8")
    if images_before is not None and images_after is not None:
        save_before_after_grid(run_dir, images_before, images_after, labels_before, labels_after)
    return table


ROW_LABELS = ("before", "after")
ROW_LABEL_WIDTH = 56  # pixels of the strip left of the grid that names each row


def save_before_after_grid(
    run_dir: Path,
    images_before: Tensor,
    images_after: Tensor,
    labels_before: Mapping[str, Sequence[Any]] | None = None,
    labels_after: Mapping[str, Sequence[Any]] | None = None,
) -> Path:
    """``images/before_after.png``: up to 16 samples before training (top row) above the same prompts and
    noise after it (bottom row), each row named in a strip on the left; tiles captioned by
    ``labels_before`` / ``labels_after`` (``save_grid``'s ``captions`` and ``passed``) when given. A
    video model's grid is a video, left without the strip."""
    from rlgen_cli.training.reporting.images import save_grid

    n = min(len(images_before), len(images_after), 16)
    labels = {
        key: [*labels_before[key][:n], *labels_after[key][:n]]
        for key in (labels_before or {})
        if key in (labels_after or {})
    }
    path = save_grid(
        torch.cat([images_before[:n], images_after[:n]]),
        run_dir / BEFORE_AFTER_GRID,
        columns=n,
        upscale=2,
        **labels,
    )
    if path.suffix == ".png":
        name_rows(path, ROW_LABELS)
    return path


def name_rows(path: Path, names: Sequence[str]) -> None:
    """Rewrite the grid PNG at ``path`` with a white strip of :data:`ROW_LABEL_WIDTH` pixels on its left
    that writes ``names[i]`` level with the middle of row i (rows of equal height)."""
    from PIL import Image, ImageDraw

    from rlgen_cli.training.reporting.images import FONT_SIZE

    with Image.open(path) as grid:
        grid = grid.convert("RGB")
    out = Image.new("RGB", (grid.width + ROW_LABEL_WIDTH, grid.height), "white")
    out.paste(grid, (ROW_LABEL_WIDTH, 0))
    draw, row = ImageDraw.Draw(out), grid.height / len(names)
    for i, name in enumerate(names):
        draw.text(
            (ROW_LABEL_WIDTH / 2, row * (i + 0.5)), name, fill="black", anchor="mm", font_size=FONT_SIZE
        )
    out.save(path)


REWARD_PREFIX = "eval/reward/"


def reward_before_after_table(before: Mapping[str, float], after: Mapping[str, float]) -> str | None:
    """The evaluation reward, each reward of the mix and each of their details (JPEG's ``jpeg_kb``)
    as ``before → after (Δ)``; None when either side has no evaluation reward."""
    total = f"{REWARD_PREFIX}mean"
    if total not in before or total not in after:
        return None
    parts = sorted(
        (
            key
            for key in after
            if key.startswith(REWARD_PREFIX) and key.endswith("/mean") and key != total and key in before
        ),
        key=lambda key: key[: -len("/mean")].split("/"),  # a reward, then its details
    )
    rows = [("reward", total)] + [(key[len(REWARD_PREFIX) : -len("/mean")], key) for key in parts]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{'eval (test split)':<{width}}before → after (Δ)"]
    for name, key in rows:
        old, new = float(before[key]), float(after[key])
        lines.append(f"{name:<{width}}{old:.4g} → {new:.4g} ({new - old:+.3g})")
    return "\n".join(lines)


def write_reward_before_after(
    run_dir: Path,
    before: Mapping[str, float],
    after: Mapping[str, float],
    images_before: Tensor | None = None,
    images_after: Tensor | None = None,
) -> str | None:
    """Any run evaluated before and after training: :func:`reward_before_after_table` to
    ``before_after.txt`` (returned) and the before / after grid; None (nothing written) without both
    evaluations."""
    table = reward_before_after_table(before, after)
    if table is None:
        return None
    (run_dir / BEFORE_AFTER_TABLE).write_text(table + "\n", encoding="utf-8")
    if images_before is not None and images_after is not None:
        save_before_after_grid(run_dir, images_before, images_after)
    return table


SHAPES_CURVE = "shapes_curves.png"


class EvalReport(Protocol):
    """Sees each evaluation's samples (``epoch`` −1: before training; ``prompts`` and the reward mix's
    per-sample ``details``), captions the evaluation grids (:meth:`tile_labels`: keyword arguments of
    ``save_grid``) and writes its files at the end."""

    def evaluated(
        self,
        epoch: int,
        images: Tensor,
        prompts: Sequence[str] | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None: ...
    def tile_labels(self, prompts: Sequence[str], details: Mapping[str, Any]) -> dict[str, list]: ...
    def write(self, before: Mapping[str, float] | None, after: Mapping[str, float]) -> None: ...


class NoReport:
    """``eval_report=none``: the metrics and bare eval grids every run writes; after an ``eval_before``
    run also the reward's before → after (``before_after.txt``, also logged) and the grid of the same
    prompts and noise before and after (:func:`write_reward_before_after`)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.images_before: Tensor | None = None
        self.images_last: Tensor | None = None

    def evaluated(
        self,
        epoch: int,
        images: Tensor,
        prompts: Sequence[str] | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        if epoch < 0:
            self.images_before = images
        self.images_last = images

    def tile_labels(self, prompts: Sequence[str], details: Mapping[str, Any]) -> dict[str, list]:
        return {}

    def write(self, before: Mapping[str, float] | None, after: Mapping[str, float]) -> None:
        if not before:
            return
        table = write_reward_before_after(self.run_dir, before, after, self.images_before, self.images_last)
        if table:
            log.info("evaluation before → after training (%s):\n%s", self.run_dir, table)


class ShapesReport:
    """``eval_report=shapes``: evaluation grids captioned with each sample's prompt and a green (strict
    pass) or red (fail) border; ``shapes_curves.png`` (strict / lenient accuracy, extra objects, train
    reward) when the last epoch evaluated; and after an ``eval_before`` run the per-tag before → after
    table (``before_after.txt``, also logged; with the ``unseen`` row under ``eval_heldout``) with the
    captioned grid of the same prompts and noise before and after (:func:`write_before_after`)."""

    def __init__(self, run_dir: Path, reward: str = "shapes_geneval") -> None:
        self.run_dir, self.reward = Path(run_dir), reward
        self.images_before: Tensor | None = None
        self.images_last: Tensor | None = None
        self.labels_before: dict[str, list] = {}
        self.labels_last: dict[str, list] = {}

    def evaluated(
        self,
        epoch: int,
        images: Tensor,
        prompts: Sequence[str] | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        labels = self.tile_labels(prompts, details) if prompts is not None and details is not None else {}
        if epoch < 0:
            self.images_before, self.labels_before = images, labels
        self.images_last, self.labels_last = images, labels

    def tile_labels(self, prompts: Sequence[str], details: Mapping[str, Any]) -> dict[str, list]:
        """Each tile's prompt, and its strict pass / fail when ``reward`` scored it."""
        labels: dict[str, list] = {"captions": list(prompts)}
        strict = details.get(f"{self.reward}/strict")
        if isinstance(strict, Tensor) and len(strict) == len(prompts):
            labels["passed"] = strict_marks(strict)
        return labels

    def write(self, before: Mapping[str, float] | None, after: Mapping[str, float]) -> None:
        from rlgen_cli.training.reporting.plots import plot_runs

        if any(key.startswith(f"eval/reward/{self.reward}/") for key in after):
            plot_runs([self.run_dir], self.run_dir / SHAPES_CURVE, keys=SHAPES_CURVES)
        if before and "eval/reward/mean" in after:
            table = write_before_after(
                self.run_dir,
                before,
                after,
                self.images_before,
                self.images_last,
                self.reward,
                self.labels_before,
                self.labels_last,
            )
            if table:
                log.info("test accuracy before → after training (%s):\n%s", self.run_dir, table)
                return
            table = write_reward_before_after(
                self.run_dir, before, after, self.images_before, self.images_last
            )
            if table:  # a reward without a per-tag breakdown
                log.info("evaluation before → after training (%s):\n%s", self.run_dir, table)


def strict_marks(strict: Tensor) -> list[bool | None]:
    """Per sample: passed (strict score 1), failed (0), or None where the score is NaN (not scored)."""
    return [None if math.isnan(v) else v >= 0.5 for v in strict.float().tolist()]


EVAL_REPORTS = {"none": NoReport, "shapes": ShapesReport}


def eval_report(name: str, run_dir: Path) -> EvalReport:
    """The report ``eval_report=<name>`` writes into ``run_dir`` (names checked by the schema)."""
    return EVAL_REPORTS[name](run_dir)
