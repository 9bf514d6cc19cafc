"""Metric backends: TensorBoard event files and an offline W&B run, from a real training run; the W&B run
is named after the experiment and overrides, grouped by its sweep. One step numbering: metrics.jsonl,
the image grids' names, the checkpoint folders, TensorBoard and W&B number the same evaluation alike
(epochs completed, the evaluation before training at 0)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import TINY_RUN

_BLOCK, _HEADER = 32768, 7  # the .wandb file: 32 KiB blocks of records, each with a 7-byte header


def wandb_records(run: Path) -> tuple[dict[str, str], list[dict]]:
    """The offline W&B run under ``run/wandb``: its name and group, and its history rows (``_step`` …),
    read from the run's ``.wandb`` file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, chunk, records = path.read_bytes(), _HEADER, b"", []  # the file starts with its own header
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:
            break
        chunk += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(chunk)
            chunk = b""
    identity, rows = {}, []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            identity = {"name": record.run.display_name, "group": record.run.run_group}
        elif kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return identity, rows


def _step_in_name(path: Path) -> int:
    """``eval_epoch_000002.png`` → 2."""
    return int(path.stem.rsplit("_", 1)[1])


def test_every_output_numbers_the_same_evaluation_alike(cli, tmp_path: Path, monkeypatch):
    """Two epochs, evaluated before training and after each, a grid and a checkpoint after each: the
    steps of metrics.jsonl, of the grids' names, of the checkpoints, of TensorBoard and of the offline
    W&B run are 0 (before training), 1 and 2, and each holds the same numbers under the same step."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_SERVICE", "false")
    run = tmp_path / "run"
    code, out = cli(
        "train",
        *TINY_RUN,
        "epochs=2",
        "eval_every=1",
        "eval_before=true",
        "images_every=1",
        "save_every=1",
        "logging.tensorboard=true",
        "logging.wandb.enabled=true",
        "logging.wandb.mode=offline",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    jsonl = {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(jsonl) == [0, 1, 2]
    evaluated = sorted(step for step, row in jsonl.items() if "eval/reward/mean" in row)
    trained = sorted(step for step, row in jsonl.items() if "reward/mean" in row)
    assert (evaluated, trained) == ([0, 1, 2], [1, 2])
    images = run / "images"
    assert sorted(_step_in_name(p) for p in images.glob("eval_epoch_*.png")) == evaluated
    assert sorted(_step_in_name(p) for p in images.glob("train_epoch_*.png")) == trained
    checkpoints = sorted((run / "checkpoints").glob("epoch_*"))
    assert [_step_in_name(p) for p in checkpoints] == trained
    for checkpoint in checkpoints:  # the state after the epoch logged under the checkpoint's number
        counters = torch.load(checkpoint / "trainer_state.pt", weights_only=True)["counters"]
        assert counters["global_step"] == jsonl[_step_in_name(checkpoint)]["global_step"]
    assert "epoch 1  reward" in (run / "run.log").read_text()  # the console counts as well

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run / "tensorboard"))
    accumulator.Reload()
    for key, steps in (("eval/reward/mean", evaluated), ("reward/mean", trained)):
        scalars = accumulator.Scalars(key)
        assert [e.step for e in scalars] == steps, key
        assert [e.value for e in scalars] == pytest.approx([jsonl[s][key] for s in steps], rel=1e-6), key
    assert [e.step for e in accumulator.Images("train/images")] == trained
    assert [e.step for e in accumulator.Images("eval/images")] == evaluated  # each evaluation's grid

    import wandb

    wandb.teardown()  # the W&B service writes the run file asynchronously: wait for it to finish
    identity, rows = wandb_records(run)
    assert identity["name"].startswith("tiny_cpu algo.prompts_per_epoch=2 algo.group_size=2"), identity
    assert identity["group"] == ""  # a single run: no sweep group
    logged = {}
    for row in rows:  # a step's images and metrics are separate history rows
        logged.setdefault(row["_step"], {}).update(row)
    assert sorted(logged) == evaluated
    for step in evaluated:
        assert logged[step]["eval/reward/mean"] == jsonl[step]["eval/reward/mean"], step
        assert logged[step]["eval/images/_type"] == "images/separated", step
    for step in trained:
        assert logged[step]["reward/mean"] == jsonl[step]["reward/mean"], step


def test_a_sweep_job_is_named_after_its_overrides_and_grouped_by_its_sweep(tmp_path: Path, monkeypatch):
    import wandb

    from rlgen_cli.training.reporting.backends import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "multirun" / "train" / "2026-01-01_00-00-00" / "1"
    (job / ".hydra").mkdir(parents=True)
    overrides = ["experiment=tiny_cpu", "algo.lr=3e-4", "hydra.sweep.dir=multirun/train/2026-01-01_00-00-00"]
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"mode": "MULTIRUN"}}))
    logger = WandbLogger(job, "rlgen", "offline", {"epochs": 1})
    logger.log({"eval/reward/mean": 0.25}, step=0)  # the evaluation before training
    logger.log({"reward/mean": 0.5}, step=1)
    logger.close()
    wandb.teardown()  # the W&B service writes the run file asynchronously: wait for it to finish
    identity, rows = wandb_records(job)
    assert identity == {"name": "tiny_cpu algo.lr=3e-4", "group": "multirun/train/2026-01-01_00-00-00"}
    assert [(r["_step"], r.get("eval/reward/mean"), r.get("reward/mean")) for r in rows] == [
        (0, 0.25, None),
        (1, None, 0.5),
    ]
