"""ShapesEval vocabulary: shapes, the colour palette, relations and the held-out combinations.

Every ShapesEval module reads its constants from here, so the renderer, the prompt generator and the
detector always agree. Colours are a subset of GenEval's colour names with fixed RGB values, far apart
from each other and from the black background, so a nearest-colour rule reads them back exactly.

Held-out combinations (the ``heldout`` split) never appear in a training prompt and, by default, never
in a rendered image of a prompt that does not name them:

* :data:`HELDOUT_COLOR_SHAPES`: one colour–shape pair per shape (``colors`` and ``color_attr`` prompts).
* :data:`HELDOUT_RELATIONS`: two layouts, each in both phrasings: one triple per relation (``position``).
"""

from __future__ import annotations

__all__ = [
    "BACKGROUND", "COLORS", "COUNT_WORDS", "HELDOUT_COLOR_SHAPES", "HELDOUT_RELATIONS", "PALETTE",
    "RELATIONS", "SHAPES", "TAGS", "plural",
]  # fmt: skip

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
"""Object classes, GenEval ``include[i]["class"]`` values."""

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "yellow": (0.95, 0.90, 0.10),
    "green": (0.10, 0.75, 0.20),
    "blue": (0.15, 0.30, 0.95),
    "purple": (0.60, 0.15, 0.80),
    "white": (0.95, 0.95, 0.95),
}
"""Colour name -> RGB in [0, 1]; names are GenEval colours."""

COLORS: tuple[str, ...] = tuple(PALETTE)
BACKGROUND: tuple[float, float, float] = (0.0, 0.0, 0.0)
"""Background RGB (black: not a palette colour)."""

RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
"""GenEval position relations (image y grows downwards)."""

TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COUNT_WORDS: dict[int, str] = {2: "two", 3: "three", 4: "four"}
"""Counts used by ``counting`` prompts (GenEval uses 2–4)."""

HELDOUT_COLOR_SHAPES: frozenset[tuple[str, str]] = frozenset(
    {("purple", "circle"), ("yellow", "square"), ("green", "triangle")}
)
"""(colour, shape) pairs never named in train/test prompts nor drawn for unspecified colours."""

HELDOUT_RELATIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("circle", "left of", "triangle"),
        ("triangle", "right of", "circle"),
        ("square", "above", "circle"),
        ("circle", "below", "square"),
    }
)
"""(shape, relation, reference shape) triples never named in train/test ``position`` prompts: two
spatial arrangements (a circle left of a triangle, a square above a circle), each in both phrasings, so
a held-out layout is never described in training in either direction."""


def plural(shape: str) -> str:
    """Return the plural of a shape name (``"circle"`` -> ``"circles"``)."""
    return f"{shape}s"
