"""Saving images: single PNGs and grids, from (B, 3, H, W) tensors in [0, 1].

A grid can be captioned (:func:`save_grid` ``captions=``): each tile gets a white band underneath with
its prompt, wrapped to the tile's width and cut with "…" past :data:`CAPTION_LINES` lines, and, given
``passed=``, a green (pass) or red (fail) border — ShapesEval marks each evaluation sample by its strict
score. Text needs room, so a captioned grid enlarges its tiles (nearest neighbour) to at least
:data:`CAPTIONED_TILE` pixels wide; the font is PIL's bundled one, nothing is downloaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

CAPTIONED_TILE = 128
"""Smallest tile width of a captioned grid, in pixels (a 32-pixel sample is drawn 4× larger)."""
CAPTION_LINES = 3
FONT_SIZE = 11
PADDING = 3  # pixels around a caption's text
BORDER = 3  # width of the pass / fail frame
PASS_COLOR, FAIL_COLOR = (0, 170, 0), (220, 0, 0)


def grid_name(kind: str, step: int) -> str:
    """The file of a run's ``kind`` grid (``eval``, ``eval_heldout``, ``train``) at ``step``, numbered as
    ``metrics.jsonl`` and the checkpoints are (epochs completed): ``eval_epoch_000010.png`` sits beside
    ``checkpoints/epoch_000010``; the evaluation before training is ``eval_epoch_000000.png``."""
    return f"{kind}_epoch_{step:06d}.png"


def to_pil(image: Tensor) -> Image.Image:
    """(3, H, W) float in [0, 1] → RGB PIL image."""
    array = (image.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(array)


def save_grid(
    images: Tensor,
    path: Path,
    columns: int | None = None,
    upscale: int = 1,
    captions: Sequence[str] | None = None,
    passed: Sequence[bool | None] | None = None,
) -> Path:
    """Tile (B, 3, H, W) images into one PNG (``upscale`` enlarges tiny images, nearest neighbour);
    videos (B, 3, F, H, W) become one tiled video file instead.

    ``captions``: one text per image, written under its tile; ``passed``: one mark per image (True: a
    green border, False: red, None: none). Either makes the tiles at least :data:`CAPTIONED_TILE` wide.
    """
    if images.ndim == 5:
        from rlgen_cli.training.reporting.video import save_video_grid

        return save_video_grid(images, path, columns, upscale)
    batch, _, height, width = images.shape
    for name, values in (("captions", captions), ("passed", passed)):
        if values is not None and len(values) != batch:
            raise ValueError(f"save_grid: {len(values)} {name} for {batch} images; give one per image")
    if captions is not None or passed is not None:
        upscale = max(upscale, math.ceil(CAPTIONED_TILE / width))
    tiles = [
        to_pil(images[i]).resize((width * upscale, height * upscale), Image.NEAREST) for i in range(batch)
    ]
    if passed is not None:
        tiles = [_framed(tile, mark) for tile, mark in zip(tiles, passed)]
    if captions is not None:
        font = ImageFont.load_default(size=FONT_SIZE)
        tiles = [_captioned(tile, text, font) for tile, text in zip(tiles, captions)]
    grid = _tile(tiles, columns or math.ceil(math.sqrt(batch)))
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def caption_height(font: ImageFont.FreeTypeFont | ImageFont.ImageFont | None = None) -> int:
    """Height in pixels of the band under a captioned tile (:data:`CAPTION_LINES` lines of text)."""
    font = font or ImageFont.load_default(size=FONT_SIZE)
    return CAPTION_LINES * _line_height(font) + 2 * PADDING


def wrap(text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, width: int, lines: int) -> list[str]:
    """``text`` broken at spaces into at most ``lines`` lines that fit ``width`` pixels; what does not
    fit ends the last line with "…" (a word longer than a line is cut)."""
    out: list[str] = []
    words = text.split()
    while words and len(out) < lines:
        line = words.pop(0)
        while words and font.getlength(f"{line} {words[0]}") <= width:
            line = f"{line} {words.pop(0)}"
        out.append(line)
    if words or any(font.getlength(line) > width for line in out):
        last = out[-1] if out else ""
        while last and font.getlength(last + "…") > width:
            last = last[:-1].rstrip()
        out[-1:] = [last + "…"]
    return out


def _line_height(font: ImageFont.FreeTypeFont | ImageFont.ImageFont) -> int:
    left, top, right, bottom = font.getbbox("Ag")
    return bottom + 2


def _framed(tile: Image.Image, mark: bool | None) -> Image.Image:
    """The tile with a pass (green) or fail (red) border drawn over its edge; unchanged for None."""
    if mark is None:
        return tile
    framed = tile.copy()
    draw = ImageDraw.Draw(framed)
    color = PASS_COLOR if mark else FAIL_COLOR
    draw.rectangle((0, 0, tile.width - 1, tile.height - 1), outline=color, width=BORDER)
    return framed


def _captioned(
    tile: Image.Image, text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont
) -> Image.Image:
    """The tile above a white band holding ``text`` (wrapped, black)."""
    band = caption_height(font)
    out = Image.new("RGB", (tile.width, tile.height + band), "white")
    out.paste(tile, (0, 0))
    draw = ImageDraw.Draw(out)
    for i, line in enumerate(wrap(text, font, tile.width - 2 * PADDING, CAPTION_LINES)):
        draw.text((PADDING, tile.height + PADDING + i * _line_height(font)), line, fill="black", font=font)
    return out


def _tile(tiles: Sequence[Image.Image], columns: int) -> Image.Image:
    """Equal-sized tiles row by row, ``columns`` per row, on white."""
    width, height = tiles[0].size
    rows = math.ceil(len(tiles) / columns)
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i, tile in enumerate(tiles):
        grid.paste(tile, ((i % columns) * width, (i // columns) * height))
    return grid
