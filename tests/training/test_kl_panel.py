"""The "KL to reference" panel draws the measured divergence (``kl_to_ref``), not the loss term
``kl_loss``, which is 0 whenever ``algo.kl_weight`` is; a run without the measurement is drawn from its
``kl_loss`` only where its KL weight was positive."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlgen_cli.training.reporting.plots import plot_runs


def _run(root: Path, name: str, rows: list[dict[str, float]], kl_weight: float) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run / "resolved.yaml").write_text(yaml.safe_dump({"algo": {"kl_weight": kl_weight}}))
    return run


def _kl_panel(tmp_path: Path, monkeypatch, runs: list[Path]):  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    plot_runs(runs, tmp_path / "curves.png")
    return {ax.get_title(): ax for ax in kept[0].axes}.get("KL to reference")


def _raw_points(ax, color: str) -> list[float]:  # type: ignore[no-untyped-def]
    from matplotlib.colors import to_rgba

    (points,) = [c for c in ax.collections if tuple(c.get_facecolor()[0][:3]) == to_rgba(color)[:3]]
    return [round(float(y), 9) for _, y in points.get_offsets()]


def test_the_panel_draws_the_measured_kl_not_a_zero_loss_term(tmp_path: Path, monkeypatch):
    measured = [{"step": i, "reward/mean": 0.1, "kl_loss": 0.0, "kl_to_ref": 0.001 * i} for i in range(1, 5)]
    weighted = [{"step": i, "reward/mean": 0.1, "kl_loss": 0.002 * i} for i in range(1, 5)]  # older run
    unweighted = [{"step": i, "reward/mean": 0.1, "kl_loss": 0.0} for i in range(1, 5)]
    runs = [
        _run(tmp_path, "measured", measured, 0.0),
        _run(tmp_path, "weighted", weighted, 0.04),
        _run(tmp_path, "unweighted", unweighted, 0.0),
    ]
    panel = _kl_panel(tmp_path, monkeypatch, runs)
    assert panel is not None and panel.get_ylabel() == "kl_to_ref"
    assert _raw_points(panel, "C0") == [0.001, 0.002, 0.003, 0.004]  # kl_to_ref, not the zero kl_loss
    assert _raw_points(panel, "C1") == [0.002, 0.004, 0.006, 0.008]  # kl_loss of a KL-weighted run
    assert len(panel.collections) == 2  # the unweighted run's zeros are no measurement: not drawn


def test_runs_that_measured_nothing_get_no_kl_panel(tmp_path: Path, monkeypatch):
    rows = [{"step": i, "reward/mean": 0.1, "kl_loss": 0.0} for i in range(1, 5)]
    assert _kl_panel(tmp_path, monkeypatch, [_run(tmp_path, "a", rows, 0.0)]) is None
