"""Curves people would rather look at than read: reward and KL of one or several runs, as a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlgen_cli.training.metrics import read_metrics

CURVES = (
    ("reward/mean", "train reward"),
    ("eval/reward/mean", "eval reward (ODE)"),
    ("kl_loss", "KL to reference"),
)


def plot_runs(run_dirs: Sequence[Path], out: Path, keys: Sequence[tuple[str, str]] = CURVES) -> Path:
    """Draw each ``key`` against step for every run into one PNG with a panel per key; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {Path(d): read_metrics(Path(d)) for d in run_dirs}
    present = [(k, title) for k, title in keys if any(row.get(k) for rows in runs.values() for row in rows)]
    present = present or [(keys[0][0], keys[0][1])]
    fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 3.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], present):
        for run_dir, rows in runs.items():
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if len(points) < 30 else None, ms=3, label=run_dir.name)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
