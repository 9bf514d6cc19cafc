"""Shared helpers for the ShapesEval tests: hand-painted images."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from rlgen_cli.shapes.render import shape_mask
from rlgen_cli.shapes.vocab import BACKGROUND, PALETTE

# (shape, colour, x, y, side): a shape drawn in its side × side box with top-left corner (x, y).
Obj = tuple[str, str, int, int, int]


def paint(objects: Sequence[Obj], size: int = 32) -> torch.Tensor:
    """Return a (3, size, size) image with the given shapes painted in palette colours."""
    image = np.empty((size, size, 3), dtype=np.float32)
    image[:] = BACKGROUND
    for shape, color, x, y, side in objects:
        image[y : y + side, x : x + side][shape_mask(shape, side)] = PALETTE[color]
    return torch.from_numpy(image).permute(2, 0, 1).contiguous()


@pytest.fixture
def painter():
    """The :func:`paint` helper, as a fixture."""
    return paint
