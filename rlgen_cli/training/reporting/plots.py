"""Curves people would rather look at than read: reward and KL of one or several runs, as a PNG.

The x-axis is ``metrics.jsonl``'s ``step``: epochs completed, as the checkpoint folders count
(``checkpoints/epoch_000010`` holds the weights after 10 epochs), so the evaluation before training sits
at 0. Train curves are noisy, so they are drawn as faint points under their exponential
moving average; evaluations are few and drawn as they are. Each panel's y-axis names its metric, and
several runs are told apart by the overrides that differ between them (``algo.lr=1e-4`` /
``algo.lr=3e-4``), not by their folder names (``0``, ``1`` for a sweep).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from rlgen_cli.training.reporting.labels import legend_labels, read_resolved, readable_key
from rlgen_cli.training.reporting.metrics import read_metrics

CURVES = (
    ("reward/mean", "train reward"),
    ("eval/reward/mean", "eval reward (ODE)"),
    ("kl_to_ref", "KL to reference"),
)
KL_MEASURED, KL_TERM = "kl_to_ref", "kl_loss"
"""The divergence to the reference the flow recipes measure every epoch, and the loss term that weighs
it, which is the divergence only where ``algo.kl_weight`` > 0 (0 otherwise): a run that did not log the
first (VLM recipes, older runs) is drawn from the second when its KL weight is positive."""
SMOOTHING = 0.6
"""Weight of the past in the moving average of train curves (TensorBoard's default)."""
RAW_ALPHA = 0.3  # opacity of the raw points under a smoothed curve
REWARD_KEY = "reward/mean"  # the end of a reward panel's key (train and eval/)
PANEL_WIDTH, PANEL_HEIGHT, DPI = 5.0, 3.8, 100  # inches per panel; a legend adds to the height
LEGEND_FONT = 8  # points
CHAR_WIDTH_EM = 0.62  # a legend character's mean width in ems of DejaVu Sans, generous for digits
LEGEND_MARGIN_CHARS = 8  # the entry's colour handle and the padding around it, in characters


def smoothed(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average ``s_t = w s_{t-1} + (1 - w) x_t`` divided by ``1 - w^t`` (so the curve
    starts at the first value instead of at 0)."""
    out, average = [], 0.0
    for t, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**t))
    return out


def is_train_curve(key: str) -> bool:
    """Logged every epoch (smoothed), as opposed to the evaluations (``eval/…``)."""
    return not key.startswith("eval/")


def plot_runs(run_dirs: Sequence[Path], out: Path, keys: Sequence[tuple[str, str]] = CURVES) -> Path:
    """Draw each ``key`` against epochs completed for every run into one PNG with a panel per key (a
    reward whose detail reads better, JPEG's kB per image, drawn as that detail); returns ``out``.
    Several runs share one legend under the panels, its entries wrapped to the figure's width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = {Path(d): read_metrics(Path(d)) for d in run_dirs}
    labels = legend_labels(list(runs))
    shown = {key: shown_metric(runs, key) for key, _ in keys}
    present = [
        (k, title)
        for k, title in keys
        if any(row.get(shown[k][0][run]) is not None for run, rows in runs.items() for row in rows)
    ]
    present = present or [(keys[0][0], keys[0][1])]
    fig, axes = plt.subplots(
        1,
        len(present),
        figsize=(PANEL_WIDTH * len(present), PANEL_HEIGHT),
        squeeze=False,
        sharex=True,
        layout="constrained",
    )
    for ax, (key, title) in zip(axes[0], present):
        drawn, axis_title = shown[key]
        for color, (run_dir, rows) in enumerate(runs.items()):
            points = [(r["step"], r[drawn[run_dir]]) for r in rows if r.get(drawn[run_dir]) is not None]
            if points:
                _draw(ax, points, f"C{color % 10}", labels[run_dir], smooth=is_train_curve(key))
        ax.set_title(title)
        ax.set_xlabel("epochs completed")
        ax.set_ylabel(axis_title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        _legend_below(fig, [labels[run] for run in runs])
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def shown_metric(runs: Mapping[Path, list[dict[str, float]]], key: str) -> tuple[dict[Path, str], str]:
    """Per run the metric a ``key`` panel draws, and the panel's y-axis title: a reward's readable detail
    (``reward/jpeg_compressibility/jpeg_kb/mean``, "JPEG size (kB per image)") when every run that
    logged ``key`` has the same one; else ``key`` itself for every run."""
    plain = ({run: key for run in runs}, key)
    if key == KL_MEASURED:
        return {run: _kl_metric(run, rows) for run, rows in runs.items()}, key
    if not key.endswith(REWARD_KEY):
        return plain
    prefix = key[: -len(REWARD_KEY)]
    found = {}
    for run, rows in runs.items():
        logged = {k: v for row in rows for k, v in row.items()}
        if key in logged:
            found[run] = readable_key(logged, prefix)
    if not found or None in found.values() or len({readable for _, readable in found.values()}) > 1:
        return plain
    (readable,) = {readable for _, readable in found.values()}
    return {run: found[run][0] if run in found else key for run in runs}, readable.axis


def _kl_metric(run: Path, rows: list[dict[str, float]]) -> str:
    """:data:`KL_MEASURED` where the run logged it; else :data:`KL_TERM` when the run weighted a KL term
    (``algo.kl_weight`` > 0 in its ``resolved.yaml``), the measured divergence then too."""
    if any(KL_MEASURED in row for row in rows):
        return KL_MEASURED
    resolved = read_resolved(run)
    weight = (resolved.get("algo") or {}).get("kl_weight", 0) if isinstance(resolved, dict) else 0
    return KL_TERM if isinstance(weight, (int, float)) and weight > 0 else KL_MEASURED


def _legend_below(fig, labels: Sequence[str]) -> None:  # type: ignore[no-untyped-def]
    """One legend entry per run (colour ``C<i>``) under the panels: entries wrapped to the figure's width,
    in as many columns as fit, and the figure made taller by the legend so the panels keep their size."""
    from matplotlib.lines import Line2D

    width_chars = max(20, int(fig.get_figwidth() * 72 / (LEGEND_FONT * CHAR_WIDTH_EM)) - LEGEND_MARGIN_CHARS)
    wrapped = [textwrap.fill(label, width_chars, break_on_hyphens=False) for label in labels]
    widest = max(len(line) for label in wrapped for line in label.splitlines())
    columns = max(1, min(len(wrapped), width_chars // (widest + LEGEND_MARGIN_CHARS)))
    handles = [Line2D([], [], color=f"C{i % 10}", label=label) for i, label in enumerate(wrapped)]
    legend = fig.legend(handles=handles, loc="outside lower center", ncols=columns, fontsize=LEGEND_FONT)
    height = legend.get_window_extent(fig.canvas.get_renderer()).height / fig.dpi
    fig.set_figheight(fig.get_figheight() + height)


def _draw(ax, points: list[tuple[int, float]], color: str, label: str, smooth: bool) -> None:  # type: ignore[no-untyped-def]
    """One run's curve: a smoothed line over faint raw points, or the points joined as they are."""
    epochs, values = zip(*points)
    marker = "o" if len(points) < 30 else None
    if smooth and len(points) > 2:
        ax.scatter(epochs, values, s=8, color=color, alpha=RAW_ALPHA, linewidths=0)
        ax.plot(epochs, smoothed(values), color=color, label=label)
    else:
        ax.plot(epochs, values, color=color, marker=marker, ms=3, label=label)
