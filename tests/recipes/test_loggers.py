"""Metric backends: TensorBoard event files and an offline W&B run, from a real training run; the W&B run
is named after the experiment and overrides, grouped by its sweep, and holds the evaluation before
training at step 0 (epochs completed, like the checkpoint folders)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

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


def test_tensorboard_and_offline_wandb(cli, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_SERVICE", "false")
    run = tmp_path / "run"
    code, out = cli(
        "train", *TINY_RUN, "epochs=1", "eval_every=1", "eval_before=true", "images_every=1",
        "logging.tensorboard=true", "logging.wandb.enabled=true", "logging.wandb.mode=offline",
        f"hydra.run.dir={run}",
    )  # fmt: skip
    assert code == 0, out
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run / "tensorboard"))
    accumulator.Reload()
    assert "reward/mean" in accumulator.Tags()["scalars"]
    assert [e.step for e in accumulator.Scalars("eval/reward/mean")] == [0, 1]  # before training, epoch 1

    import wandb

    wandb.teardown()  # the W&B service writes the run file asynchronously: wait for it to finish
    jsonl = {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    identity, rows = wandb_records(run)
    assert identity["name"].startswith("tiny_cpu algo.prompts_per_epoch=2 algo.group_size=2"), identity
    assert identity["group"] == ""  # a single run: no sweep group
    by_step = {row["_step"]: row for row in rows}
    assert by_step[0]["eval/reward/mean"] == jsonl[-1]["eval/reward/mean"]  # the baseline evaluation
    assert by_step[1]["reward/mean"] == jsonl[0]["reward/mean"]
    assert by_step[1]["eval/reward/mean"] == jsonl[0]["eval/reward/mean"]


def test_a_sweep_job_is_named_after_its_overrides_and_grouped_by_its_sweep(tmp_path: Path, monkeypatch):
    import wandb

    from rlgen_cli.training.backends import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "multirun" / "train" / "2026-01-01_00-00-00" / "1"
    (job / ".hydra").mkdir(parents=True)
    overrides = ["experiment=tiny_cpu", "algo.lr=3e-4", "hydra.sweep.dir=multirun/train/2026-01-01_00-00-00"]
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"mode": "MULTIRUN"}}))
    logger = WandbLogger(job, "rlgen", "offline", {"epochs": 1})
    logger.log({"eval/reward/mean": 0.25}, step=-1)  # the loop's step before training
    logger.log({"reward/mean": 0.5}, step=0)
    logger.close()
    wandb.teardown()  # the W&B service writes the run file asynchronously: wait for it to finish
    identity, rows = wandb_records(job)
    assert identity == {"name": "tiny_cpu algo.lr=3e-4", "group": "multirun/train/2026-01-01_00-00-00"}
    assert [(r["_step"], r.get("eval/reward/mean"), r.get("reward/mean")) for r in rows] == [
        (0, 0.25, None), (1, None, 0.5),
    ]  # fmt: skip
