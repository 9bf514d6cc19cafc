"""Metric loggers behind one interface: ``log(metrics, step)`` and ``close()``.

``metrics.jsonl`` is always written (one JSON object per line, ``step`` included) so runs can be
plotted and compared without any service; other backends add themselves to :class:`MultiLogger`.

One step numbering for every output of a run: the ``step`` is the number of epochs completed (R3: of
optimizer steps). The evaluation before training is step 0; the metrics, evaluation and image grids
of the first epoch are step 1, and so is the checkpoint written after it (``checkpoints/epoch_000001``).
``metrics.jsonl``, the image files (``images/eval_epoch_000001.png``), TensorBoard, W&B and the plots
all use it; recipes turn their 0-based loop index into it with :func:`step_after`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

METRICS_FILE = "metrics.jsonl"
BEFORE_TRAINING = 0
"""The step of the evaluation before training: no epoch completed yet."""


def step_after(epoch: int) -> int:
    """The step of what 0-based ``epoch`` produced (its metrics, evaluation and grids, the checkpoint
    written after it): the epochs completed, ``epoch + 1``."""
    return epoch + 1


class MetricLogger(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class JsonlLogger:
    """Appends one JSON line per call to ``run_dir/metrics.jsonl`` (flushed, so a crash loses nothing).

    A run logs its steps in increasing order, so the first step it logs is where it starts: rows already in
    the file at that step or later were logged by an earlier attempt past the checkpoint this one resumed
    from, and are dropped (the file is rewritten atomically) before the first row is appended. A resumed
    run's file therefore holds every step once.
    """

    def __init__(self, run_dir: Path) -> None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / METRICS_FILE
        self._file: TextIO | None = None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._file is None:
            drop_rows_from(self.path, step)
            self._file = self.path.open("a", encoding="utf-8")
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def drop_rows_from(path: Path, step: int) -> int:
    """Remove the rows of the metrics file ``path`` whose step is ``step`` or later, and any line a crash
    left half-written; returns how many were removed. The rewrite is atomic (temporary file + rename)."""
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if (row_step := _step_of(line)) is not None and row_step < step]
    removed = len([line for line in lines if line.strip()]) - len(kept)
    if removed:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
    return removed


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class NullLogger:
    """Logs nothing (non-main ranks, dry runs): the loop never asks whether it should log."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        return None

    def log_images(self, key: str, images: Any, step: int) -> None:
        return None

    def close(self) -> None:
        return None


class MultiLogger:
    """Fans every call out to several loggers (images only to those that take images)."""

    def __init__(self, loggers: Sequence[MetricLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step)

    def log_images(self, key: str, images: Any, step: int) -> None:
        for logger in self.loggers:
            if hasattr(logger, "log_images"):
                logger.log_images(key, images, step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def _jsonable(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """All rows of ``run_dir/metrics.jsonl`` (empty when the run logged nothing yet)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def build_loggers(run_dir: Path, logging_cfg: Any, config: Any) -> MultiLogger:
    """jsonl always, plus the backends ``logging_cfg`` enables (TensorBoard, W&B with ``config``)."""
    loggers: list[MetricLogger] = [JsonlLogger(run_dir)]
    if logging_cfg.tensorboard:
        from rlgen_cli.training.reporting.backends import TensorBoardLogger

        loggers.append(TensorBoardLogger(run_dir))
    if logging_cfg.wandb.enabled:
        from rlgen_cli.training.reporting.backends import WandbLogger

        wandb = logging_cfg.wandb
        from omegaconf import OmegaConf

        resolved = OmegaConf.to_container(config, resolve=True)
        loggers.append(WandbLogger(run_dir, wandb.project, wandb.mode, resolved, wandb.name))
    return MultiLogger(loggers)
