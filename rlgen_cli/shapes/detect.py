"""Deterministic ShapesEval detector: palette pixels -> connected components -> coloured shapes.

For a batch ``(B, 3, H, W)`` in [0, 1], in numpy (single-threaded, so fast on a busy CPU) and vectorised
over the batch:

1. every pixel takes the nearest of the background and the palette colours (squared RGB distance);
   pixels nearest a palette colour are foreground;
2. foreground pixels are grouped into 4-connected components by min-label propagation with pointer
   jumping (no scipy); components smaller than ``min_area`` pixels are noise and ignored;
3. each component's colour is the majority vote of its pixels' nearest palette colours;
4. its shape is the nearest prototype in (fill ratio, asymmetry) space: fill ratio = area / box area
   (square ≈ 1, circle ≈ π/4, triangle ≈ 0.6), asymmetry = the larger of the vertical and horizontal
   pixel-mass imbalances about the box centre (≈ 0.4 for a triangle of any axis-aligned orientation,
   0 for circles and squares).

Every detection has confidence 1.0: the detector is rule-based, so GenEval's confidence thresholds
never drop one. Boxes are ``(x0, y0, x1, y1)`` pixel edges with exclusive ``x1``/``y1``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rlgen_cli.geneval_rules import Detection
from rlgen_cli.shapes.vocab import BACKGROUND, PALETTE

logger = logging.getLogger(__name__)

__all__ = ["PROTOTYPES", "ShapeDetection", "ShapeDetector", "label_components"]

PROTOTYPES: dict[str, tuple[float, float]] = {
    "square": (1.0, 0.0),
    "circle": (0.81, 0.0),
    "triangle": (0.62, 0.40),
}
"""Shape -> (fill ratio, asymmetry) of the rendered shapes, averaged over sizes."""


@dataclass(frozen=True)
class ShapeDetection(Detection):
    """A :class:`~rlgen_cli.geneval_rules.Detection` with the colour and shape features it came from.

    Attributes:
        color: Majority palette colour of the component's pixels.
        area: Pixel count.
        fill: Area divided by box area.
        asymmetry: Largest pixel-mass imbalance about the box centre, in [0, 1].
    """

    color: str = ""
    area: int = 0
    fill: float = 0.0
    asymmetry: float = 0.0


def label_components(foreground: np.ndarray) -> np.ndarray:
    """Label the 4-connected components of a batch of boolean masks.

    Args:
        foreground: ``(B, H, W)`` boolean array.

    Returns:
        ``(B, H, W)`` int64 array: for a foreground pixel, the flat index (over the whole batch) of the
        first pixel, in raster order, of its component; ``B·H·W`` for background.
    """
    total = foreground.size
    labels = np.where(foreground, np.arange(total).reshape(foreground.shape), total)
    while True:
        padded = np.pad(labels, ((0, 0), (1, 1), (1, 1)), constant_values=total)
        vertical = np.minimum(padded[:, :-2, 1:-1], padded[:, 2:, 1:-1])
        horizontal = np.minimum(padded[:, 1:-1, :-2], padded[:, 1:-1, 2:])
        merged = np.minimum(labels, np.minimum(vertical, horizontal))
        jumped = merged.ravel()[np.minimum(merged, total - 1)]  # a label's own label is never larger
        updated = np.where(foreground, np.minimum(merged, jumped), total)
        if np.array_equal(updated, labels):
            return labels
        labels = updated


def _classify(fill: np.ndarray, asymmetry: np.ndarray) -> list[str]:
    """Return the nearest :data:`PROTOTYPES` shape for each (fill, asymmetry) pair."""
    names = list(PROTOTYPES)
    protos = np.array([PROTOTYPES[n] for n in names])
    features = np.stack([fill, asymmetry], axis=1)
    distances = ((features[:, None, :] - protos[None]) ** 2).sum(axis=-1)
    return [names[i] for i in distances.argmin(axis=1).tolist()]


def _imbalance(
    coord: np.ndarray, low: np.ndarray, high: np.ndarray, comp: np.ndarray, area: np.ndarray
) -> np.ndarray:
    """|pixels after the box centre − pixels before it| / area, per component, along one axis."""
    side = np.sign(coord + 0.5 - (low + high)[comp] / 2)
    return np.abs(np.bincount(comp, weights=side, minlength=len(area))) / area


def _extent(coord: np.ndarray, comp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-component ``(min, max + 1)`` of a pixel coordinate."""
    low, high = np.full(k, np.iinfo(np.int64).max), np.full(k, -1)
    np.minimum.at(low, comp, coord)
    np.maximum.at(high, comp, coord)
    return low, high + 1


class ShapeDetector:
    """Finds coloured circles, squares and triangles in images (see the module docstring).

    Args:
        min_area: Smallest component counted as an object; ``None`` = 8 pixels per 32×32 of image
            (scaled with the image area, at least 3).
        palette: Colour name -> RGB in [0, 1]; default the ShapesEval palette.
        background: Background RGB.

    Raises:
        ValueError: If ``min_area`` is below 1.
    """

    def __init__(
        self,
        min_area: int | None = None,
        palette: Mapping[str, Sequence[float]] = PALETTE,
        background: Sequence[float] = BACKGROUND,
    ) -> None:
        if min_area is not None and min_area < 1:
            raise ValueError(
                f"min_area must be ≥ 1 pixel (or None for the size-scaled default), got {min_area}."
            )
        self.min_area = min_area
        self.names = list(palette)
        self.colors = np.array([list(background), *map(list, palette.values())], dtype=np.float32)

    def _min_area(self, height: int, width: int) -> int:
        """Return the component size threshold for an image size."""
        return self.min_area if self.min_area is not None else max(3, round(8 * height * width / 1024))

    def nearest_colors(self, images: Tensor) -> np.ndarray:
        """Return ``(B, H, W)`` indices into background + palette (0 = background).

        Raises:
            ValueError: If ``images`` is not a finite ``(B, 3, H, W)`` tensor.
        """
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(
                f"ShapeDetector needs RGB images (B, 3, H, W) in [0, 1], got shape {tuple(images.shape)}; "
                "convert videos or greyscale images first."
            )
        pixels = images.detach().to("cpu", torch.float32).permute(0, 2, 3, 1).numpy()
        if not np.isfinite(pixels).all():
            raise ValueError("ShapeDetector got non-finite pixel values; check the decoder output.")
        # argmin ‖p − c‖² = argmin (‖c‖² − 2 p·c)
        scores = (self.colors**2).sum(axis=1) - 2 * pixels @ self.colors.T
        return scores.argmin(axis=-1)

    def detect(self, images: Tensor) -> list[list[ShapeDetection]]:
        """Detect the objects of every image.

        Args:
            images: ``(B, 3, H, W)`` float tensor in [0, 1].

        Returns:
            Per image, its detections in raster order of their first pixel.

        Raises:
            ValueError: If ``images`` is not a finite ``(B, 3, H, W)`` tensor.
        """
        nearest = self.nearest_colors(images)
        batch, height, width = nearest.shape
        foreground = nearest > 0
        found: list[list[ShapeDetection]] = [[] for _ in range(batch)]
        if not foreground.any():
            return found
        roots, comp = np.unique(label_components(foreground)[foreground], return_inverse=True)
        _, ys, xs = np.nonzero(foreground)
        k, n_colors = len(roots), len(self.names)
        area = np.bincount(comp, minlength=k)
        x0, x1 = _extent(xs, comp, k)
        y0, y1 = _extent(ys, comp, k)
        votes = np.bincount(comp * n_colors + nearest[foreground] - 1, minlength=k * n_colors)
        color = votes.reshape(k, n_colors).argmax(axis=1)
        fill = area / ((x1 - x0) * (y1 - y0))
        asym = np.maximum(_imbalance(ys, y0, y1, comp, area), _imbalance(xs, x0, x1, comp, area))
        keep = area >= self._min_area(height, width)
        shapes = _classify(fill[keep], asym[keep])
        columns = (roots // (height * width), x0, y0, x1, y1, color, area, fill, asym)
        rows = zip(shapes, *(c[keep].tolist() for c in columns))
        for shape, b, bx0, by0, bx1, by1, c, a, f, s in rows:
            box = (float(bx0), float(by0), float(bx1), float(by1))
            found[b].append(ShapeDetection(shape, box, 1.0, None, self.names[c], a, f, s))
        return found
