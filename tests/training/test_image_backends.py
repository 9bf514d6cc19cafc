"""Image grids in the metric backends: what TensorBoard's event file and an offline W&B run hold, read
back, for a batch of still images and for a video batch (logged by its first frames)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rlgen_cli.training.reporting.backends import TensorBoardLogger, WandbLogger, still_images
from tests.recipes.test_loggers import wandb_records

LEVEL = 1  # uint8 quantisation: a [0, 1] value written as an 8-bit pixel moves by at most one level


def _video() -> torch.Tensor:
    """(2, 3, F=3, 4, 5): video 0's first frame red, video 1's green; every later frame blue."""
    video = torch.zeros(2, 3, 3, 4, 5)
    video[0, 0, 0] = 1.0
    video[1, 1, 0] = 1.0
    video[:, 2, 1:] = 1.0
    return video


def _expected(image: torch.Tensor) -> np.ndarray:
    """(3, H, W) in [0, 1] → (H, W, 3) uint8 levels."""
    return (image.permute(1, 2, 0).numpy() * 255).astype(np.int32)


def test_still_images_pass_and_videos_give_their_first_frames():
    stills = torch.rand(2, 3, 4, 5)
    assert still_images(stills) is stills
    video = _video()
    assert torch.equal(still_images(video), video[:, :, 0])
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\) or \(B, 3, F, H, W\)"):
        still_images(torch.rand(3, 4, 5))


def test_tensorboard_stores_the_first_frames_at_the_step(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    logger.log_images("eval/images", _video(), step=3)
    logger.close()
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    (event,) = accumulator.Images("eval/images")
    assert event.step == 3
    grid = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB")).astype(np.int32)
    # TensorBoard tiles the batch side by side: video 0's first frame (red), then video 1's (green)
    expected = np.concatenate([_expected(frame) for frame in _video()[:, :, 0]], axis=1)
    assert grid.shape == expected.shape and np.abs(grid - expected).max() <= LEVEL


def test_wandb_offline_stores_each_first_frame_at_the_step(tmp_path: Path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    logger = WandbLogger(tmp_path, "rlgen", "offline", {"epochs": 1}, name="images")
    logger.log_images("eval/images", _video(), step=0)
    logger.log({"eval/reward/mean": 0.5}, step=0)
    logger.close()
    wandb.teardown()  # the W&B service writes the run file asynchronously: wait for it to finish
    _, rows = wandb_records(tmp_path)
    (row,) = [r for r in rows if "eval/images/filenames" in r]
    assert row["_step"] == 0 and row["eval/images/count"] == 2
    (files,) = list(tmp_path.glob("wandb/offline-run-*/files"))
    for name, frame in zip(row["eval/images/filenames"], _video()[:, :, 0], strict=True):
        pixels = np.asarray(Image.open(files / name).convert("RGB")).astype(np.int32)
        assert np.abs(pixels - _expected(frame)).max() <= LEVEL, name
