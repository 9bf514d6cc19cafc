"""Saving videos from (3, F, H, W) tensors in [0, 1]: H.264 mp4 when an encoder is installed, else WebP.

The mp4 path needs ``imageio-ffmpeg`` (its wheel ships a static ffmpeg binary, so it works offline once
installed); without it, videos are written as lossless animated WebP through Pillow, which always works
(runs of bit-identical frames are merged, see :func:`_write_webp`). Which one is used is reported by
:func:`video_encoder` and by the suffix of the path :func:`save_video` returns.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rlgen_cli.errors import UserError

log = logging.getLogger(__name__)

FORMATS = ("auto", "mp4", "webp")
DEFAULT_FPS = 8
"""Upstream Flow-GRPO logs Wan videos at 8 fps."""
MP4_INSTALL_HINT = "pip install imageio-ffmpeg (its wheel ships ffmpeg)"


def video_encoder() -> str:
    """``"mp4"`` when ``imageio_ffmpeg`` is importable, else ``"webp"`` (Pillow)."""
    return "mp4" if importlib.util.find_spec("imageio_ffmpeg") is not None else "webp"


def to_uint8_frames(frames: Tensor) -> np.ndarray:
    """(3, F, H, W) float in [0, 1] → (F, H, W, 3) uint8."""
    if frames.ndim != 4 or frames.shape[0] != 3:
        raise ValueError(
            f"a video must be a (3, F, H, W) tensor in [0, 1], got shape {tuple(frames.shape)}; "
            "pass one sample of the (B, 3, F, H, W) batch that decode() returns"
        )
    if frames.shape[1] < 1:
        raise ValueError("a video needs at least one frame, got F = 0")
    array = frames.detach().float().clamp(0, 1).permute(1, 2, 3, 0).cpu().numpy()  # (F, H, W, 3)
    return (array * 255).round().astype(np.uint8)


def save_video(frames: Tensor, path: Path, fps: int = DEFAULT_FPS, format: str = "auto") -> Path:
    """Write one video; returns the path written (its suffix says which encoder was used).

    Args:
        frames: (3, F, H, W) float in [0, 1].
        path: Destination; its suffix is replaced by ``.mp4`` or ``.webp``.
        fps: Frames per second.
        format: ``auto`` (mp4 when :func:`video_encoder` finds one, else WebP), ``mp4`` or ``webp``.

    Returns:
        The written file's path.

    Raises:
        UserError: ``format="mp4"`` without ``imageio-ffmpeg``, or an unknown format.
    """
    if format not in FORMATS:
        raise UserError(f"video format {format!r} is not valid; choose one of {', '.join(FORMATS)}")
    if fps < 1:
        raise ValueError(f"fps must be ≥ 1, got {fps}")
    chosen = video_encoder() if format == "auto" else format
    if chosen == "mp4" and video_encoder() != "mp4":
        raise UserError(f"writing mp4 needs imageio-ffmpeg, which is not installed: {MP4_INSTALL_HINT}")
    array = to_uint8_frames(frames)
    target = Path(path).with_suffix(f".{chosen}")
    target.parent.mkdir(parents=True, exist_ok=True)
    (_write_mp4 if chosen == "mp4" else _write_webp)(array, target, fps)
    log.debug("wrote %d-frame video %s (%s)", len(array), target, chosen)
    return target


def tile_videos(videos: Tensor, columns: int | None = None, upscale: int = 1) -> Tensor:
    """(B, 3, F, H, W) → one (3, F, rows·H·upscale, columns·W·upscale) video; empty cells are white."""
    if videos.ndim != 5 or videos.shape[1] != 3:
        raise ValueError(f"videos must be (B, 3, F, H, W), got shape {tuple(videos.shape)}")
    batch, _, frames, height, width = videos.shape
    columns = columns or math.ceil(math.sqrt(batch))
    rows = math.ceil(batch / columns)
    cells = torch.ones((rows * columns, 3, frames, height, width), dtype=torch.float32)
    cells[:batch] = videos.detach().float().cpu()
    grid = cells.view(rows, columns, 3, frames, height, width).permute(2, 3, 0, 4, 1, 5)  # (3, F, r, H, c, W)
    grid = grid.reshape(3, frames, rows * height, columns * width)
    if upscale > 1:
        grid = grid.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    return grid


def save_video_grid(
    videos: Tensor, path: Path, columns: int | None = None, upscale: int = 1, fps: int = DEFAULT_FPS
) -> Path:
    """Tile (B, 3, F, H, W) videos into one video file (see :func:`save_video` for the format)."""
    return save_video(tile_videos(videos, columns, upscale), path, fps)


def _write_webp(array: np.ndarray, path: Path, fps: int) -> None:
    """Lossless animated WebP, looping.

    libwebp's animation encoder merges a run of bit-identical consecutive frames into one frame of the
    summed duration (it has no switch to turn that off): playback timing is exact, but a reader counts
    fewer frames for such runs. Frames that differ in any pixel are all kept, bit-exact.
    """
    images = [Image.fromarray(frame) for frame in array]
    images[0].save(
        path,
        format="WEBP",
        save_all=True,
        append_images=images[1:],
        duration=round(1000 / fps),
        loop=0,
        lossless=True,
        minimize_size=False,
        allow_mixed=False,
    )


def _write_mp4(array: np.ndarray, path: Path, fps: int) -> None:
    """H.264 (yuv420p) through imageio-ffmpeg; odd sides are padded by one edge row/column (4:2:0 needs even)."""
    import imageio_ffmpeg

    _, height, width, _ = array.shape
    array = np.pad(array, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
    writer = imageio_ffmpeg.write_frames(
        str(path),
        (array.shape[2], array.shape[1]),
        fps=fps,
        codec="libx264",
        pix_fmt_out="yuv420p",
        macro_block_size=1,
        quality=8,
        ffmpeg_log_level="error",
    )
    writer.send(None)  # start the ffmpeg process
    try:
        for frame in array:
            writer.send(np.ascontiguousarray(frame))
    finally:
        writer.close()
