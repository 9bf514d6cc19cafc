"""``rlgen plot RUN_A RUN_B``: the legend of runs that differ in many overrides lies inside the figure and
clear of every panel, and a model chosen through ``experiment=`` shows as that model."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlgen_cli.training.reporting.labels import legend_labels
from rlgen_cli.training.reporting.plots import plot_runs

SIX_A = [
    "experiment=pickscore_sd3", "algo.lr=1e-4", "algo.kl_weight=0.04", "algo.clip_range=0.0002",
    "model.lora.rank=32", "data.train=/data/prompts/pickscore/train_prompts_of_a_long_name.txt",
]  # fmt: skip
SIX_B = [
    "model=flux", "algo.lr=3e-4", "algo.kl_weight=0.0", "algo.clip_range=0.001", "model.lora.rank=64",
    "data.train=/data/prompts/other/train.txt",
]  # fmt: skip


def _run(root: Path, name: str, overrides: list[str], choices: dict, resolved: dict | None = None) -> Path:
    """A run directory as Hydra leaves it: overrides, the options its groups composed from, metrics."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))
    (run / "resolved.yaml").write_text(yaml.safe_dump(resolved or {}))
    rows = [{"step": 0, "eval/reward/mean": 0.1}] + [
        {"step": i, "reward/mean": 0.1 * i, "kl_loss": 0.01 * i} for i in range(1, 13)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return run


def _pair(root: Path) -> tuple[Path, Path]:
    a = _run(root, "a", SIX_A, {"experiment": "pickscore_sd3", "model": "sd3", "hydra/launcher": "basic"})
    b = _run(root, "b", SIX_B, {"experiment": None, "model": "flux"})
    return a, b


def _figure(tmp_path: Path, monkeypatch, runs: list[Path], keys=None):  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to measure its artists
    plot_runs(runs, tmp_path / "curves.png", **({"keys": keys} if keys else {}))
    (fig,) = kept
    fig.canvas.draw()
    return fig


def _overlaps(a, b) -> bool:  # type: ignore[no-untyped-def]
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_a_legend_of_six_differing_overrides_lies_inside_the_figure_clear_of_the_panels(
    tmp_path: Path, monkeypatch
):
    for keys in (None, [("reward/mean", "train reward")]):  # three panels, then one narrow one
        fig = _figure(tmp_path, monkeypatch, list(_pair(tmp_path / str(bool(keys)))), keys)
        renderer = fig.canvas.get_renderer()
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)
        assert fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1, (box, fig.bbox)
        for ax in fig.axes:  # the panel with its ticks, labels and title
            assert not _overlaps(box, ax.get_tightbbox(renderer)), (box, ax.get_title())
        texts = ["".join(t.get_text().split()) for t in legend.get_texts()]  # unwrapped (a path may break)
        assert all(o in texts[0] for o in SIX_A[1:]) and all(o in texts[1] for o in SIX_B[1:]), texts


def test_a_model_chosen_through_an_experiment_shows_as_that_model(tmp_path: Path):
    a, b = _pair(tmp_path)
    labels = legend_labels([a, b])
    assert "model=sd3" in labels[a].split() and "model=∅" not in labels[a], labels[a]
    assert "model=flux" in labels[b].split() and "experiment=∅" in labels[b].split(), labels[b]


def test_a_key_one_run_left_at_its_default_shows_the_resolved_value(tmp_path: Path):
    a = _run(tmp_path, "a", ["algo.lr=3e-4"], {}, {"algo": {"lr": 1e-4, "beta": 0.5}})
    b = _run(tmp_path, "b", ["algo.beta=1.0"], {}, {"algo": {"lr": 1e-4, "beta": 1.0}})
    assert legend_labels([a, b]) == {a: "algo.lr=3e-4 algo.beta=0.5", b: "algo.lr=0.0001 algo.beta=1.0"}
