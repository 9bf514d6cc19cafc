"""Metric backends: TensorBoard event files and an offline W&B run, from a real training run."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TINY_RUN


def test_tensorboard_and_offline_wandb(cli, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_SERVICE", "false")
    run = tmp_path / "run"
    code, out = cli(
        "train", *TINY_RUN, "epochs=1", "eval_every=0", "images_every=1", "logging.tensorboard=true",
        "logging.wandb.enabled=true", "logging.wandb.mode=offline", f"hydra.run.dir={run}",
    )  # fmt: skip
    assert code == 0, out
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run / "tensorboard"))
    accumulator.Reload()
    assert "reward/mean" in accumulator.Tags()["scalars"]
    offline_runs = list((run / "wandb").glob("offline-run-*"))
    assert offline_runs, "W&B offline mode wrote no run directory"
