"""``rlgen plot`` and the names of runs: legends from the overrides that differ between runs (then from
their resolved configs, then their folders), W&B run names, epochs completed on the x-axis, smoothed
train curves, and the PNG itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlgen_cli.training.reporting.labels import differing, legend_labels, run_name
from rlgen_cli.training.reporting.plots import is_train_curve, plot_runs, smoothed


def _run(root: Path, name: str, overrides: list[str] | None = None, resolved: dict | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    rows = [{"step": 0, "eval/reward/mean": 0.1}] + [  # the evaluation before training, then 12 epochs
        {"step": i, "reward/mean": 0.1 * i + 0.05 * (-1) ** i, "kl_to_ref": 0.01 * i} for i in range(1, 13)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    if overrides is not None:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if resolved is not None:
        (run / "resolved.yaml").write_text(yaml.safe_dump(resolved))
    return run


def test_differing_keeps_only_keys_whose_values_differ():
    settings = {"a": {"lr": "1e-4", "seed": "1"}, "b": {"lr": "3e-4", "seed": "1", "ema": "true"}}
    assert differing(settings) == {"a": ["lr=1e-4", "ema=∅"], "b": ["lr=3e-4", "ema=true"]}
    assert differing({"a": {"lr": "1"}, "b": {"lr": "1"}}) == {"a": [], "b": []}


def test_sweep_jobs_are_labelled_by_the_overrides_that_differ(tmp_path: Path):
    common = ["experiment=tiny_cpu", "epochs=10"]
    zero = _run(tmp_path, "0", [*common, "algo.lr=1e-4", "hydra.sweep.dir=x"])
    one = _run(tmp_path, "1", [*common, "algo.lr=3e-4", "hydra.sweep.dir=x"])
    assert legend_labels([zero, one]) == {zero: "algo.lr=1e-4", one: "algo.lr=3e-4"}


def test_without_overrides_the_resolved_configs_tell_runs_apart(tmp_path: Path):
    a = _run(tmp_path, "a", resolved={"run_dir": "a", "algo": {"lr": 0.0001, "beta": 0.0}, "seed": 1})
    b = _run(tmp_path, "b", resolved={"run_dir": "b", "algo": {"lr": 0.0003, "beta": 0.0}, "seed": 1})
    assert legend_labels([a, b]) == {a: "algo.lr=0.0001", b: "algo.lr=0.0003"}  # run_dir is bookkeeping


def test_runs_nothing_tells_apart_keep_their_folder_names(tmp_path: Path):
    a, b = _run(tmp_path, "a", ["algo.lr=1"]), _run(tmp_path, "b", ["algo.lr=1"])
    assert legend_labels([a, b]) == {a: "a", b: "b"}
    c = _run(tmp_path, "c", ["algo.lr=2"])
    labels = legend_labels([a, b, c])
    assert labels == {
        a: "algo.lr=1 (a)",
        b: "algo.lr=1 (b)",
        c: "algo.lr=2",
    }  # clashing labels get the folder


def test_a_run_is_named_after_its_experiment_then_its_overrides(tmp_path: Path):
    run = _run(tmp_path, "run", ["algo.lr=3e-4", "experiment=shapes_grpo_fast", "hydra.run.dir=out"])
    assert run_name(run) == "shapes_grpo_fast algo.lr=3e-4"
    assert run_name(_run(tmp_path, "bare")) == "bare"
    long = run_name(_run(tmp_path, "long", [f"algo.k{i}=1" for i in range(40)]))
    assert len(long) == 128 and long.endswith("…")


def test_the_x_axis_is_the_logged_step(tmp_path: Path, monkeypatch):
    """metrics.jsonl's step is epochs completed already: the evaluation before training sits at 0, the
    twelfth epoch at 12 (beside checkpoints/epoch_000012), nothing shifted."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at its artists
    plot_runs([_run(tmp_path, "run")], tmp_path / "curves.png")
    panels = {ax.get_ylabel(): ax for ax in figures[0].axes}
    (evaluation,) = panels["eval/reward/mean"].get_lines()
    assert list(evaluation.get_xdata()) == [0]
    (smoothed_line,) = panels["reward/mean"].get_lines()
    assert list(smoothed_line.get_xdata()) == list(range(1, 13))


def test_smoothing_is_a_debiased_moving_average():
    assert smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    # w = 0.6: s1 = 0.4·0 / 0.4 = 0; s2 = (0.6·0 + 0.4·10) / (1 − 0.36) = 6.25
    assert smoothed([0.0, 10.0]) == pytest.approx([0.0, 6.25])
    assert is_train_curve("reward/mean") and not is_train_curve("eval/reward/mean")


def test_plot_writes_a_png_with_a_panel_per_metric(tmp_path: Path):
    from PIL import Image

    zero = _run(tmp_path, "0", ["algo.lr=1e-4"])
    one = _run(tmp_path, "1", ["algo.lr=3e-4"])
    out = plot_runs([zero, one], tmp_path / "plots" / "curves.png")
    width, height = Image.open(out).size
    assert width == 1500 and height > 380  # three panels of 5 × 3.8 inches at 100 dpi, the legend below
