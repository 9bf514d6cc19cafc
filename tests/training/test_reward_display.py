"""A reward whose score reads poorly (JPEG compressibility: −kB/500 = −0.00299) shows its own readable
detail, the JPEG size in kB per image, on console lines and on the plots' axes."""

from __future__ import annotations

import json
from pathlib import Path

from rlgen_cli.recipes.flow_run import eval_suffix
from rlgen_cli.training.reporting.labels import readable_reward
from rlgen_cli.training.reporting.plots import plot_runs

JPEG = "reward/jpeg_compressibility"


def _jpeg_metrics(kb: float, prefix: str = "") -> dict[str, float]:
    """What a JPEG-compressibility run logs for images of ``kb`` kB: the score −kB/500 and the size."""
    return {
        f"{prefix}reward/mean": -kb / 500,
        f"{prefix}{JPEG}/mean": -kb / 500,
        f"{prefix}{JPEG}/jpeg_kb/mean": kb,
    }


def test_console_lines_show_the_size_beside_the_score():
    train, evaluation = _jpeg_metrics(1.497), _jpeg_metrics(1.482, "eval/")
    assert readable_reward(train) == "  1.5 kB/img"
    assert readable_reward({**train, **evaluation}) == "  1.5 kB/img (eval 1.48)"
    assert readable_reward(evaluation) == "  eval 1.48 kB/img"  # the evaluation before training
    assert eval_suffix({**train, **evaluation}) == " eval -0.002964  1.5 kB/img (eval 1.48)"


def test_a_mix_or_a_reward_without_a_readable_detail_shows_its_score_alone():
    mix = {**_jpeg_metrics(1.5), "reward/pickscore/mean": 21.0}
    assert readable_reward(mix) == ""
    assert readable_reward({"reward/mean": 0.3, "reward/shapes_geneval/mean": 0.3}) == ""
    assert eval_suffix({"reward/mean": 0.3, "eval/reward/mean": 0.25}) == " eval +0.25"


def _run(root: Path, name: str, rows: list[dict[str, float]]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return run


def _panels(tmp_path: Path, monkeypatch, runs: list[Path]) -> dict:  # type: ignore[type-arg]
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    plot_runs(runs, tmp_path / "curves.png")
    return {ax.get_title(): ax for ax in kept[0].axes}


def test_the_reward_panels_of_a_jpeg_run_plot_kilobytes(tmp_path: Path, monkeypatch):
    kb = [1.5, 1.4, 1.2, 1.1]
    rows = [{"step": 0, **_jpeg_metrics(1.6, "eval/")}] + [
        {"step": i, **_jpeg_metrics(v)} for i, v in enumerate(kb, start=1)
    ]
    panels = _panels(tmp_path, monkeypatch, [_run(tmp_path, "jpeg", rows)])
    train, evaluation = panels["train reward"], panels["eval reward (ODE)"]
    assert train.get_ylabel() == evaluation.get_ylabel() == "JPEG size (kB per image)"
    (raw,) = train.collections  # the raw points under the smoothed line
    assert [round(float(y), 6) for _, y in raw.get_offsets()] == kb
    assert list(evaluation.get_lines()[0].get_ydata()) == [1.6]


def test_runs_of_different_rewards_keep_the_score_axis(tmp_path: Path, monkeypatch):
    jpeg = _run(tmp_path, "jpeg", [{"step": i, **_jpeg_metrics(1.5)} for i in range(1, 4)])
    other = _run(
        tmp_path,
        "other",
        [{"step": i, "reward/mean": 0.2, "reward/pickscore/mean": 0.2} for i in range(1, 4)],
    )
    panels = _panels(tmp_path, monkeypatch, [jpeg, other])
    assert panels["train reward"].get_ylabel() == "reward/mean"
