"""ShapesEval prompts: GenEval-format metadata over shapes × palette colours, and the fixed splits.

Every prompt is a GenEval dict ``{"tag", "include", "exclude"?, "prompt"}`` (docs/maths.md §12) with the
original benchmark's phrasing:

==============  ==========================================  ============================================
tag             prompt                                      include (exclude)
==============  ==========================================  ============================================
single_object   a photo of a circle                         circle×1
two_object      a photo of a circle and a square            circle×1, square×1
counting        a photo of three triangles                  triangle×3 (exclude triangle×4)
colors          a photo of a red circle                     red circle×1
position        a photo of a circle right of a square       square×1, circle×1 at ["right of", 0]
color_attr      a photo of a red circle and a blue square   red circle×1, blue square×1
==============  ==========================================  ============================================

Clauses of one prompt always name different shapes, as in GenEval. Splits (:func:`build_splits`):

* ``heldout``: every ``colors``/``color_attr`` prompt naming a held-out colour–shape pair and every
  ``position`` prompt naming a held-out (shape, relation, shape) triple (:mod:`~rlgen_cli.shapes.vocab`).
* ``train``/``test``: the other prompts. ``color_attr`` has enough combinations to split them: a fixed
  ``test_fraction`` of them is test-only (unseen combinations of seen colour–shape pairs). The small
  tags (3 to 20 distinct prompts) are shared by train and test; test differs by its images.

Each split lists ``per_tag`` rows per tag (cycling through shuffled passes of the tag's prompts) and
interleaves the tags round-robin, so training samples tags evenly and any prefix of a file (e.g. the
first ``data.eval_num_prompts`` test prompts) is balanced across tags. Everything is a pure function
of :class:`SplitConfig`.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import permutations
from pathlib import Path
from typing import Any

from rlgen_cli.shapes.vocab import (
    COLORS,
    COUNT_WORDS,
    HELDOUT_COLOR_SHAPES,
    HELDOUT_RELATIONS,
    RELATIONS,
    SHAPES,
    TAGS,
    plural,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SPLITS", "SplitConfig", "build_splits", "is_heldout", "prompt_universe", "read_jsonl", "write_jsonl",
]  # fmt: skip

SPLITS: tuple[str, ...] = ("train", "test", "heldout")
Meta = dict[str, Any]


@dataclass(frozen=True)
class SplitConfig:
    """Sizes and seed of the ShapesEval splits.

    Attributes:
        train_per_tag: Rows per tag in ``train``.
        test_per_tag: Rows per tag in ``test``.
        heldout_per_tag: Rows per tag in ``heldout`` (tags ``colors``, ``position``, ``color_attr``).
        test_fraction: Share of the seen ``color_attr`` combinations kept for ``test`` only.
        seed: Seeds the shuffles.
    """

    train_per_tag: int = 128
    test_per_tag: int = 48
    heldout_per_tag: int = 54
    test_fraction: float = 0.2
    seed: int = 0


def _meta(tag: str, include: list[Meta], prompt: str, exclude: list[Meta] | None = None) -> Meta:
    """Assemble one GenEval dict, keys in the original order."""
    meta: Meta = {"tag": tag, "include": include}
    if exclude:
        meta["exclude"] = exclude
    meta["prompt"] = prompt
    return meta


def _single_object() -> list[Meta]:
    """``a photo of a circle``, one per shape."""
    return [_meta("single_object", [{"class": s, "count": 1}], f"a photo of a {s}") for s in SHAPES]


def _two_object() -> list[Meta]:
    """``a photo of a circle and a square``, every ordered pair of different shapes."""
    return [
        _meta(
            "two_object", [{"class": a, "count": 1}, {"class": b, "count": 1}], f"a photo of a {a} and a {b}"
        )
        for a, b in permutations(SHAPES, 2)
    ]


def _counting() -> list[Meta]:
    """``a photo of three triangles`` (exclude one more), every shape × count."""
    return [
        _meta(
            "counting",
            [{"class": s, "count": n}],
            f"a photo of {word} {plural(s)}",
            exclude=[{"class": s, "count": n + 1}],
        )
        for s in SHAPES
        for n, word in COUNT_WORDS.items()
    ]


def _colors() -> list[Meta]:
    """``a photo of a red circle``, every colour × shape."""
    return [
        _meta("colors", [{"class": s, "count": 1, "color": c}], f"a photo of a {c} {s}")
        for s in SHAPES
        for c in COLORS
    ]


def _position() -> list[Meta]:
    """``a photo of a circle right of a square``, every ordered shape pair × relation."""
    rows = []
    for (a, b), rel in ((pair, rel) for pair in permutations(SHAPES, 2) for rel in RELATIONS):
        include = [{"class": b, "count": 1}, {"class": a, "count": 1, "position": [rel, 0]}]
        rows.append(_meta("position", include, f"a photo of a {a} {rel} a {b}"))
    return rows


def _color_attr() -> list[Meta]:
    """``a photo of a red circle and a blue square``, ordered shape pairs × different colours."""
    rows = []
    for a, b in permutations(SHAPES, 2):
        for ca, cb in permutations(COLORS, 2):
            include = [{"class": a, "count": 1, "color": ca}, {"class": b, "count": 1, "color": cb}]
            rows.append(_meta("color_attr", include, f"a photo of a {ca} {a} and a {cb} {b}"))
    return rows


def prompt_universe() -> dict[str, list[Meta]]:
    """Return every ShapesEval prompt, by tag (in :data:`~rlgen_cli.shapes.vocab.TAGS` order)."""
    makers = (_single_object, _two_object, _counting, _colors, _position, _color_attr)
    return {tag: make() for tag, make in zip(TAGS, makers)}


def is_heldout(meta: Mapping[str, Any]) -> bool:
    """True when a prompt names a held-out colour–shape pair or (shape, relation, shape) triple."""
    include = meta["include"]
    if any((c.get("color"), c["class"]) in HELDOUT_COLOR_SHAPES for c in include):
        return True
    for clause in include:
        if "position" in clause:
            relation, target = clause["position"]
            if (clause["class"], relation, include[target]["class"]) in HELDOUT_RELATIONS:
                return True
    return False


def _cycle(pool: Sequence[Meta], n: int, rng: random.Random) -> list[Meta]:
    """Return ``n`` rows from shuffled passes over ``pool`` (each pass a fresh permutation)."""
    rows: list[Meta] = []
    while len(rows) < n:
        order = list(pool)
        rng.shuffle(order)
        rows += order
    return rows[:n]


def _interleave(by_tag: Mapping[str, Sequence[Meta]]) -> list[Meta]:
    """Round-robin over tags: row i of every tag, then row i + 1, …"""
    longest = max((len(v) for v in by_tag.values()), default=0)
    return [rows[i] for i in range(longest) for rows in by_tag.values() if i < len(rows)]


def _partition(config: SplitConfig) -> dict[str, dict[str, list[Meta]]]:
    """Split the universe into distinct prompts per split and tag."""
    rng = random.Random(config.seed)
    pools: dict[str, dict[str, list[Meta]]] = {split: {} for split in SPLITS}
    for tag, rows in prompt_universe().items():
        seen = [m for m in rows if not is_heldout(m)]
        held = [m for m in rows if is_heldout(m)]
        if tag == "color_attr":
            rng.shuffle(seen)
            n_test = round(config.test_fraction * len(seen))
            pools["test"][tag], pools["train"][tag] = seen[:n_test], seen[n_test:]
        else:
            pools["train"][tag] = pools["test"][tag] = seen
        if held:
            pools["heldout"][tag] = held
    return pools


def build_splits(config: SplitConfig = SplitConfig()) -> dict[str, list[Meta]]:
    """Build the ``train``, ``test`` and ``heldout`` rows (see the module docstring).

    Args:
        config: Sizes and seed.

    Returns:
        ``{split: [GenEval dict, …]}``, tags interleaved round-robin.

    Raises:
        ValueError: If a size is not positive or ``test_fraction`` is outside (0, 1).
    """
    sizes = {"train": config.train_per_tag, "test": config.test_per_tag, "heldout": config.heldout_per_tag}
    if min(sizes.values()) < 1 or not 0 < config.test_fraction < 1:
        raise ValueError(f"SplitConfig needs positive per-tag sizes and 0 < test_fraction < 1, got {config}.")
    pools = _partition(config)
    splits = {}
    for split in SPLITS:
        rng = random.Random(f"{config.seed}:{split}")
        by_tag = {tag: _cycle(pool, sizes[split], rng) for tag, pool in pools[split].items()}
        splits[split] = [json.loads(json.dumps(m)) for m in _interleave(by_tag)]  # independent copies
    return splits


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: str | Path) -> Path:
    """Write GenEval dicts, one JSON object per line (compact, keys in insertion order).

    Args:
        rows: The dicts.
        path: Output file; parent directories are created.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dict(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: str | Path) -> list[Meta]:
    """Read GenEval dicts written by :func:`write_jsonl` (blank lines skipped)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
