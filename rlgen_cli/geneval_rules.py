"""GenEval's scoring rules: detected objects checked against a prompt's GenEval metadata.

Shared by the GenEval reward (:mod:`rlgen_cli.rewards.geneval`, objects from a detector and a CLIP colour
check) and ShapesEval (:mod:`rlgen_cli.shapes`, objects from its shape detector); it imports nothing else
from the package.

GenEval (Ghosh et al. 2023, "GenEval: An Object-Focused Framework for Evaluating Text-to-Image
Alignment") checks each image against structured metadata (``include``/``exclude`` clauses with class,
count, colour, relative position). Scoring is pure (dataclasses in, dataclasses out) and separate
from detection:

* ``accuracy``: the original benchmark's correctness (``evaluate_images.py``): an ``include`` clause
  needs at least ``count`` objects; colour and position are checked on the ``count`` most confident
  ones; an ``exclude`` clause fails when ``count`` or more objects are found. Counting prompts carry
  ``exclude: count + 1``, which makes their counts exact.
* ``score``: Flow-GRPO's partial credit (docs/maths.md §10.3). Per ``include`` clause: count term
  ``1 − |req − found|/req`` (floored at 0 unless ``clamp_count_term=False``, so the score stays in
  [0, 1]); a wrong count on a clause with colour/position appends 0; a right count appends the colour
  term ``1 − |req − with_colour|/req`` and a position term: 1 when the relation holds, else as
  ``position_credit`` says — ``upstream`` reproduces Flow-GRPO's reward server (a failed relation
  appends 0 and then 1, a missing target group 0, and a clause whose colour failed adds no position
  term), ``strict`` appends a single 0 for any position not satisfied. Score = mean of all terms.
* ``strict``: exact counts for every ``include`` clause (so no extra objects of a requested class),
  every colour and position satisfied, and every ``exclude`` clause respected. The server's strict
  verdict skips the ``exclude`` clauses; on GenEval's prompts, whose only excludes are the counting
  prompts' ``count + 1``, exact counts imply them and the two agree.

Thresholds: confidence > 0.3 (> 0.9 for ``counting``; compared in float32 as upstream), at most 16
objects per class, position margin 0.1 of the summed box sizes, relations on box centres as in the
original.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "POSITION_CREDITS", "TAGS", "TIE_ORDERS", "ColorFn", "Detection", "GenEvalResult", "GenEvalThresholds",
    "check_position_credit", "position_holds", "relative_position", "score_geneval", "select_detections",
    "summarise",
]  # fmt: skip

POSITION_CREDITS = ("upstream", "strict")
TIE_ORDERS = ("upstream", "listed")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

ColorFn = Callable[[Sequence["Detection"], str], list[str]]


@dataclass(frozen=True)
class Detection:
    """One detected object.

    Attributes:
        label: GenEval class name, e.g. ``"dog"``.
        box: ``(x0, y0, x1, y1)`` in pixels.
        score: Detector confidence in [0, 1].
        mask: Optional ``(H, W)`` boolean instance mask (colour crops then ignore the background).
    """

    label: str
    box: tuple[float, float, float, float]
    score: float
    mask: np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True)
class GenEvalThresholds:
    """Detection filtering and position settings of the original benchmark.

    ``tie_order`` orders detections of equal score: ``"upstream"`` puts the later-listed first, as GenEval's
    ``np.argsort(scores)[::-1]`` does (the GenEval reward's setting); ``"listed"`` keeps the listed order
    (ShapesEval, whose detector scores every shape 1.0 and lists them in raster order).
    """

    confidence: float = 0.3
    counting_confidence: float = 0.9
    max_objects: int = 16
    position_margin: float = 0.1
    tie_order: str = "listed"

    def __post_init__(self) -> None:
        if self.tie_order not in TIE_ORDERS:
            raise ValueError(
                f"tie_order={self.tie_order!r}; choose 'upstream' (equal scores: later-listed first, as "
                "GenEval's evaluate_images.py) or 'listed' (equal scores in listed order)."
            )


@dataclass
class GenEvalResult:
    """GenEval outcome for one image.

    Attributes:
        tag: The metadata's task tag.
        score: Partial credit in [0, 1] (can be negative only with ``clamp_count_term=False``).
        accuracy: Original GenEval correctness.
        strict: Exact-count correctness.
        reasons: Human-readable failures, empty when strict.
    """

    tag: str
    score: float
    accuracy: bool
    strict: bool
    reasons: list[str] = field(default_factory=list)


def select_detections(
    detections: Sequence[Detection], tag: str, thresholds: GenEvalThresholds = GenEvalThresholds()
) -> dict[str, list[Detection]]:
    """Group detections by class, keeping those above the tag's threshold, most confident first.

    As GenEval's ``evaluate_images.py``, scores and threshold are compared in float32 (its detector's
    score array is float32, so a score of exactly ``float32(0.3)`` is not above 0.3); equal scores are
    ordered by ``thresholds.tie_order``.

    Args:
        detections: All detections of one image.
        tag: GenEval tag; ``"counting"`` uses the stricter threshold.
        thresholds: Filtering settings.

    Returns:
        ``{class: detections}`` sorted by descending score, at most ``max_objects`` per class.
    """
    cutoff = np.float32(thresholds.counting_confidence if tag == "counting" else thresholds.confidence)
    grouped: dict[str, list[Detection]] = {}
    for det in _most_confident_first(detections, thresholds.tie_order):
        kept = grouped.setdefault(det.label, [])
        if np.float32(det.score) > cutoff and len(kept) < thresholds.max_objects:
            kept.append(det)
    return {label: dets for label, dets in grouped.items() if dets}


def _most_confident_first(detections: Sequence[Detection], tie_order: str) -> list[Detection]:
    """Descending float32 score; equal scores later-listed first (``"upstream"``: a stable ascending sort,
    reversed, as ``np.argsort(scores)[::-1]``) or in listed order (``"listed"``)."""
    if tie_order == "upstream":
        return sorted(detections, key=lambda d: np.float32(d.score))[::-1]
    return sorted(detections, key=lambda d: np.float32(d.score), reverse=True)


def relative_position(box_a: Sequence[float], box_b: Sequence[float], margin: float = 0.1) -> set[str]:
    """Return the relations of box A relative to box B, as in GenEval.

    The centre offset shrinks by ``margin · (size_a + size_b)`` per axis; a relation holds when the
    shrunk offset, divided by the raw offset's norm, exceeds 0.5 along that direction.

    Args:
        box_a: ``(x0, y0, x1, y1)`` of the object being placed.
        box_b: ``(x0, y0, x1, y1)`` of the reference object.
        margin: Fraction of the summed box sizes treated as "no offset".

    Returns:
        Subset of ``{"left of", "right of", "above", "below"}`` (image y grows downwards).
    """
    a, b = np.asarray(box_a[:4], dtype=np.float64), np.asarray(box_b[:4], dtype=np.float64)
    offset = (a[:2] + a[2:]) / 2 - (b[:2] + b[2:]) / 2
    sizes = np.abs(a[2:] - a[:2]) + np.abs(b[2:] - b[:2])
    revised = np.maximum(np.abs(offset) - margin * sizes, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    rules = (("left of", dx < -0.5), ("right of", dx > 0.5), ("above", dy < -0.5), ("below", dy > 0.5))
    return {name for name, holds in rules if holds}


def position_holds(
    objects: Sequence[Detection], targets: Sequence[Detection] | None, relation: str, margin: float
) -> bool:
    """True when every object stands in ``relation`` to every target (False without targets)."""
    if targets is None:
        return False
    return all(relation in relative_position(o.box, t.box, margin) for o in objects for t in targets)


def _original_accuracy(
    objects: Mapping[str, list[Detection]], metadata: Mapping[str, Any], colors: ColorFn, margin: float
) -> bool:
    """GenEval's binary correctness (``evaluate`` in the original ``evaluate_images.py``)."""
    groups: list[list[Detection] | None] = []
    correct = True
    for req in metadata.get("include", []):
        found = objects.get(req["class"], [])[: req["count"]]
        matched = len(found) >= req["count"]
        if matched and "color" in req:
            matched = colors(found, req["class"]).count(req["color"]) >= req["count"]
        if matched and "position" in req:
            relation, target = req["position"]
            matched = position_holds(found, groups[target], relation, margin)
        groups.append(found if matched else None)
        correct = correct and matched
    return correct and _excludes_hold(objects, metadata)


def _excludes_hold(objects: Mapping[str, list[Detection]], metadata: Mapping[str, Any]) -> bool:
    """True when every ``exclude`` clause finds fewer than ``count`` objects."""
    return all(len(objects.get(req["class"], [])) < req["count"] for req in metadata.get("exclude", []))


def check_position_credit(position_credit: str) -> None:
    """Raise a ValueError naming the options for an unknown ``position_credit``."""
    if position_credit not in POSITION_CREDITS:
        raise ValueError(
            f"position_credit={position_credit!r}; choose one of {', '.join(POSITION_CREDITS)} "
            "(upstream = Flow-GRPO's GenEval server, strict = one 0 for a failed position)"
        )


def _position_terms(
    holds: bool | None, has_target: bool, colour_ok: bool, position_credit: str
) -> list[float]:
    """The partial-credit terms of one position check (``holds`` is None when it was not checked)."""
    if holds:
        return [1.0]
    if position_credit == "strict":
        return [0.0]
    if not colour_ok:  # upstream checks a position only while the clause still matches
        return []
    return [0.0, 1.0] if has_target else [0.0]  # upstream appends 1 after its loop even on a failure


def _partial_credit(
    objects: Mapping[str, list[Detection]],
    metadata: Mapping[str, Any],
    colors: ColorFn,
    margin: float,
    clamp_count_term: bool,
    position_credit: str,
) -> tuple[float, bool, list[str]]:
    """Flow-GRPO partial credit; returns ``(score, all include clauses exact, reasons)``."""
    terms: list[float] = []
    reasons: list[str] = []
    groups: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        name, need = req["class"], req["count"]
        found = objects.get(name, [])
        count_term = 1 - abs(need - len(found)) / need
        terms.append(max(count_term, 0.0) if clamp_count_term else count_term)
        matched = len(found) == need
        if not matched:
            reasons.append(f"expected {name}=={need}, found {len(found)}")
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                with_color = colors(found, name).count(req["color"])
                terms.append(1 - abs(need - with_color) / need)
                if with_color != need:
                    matched = False
                    reasons.append(f"expected {need} {req['color']} {name}, found {with_color}")
            if "position" in req:
                relation, target = req["position"]
                holds = matched and position_holds(found, groups[target], relation, margin)
                terms += _position_terms(holds, groups[target] is not None, matched, position_credit)
                if not holds:
                    matched = False
                    reasons.append(f"expected {name} {relation} group {target}")
        groups.append(found if matched else None)
    score = sum(terms) / len(terms) if terms else 0.0
    return score, all(g is not None for g in groups), reasons


def score_geneval(
    detections: Sequence[Detection],
    metadata: Mapping[str, Any],
    colors: ColorFn,
    thresholds: GenEvalThresholds = GenEvalThresholds(),
    clamp_count_term: bool = True,
    position_credit: str = "upstream",
) -> GenEvalResult:
    """Score one image's detections against its GenEval metadata.

    Args:
        detections: Raw detections of the image (any confidence).
        metadata: GenEval dict with ``tag``, ``include`` and optional ``exclude``.
        colors: ``colors(objects, classname) -> [colour per object]``; called at most once per clause.
        thresholds: Detection filtering and position settings.
        clamp_count_term: Floor the count term at 0 (docs/maths.md §10.3); ``False`` reproduces
            the upstream server, whose count term goes negative for over-generation.
        position_credit: ``upstream`` (the server's terms for a failed position) or ``strict`` (one 0);
            see the module docstring.

    Returns:
        Partial credit, original accuracy and strict correctness.

    Raises:
        ValueError: If ``metadata`` has no ``tag`` or ``include``, or on an unknown ``position_credit``.
    """
    check_position_credit(position_credit)
    if "tag" not in metadata or "include" not in metadata:
        raise ValueError(
            f"GenEval metadata needs 'tag' and 'include' keys, got {sorted(metadata)}; "
            "load prompts from a GenEval .jsonl (docs/maths.md §12 describes the format)."
        )
    objects = select_detections(detections, metadata["tag"], thresholds)
    cache: dict[tuple[str, int], list[str]] = {}

    def cached_colors(found: Sequence[Detection], classname: str) -> list[str]:
        key = (classname, len(found))  # both scorers pass a prefix of the same sorted list
        if key not in cache:
            cache[key] = list(colors(found, classname))
        return cache[key]

    margin = thresholds.position_margin
    accuracy = _original_accuracy(objects, metadata, cached_colors, margin)
    score, exact, reasons = _partial_credit(
        objects, metadata, cached_colors, margin, clamp_count_term, position_credit
    )
    excludes = _excludes_hold(objects, metadata)
    if not excludes:
        reasons.append("an exclude clause was violated")
    return GenEvalResult(metadata["tag"], float(score), accuracy, exact and excludes, reasons)


def summarise(results: Sequence[GenEvalResult], key: str = "accuracy") -> dict[str, float]:
    """Average one field per tag, plus ``"overall"`` = mean over tags (GenEval's overall score).

    Args:
        results: Per-image results.
        key: ``"accuracy"``, ``"strict"`` or ``"score"``.

    Returns:
        ``{tag: mean, ..., "overall": mean of the tag means}``; empty input gives ``{}``.
    """
    by_tag: dict[str, list[float]] = {}
    for result in results:
        by_tag.setdefault(result.tag, []).append(float(getattr(result, key)))
    summary = {tag: sum(values) / len(values) for tag, values in by_tag.items()}
    if summary:
        summary["overall"] = sum(summary.values()) / len(summary)
    return summary
