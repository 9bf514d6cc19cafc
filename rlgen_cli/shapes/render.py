"""Deterministic ShapesEval renderer: GenEval metadata + seed -> ground-truth image.

A scene holds every object an ``include`` clause asks for (``count`` objects of ``class``). Objects are
flat, axis-aligned shapes in exact palette colours on a black background, with no antialiasing, so the
detector reads them back exactly. Sizes and positions are random (``random.Random(seed)``) but

* boxes never touch: inflated by ``gap`` pixels they do not overlap;
* a clause with ``"position": [relation, j]`` places each of its objects so that GenEval's
  :func:`~rlgen_cli.geneval_rules.relative_position` (margin 0.1, box centres) of it against every
  object of clause ``j`` is exactly ``{relation}`` — the relation holds, the other axis stays neutral;
* a clause without ``"color"`` draws colours uniformly from the palette, avoiding ``avoid`` pairs
  (default: the held-out colour–shape pairs, so they are only ever drawn when a prompt names them).

Boxes are ``(x0, y0, x1, y1)`` pixel edges (``x1``/``y1`` exclusive): the rendered mask's extent, the
same convention as :mod:`rlgen_cli.shapes.detect`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlgen_cli.geneval_rules import relative_position
from rlgen_cli.shapes.vocab import BACKGROUND, COLORS, HELDOUT_COLOR_SHAPES, PALETTE, SHAPES

logger = logging.getLogger(__name__)

__all__ = ["PlacedObject", "RenderConfig", "layout", "render", "render_batch", "shape_mask"]

Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class RenderConfig:
    """Rendering settings.

    Attributes:
        size: Image height and width in pixels.
        min_frac: Smallest object side, as a fraction of ``size``.
        max_frac: Largest object side, as a fraction of ``size``.
        gap: Minimum free pixels between two objects' boxes.
        position_margin: GenEval position margin that relations must satisfy.
        max_tries: Scene attempts before giving up (each places objects with ``max_tries`` draws).
    """

    size: int = 32
    min_frac: float = 0.22
    max_frac: float = 0.34
    gap: int = 2
    position_margin: float = 0.1
    max_tries: int = 200

    def side_range(self) -> tuple[int, int]:
        """Return the inclusive ``(min, max)`` object side in pixels (at least 5)."""
        low = max(5, round(self.min_frac * self.size))
        return low, max(low, round(self.max_frac * self.size))


@dataclass(frozen=True)
class PlacedObject:
    """One rendered object.

    Attributes:
        shape: One of :data:`~rlgen_cli.shapes.vocab.SHAPES`.
        color: Palette colour name.
        box: ``(x0, y0, x1, y1)`` extent of its pixels, ``x1``/``y1`` exclusive.
        clause: Index of the ``include`` clause it belongs to.
        origin: ``(x, y)`` of the top-left corner of its ``side × side`` drawing box.
        side: Drawing box side in pixels (``box`` is the extent of the mask inside it).
    """

    shape: str
    color: str
    box: Box
    clause: int
    origin: tuple[int, int]
    side: int


@lru_cache(maxsize=256)
def shape_mask(shape: str, side: int) -> np.ndarray:
    """Return the ``(side, side)`` boolean mask of a shape, sampled at pixel centres.

    A circle of diameter ``side``, a full square, or an upward isosceles triangle whose base is the
    bottom row and whose apex is the top row's centre.

    Args:
        shape: One of :data:`~rlgen_cli.shapes.vocab.SHAPES`.
        side: Box side in pixels.

    Returns:
        A read-only boolean array.

    Raises:
        ValueError: If ``shape`` is unknown.
    """
    centres = np.arange(side) + 0.5
    x, y = np.meshgrid(centres, centres)
    half = side / 2
    if shape == "circle":
        mask = (x - half) ** 2 + (y - half) ** 2 <= half**2
    elif shape == "square":
        mask = np.ones((side, side), dtype=bool)
    elif shape == "triangle":
        mask = np.abs(x - half) <= (y + 0.5) / side * half
    else:
        raise ValueError(f"unknown shape {shape!r}; ShapesEval shapes are {SHAPES}.")
    mask.setflags(write=False)
    return mask


def _mask_box(shape: str, side: int, x0: int, y0: int) -> Box:
    """Return the pixel extent of a shape drawn with its ``side`` box at ``(x0, y0)``."""
    rows, cols = np.nonzero(shape_mask(shape, side))
    return (x0 + int(cols.min()), y0 + int(rows.min()), x0 + int(cols.max()) + 1, y0 + int(rows.max()) + 1)


def _apart(a: Box, b: Box, gap: int) -> bool:
    """True when boxes ``a`` and ``b`` are at least ``gap`` pixels apart along x or y."""
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def _plan(
    metadata: Mapping[str, Any], rng: random.Random, avoid: Collection[tuple[str, str]]
) -> list[tuple[int, str, str]]:
    """Expand ``include`` clauses into ``(clause, shape, colour)`` objects.

    Raises:
        ValueError: On an unknown shape or colour, a non-positive count, or a position clause that
            refers to itself or a later clause.
    """
    objects = []
    for index, clause in enumerate(metadata.get("include", [])):
        shape, count, color = clause["class"], int(clause["count"]), clause.get("color")
        if shape not in SHAPES or (color is not None and color not in PALETTE) or count < 1:
            raise ValueError(
                f"cannot render include clause {clause}: class must be one of {SHAPES}, colour one of "
                f"{COLORS}, count ≥ 1; build ShapesEval metadata with rlgen_cli.shapes.prompts."
            )
        if "position" in clause and not 0 <= int(clause["position"][1]) < index:
            raise ValueError(
                f"include clause {index} refers to clause {clause['position'][1]}, not an earlier one."
            )
        allowed = [c for c in COLORS if (c, shape) not in avoid] or list(COLORS)
        objects += [(index, shape, color or rng.choice(allowed)) for _ in range(count)]
    return objects


def _relation_ok(box: Box, targets: Sequence[Box], relation: str, margin: float) -> bool:
    """True when ``box`` stands exactly in ``relation`` (and no other) to every target box."""
    return all(relative_position(box, t, margin) == {relation} for t in targets)


def _place(
    objects: Sequence[tuple[int, str, str]],
    relations: Mapping[int, tuple[str, int]],
    rng: random.Random,
    config: RenderConfig,
) -> list[PlacedObject] | None:
    """One attempt at placing every object in order; ``None`` when one of them does not fit."""
    low, high = config.side_range()
    placed: list[PlacedObject] = []
    for clause, shape, color in objects:
        for _ in range(config.max_tries):
            side = rng.randint(low, high)
            x0, y0 = rng.randint(0, config.size - side), rng.randint(0, config.size - side)
            box = _mask_box(shape, side, x0, y0)
            if not all(_apart(box, p.box, config.gap) for p in placed):
                continue
            if clause in relations:
                relation, target = relations[clause]
                targets = [p.box for p in placed if p.clause == target]
                if not _relation_ok(box, targets, relation, config.position_margin):
                    continue
            placed.append(PlacedObject(shape, color, box, clause, (x0, y0), side))
            break
        else:
            return None
    return placed


def layout(
    metadata: Mapping[str, Any],
    seed: int,
    config: RenderConfig = RenderConfig(),
    avoid: Collection[tuple[str, str]] = HELDOUT_COLOR_SHAPES,
) -> list[PlacedObject]:
    """Choose the objects of a scene: shapes, colours and boxes.

    Args:
        metadata: GenEval dict (``include`` clauses over ShapesEval shapes and colours).
        seed: Seeds ``random.Random``; the same metadata and seed give the same scene.
        config: Rendering settings.
        avoid: ``(colour, shape)`` pairs never drawn for a clause without ``"color"``.

    Returns:
        The placed objects, in clause order.

    Raises:
        ValueError: If the metadata is not renderable or the objects do not fit in the image.
    """
    rng = random.Random(seed)
    objects = _plan(metadata, rng, avoid)
    relations = {
        i: (str(c["position"][0]), int(c["position"][1]))
        for i, c in enumerate(metadata.get("include", []))
        if "position" in c
    }
    for _ in range(config.max_tries):
        placed = _place(objects, relations, rng, config)
        if placed is not None:
            return placed
    raise ValueError(
        f"could not place {len(objects)} objects in a {config.size}×{config.size} image for "
        f"{metadata.get('prompt', metadata)!r}; raise RenderConfig.size or lower max_frac/gap."
    )


def render(
    metadata: Mapping[str, Any],
    seed: int,
    config: RenderConfig = RenderConfig(),
    avoid: Collection[tuple[str, str]] = HELDOUT_COLOR_SHAPES,
) -> tuple[Tensor, list[PlacedObject]]:
    """Render one ground-truth image.

    Args:
        metadata: GenEval dict (see :func:`layout`).
        seed: Scene seed.
        config: Rendering settings.
        avoid: ``(colour, shape)`` pairs never drawn for a clause without ``"color"``.

    Returns:
        ``(image, objects)``: a float32 ``(3, size, size)`` tensor in [0, 1] and the placed objects.

    Raises:
        ValueError: If the metadata is not renderable or the objects do not fit.
    """
    objects = layout(metadata, seed, config, avoid)
    image = np.empty((config.size, config.size, 3), dtype=np.float32)
    image[:] = BACKGROUND
    for obj in objects:
        (x0, y0), side = obj.origin, obj.side
        image[y0 : y0 + side, x0 : x0 + side][shape_mask(obj.shape, side)] = PALETTE[obj.color]
    return torch.from_numpy(image).permute(2, 0, 1).contiguous(), objects


def render_batch(
    metadata: Sequence[Mapping[str, Any]],
    seeds: Sequence[int],
    config: RenderConfig = RenderConfig(),
    avoid: Collection[tuple[str, str]] = HELDOUT_COLOR_SHAPES,
) -> Tensor:
    """Render a batch of ground-truth images.

    Args:
        metadata: B GenEval dicts.
        seeds: B scene seeds.
        config: Rendering settings.
        avoid: See :func:`render`.

    Returns:
        A float32 ``(B, 3, size, size)`` tensor in [0, 1].

    Raises:
        ValueError: If the lengths differ or a scene cannot be rendered.
    """
    if len(metadata) != len(seeds):
        raise ValueError(
            f"render_batch got {len(metadata)} metadata dicts but {len(seeds)} seeds; pass one seed each."
        )
    return torch.stack([render(meta, seed, config, avoid)[0] for meta, seed in zip(metadata, seeds)])
