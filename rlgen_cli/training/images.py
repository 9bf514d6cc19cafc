"""Saving images: single PNGs and captioned-free grids, from (B, 3, H, W) tensors in [0, 1]."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image
from torch import Tensor


def to_pil(image: Tensor) -> Image.Image:
    """(3, H, W) float in [0, 1] → RGB PIL image."""
    array = (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(array)


def save_grid(images: Tensor, path: Path, columns: int | None = None, upscale: int = 1) -> Path:
    """Tile (B, 3, H, W) images into one PNG (``upscale`` enlarges tiny images, nearest neighbour);
    videos (B, 3, F, H, W) become one tiled video file instead."""
    if images.ndim == 5:
        from rlgen_cli.training.video import save_video_grid

        return save_video_grid(images, path, columns, upscale)
    batch, _, height, width = images.shape
    columns = columns or math.ceil(math.sqrt(batch))
    rows = math.ceil(batch / columns)
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i in range(batch):
        grid.paste(to_pil(images[i]), ((i % columns) * width, (i // columns) * height))
    if upscale > 1:
        grid = grid.resize((grid.width * upscale, grid.height * upscale), Image.NEAREST)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path
