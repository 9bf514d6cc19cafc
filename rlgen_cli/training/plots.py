"""Curves people would rather look at than read: reward and KL of one or several runs, as a PNG.

The x-axis is ``metrics.jsonl``'s ``step``: epochs completed, as the checkpoint folders count
(``checkpoints/epoch_000010`` holds the weights after 10 epochs), so the evaluation before training sits
at 0. Train curves are noisy, so they are drawn as faint points under their exponential
moving average; evaluations are few and drawn as they are. Each panel's y-axis names its metric, and
several runs are told apart by the overrides that differ between them (``algo.lr=1e-4`` /
``algo.lr=3e-4``), not by their folder names (``0``, ``1`` for a sweep).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlgen_cli.training.labels import legend_labels
from rlgen_cli.training.metrics import read_metrics

CURVES = (
    ("reward/mean", "train reward"),
    ("eval/reward/mean", "eval reward (ODE)"),
    ("kl_loss", "KL to reference"),
)
SMOOTHING = 0.6
"""Weight of the past in the moving average of train curves (TensorBoard's default)."""
RAW_ALPHA = 0.3  # opacity of the raw points under a smoothed curve


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
    """Draw each ``key`` against epochs completed for every run into one PNG with a panel per key;
    returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = {Path(d): read_metrics(Path(d)) for d in run_dirs}
    labels = legend_labels(list(runs))
    present = [
        (k, title)
        for k, title in keys
        if any(row.get(k) is not None for rows in runs.values() for row in rows)
    ]
    present = present or [(keys[0][0], keys[0][1])]
    fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.8), squeeze=False, sharex=True)
    for ax, (key, title) in zip(axes[0], present):
        for color, (run_dir, rows) in enumerate(runs.items()):
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                _draw(ax, points, f"C{color % 10}", labels[run_dir], smooth=is_train_curve(key))
        ax.set_title(title)
        ax.set_xlabel("epochs completed")
        ax.set_ylabel(key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _draw(ax, points: list[tuple[int, float]], color: str, label: str, smooth: bool) -> None:  # type: ignore[no-untyped-def]
    """One run's curve: a smoothed line over faint raw points, or the points joined as they are."""
    epochs, values = zip(*points)
    marker = "o" if len(points) < 30 else None
    if smooth and len(points) > 2:
        ax.scatter(epochs, values, s=8, color=color, alpha=RAW_ALPHA, linewidths=0)
        ax.plot(epochs, smoothed(values), color=color, label=label)
    else:
        ax.plot(epochs, values, color=color, marker=marker, ms=3, label=label)
