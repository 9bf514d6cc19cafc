"""A run's W&B name and its plot legend say what it trains: logging switches and bookkeeping overrides
(``logging.wandb.enabled=true``, ``resume=auto``) are left out."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlgen_cli.training.reporting.labels import legend_labels, run_name


def _run(root: Path, name: str, overrides: list[str], resolved: dict | None = None) -> Path:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if resolved is not None:
        (run / "resolved.yaml").write_text(yaml.safe_dump(resolved))
    return run


def test_a_wandb_name_leaves_out_logging_switches_and_bookkeeping(tmp_path: Path):
    run = _run(
        tmp_path,
        "run",
        [
            "experiment=tiny_cpu",
            "logging.wandb.enabled=true",
            "algo.lr=3e-4",
            "logging.tensorboard=true",
            "+logging.wandb.mode=offline",
            "resume=auto",
            "hydra.run.dir=out",
        ],
    )
    assert run_name(run) == "tiny_cpu algo.lr=3e-4"
    only_switches = _run(tmp_path, "only", ["logging.wandb.enabled=true"])
    assert run_name(only_switches) == "only"  # nothing says what it trains: the folder's name


def test_runs_differing_in_logging_alone_are_told_apart_by_what_they_train(tmp_path: Path):
    a = _run(tmp_path, "a", ["algo.lr=1e-4", "logging.wandb.enabled=true"], {"algo": {"lr": 1e-4}})
    b = _run(tmp_path, "b", ["algo.lr=3e-4"], {"algo": {"lr": 3e-4}})
    assert legend_labels([a, b]) == {a: "algo.lr=1e-4", b: "algo.lr=3e-4"}
    same = {"algo": {"lr": 1e-4}, "logging": {"tensorboard": True}}
    c = _run(tmp_path, "c", ["logging.tensorboard=true"], same)
    d = _run(tmp_path, "d", [], {**same, "logging": {"tensorboard": False}})
    assert legend_labels([c, d]) == {c: "c", d: "d"}
