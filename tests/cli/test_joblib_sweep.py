"""A Hydra multirun sweep under ``hydra/launcher=joblib``: each job runs in a joblib (loky) worker process
and writes its own run — resolved config with its swept value, metrics — as under the basic launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import TINY_RUN

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")


def test_joblib_sweep_runs_each_job_with_its_metrics(cli, tmp_path: Path):
    sweep = tmp_path / "sweep"
    code, out = cli(
        "train",
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "algo.lr=1e-4,2e-4",
        *TINY_RUN,
        "epochs=1",
        "eval_every=0",
        "images_every=0",
        f"hydra.sweep.dir={sweep}",
    )
    assert code == 0, out
    launcher = OmegaConf.load(sweep / "multirun.yaml").hydra.launcher
    assert launcher._target_.endswith("JoblibLauncher") and launcher.n_jobs == 2
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in runs] == ["0", "1"]
    assert [OmegaConf.load(run / "resolved.yaml").algo.lr for run in runs] == [1e-4, 2e-4]
    for run in runs:
        (metrics,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert metrics["global_step"] == 1 and "reward/mean" in metrics
