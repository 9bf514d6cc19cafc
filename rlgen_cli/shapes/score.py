"""ShapesEval scoring: GenEval metrics on :class:`~rlgen_cli.shapes.detect.ShapeDetector` output, plus
the headline **strict accuracy** and the extra-object count.

GenEval's rules come from :func:`rlgen_cli.geneval_rules.score_geneval` unchanged (colours read from
the detections): ``score`` = Flow-GRPO partial credit, ``accuracy`` = the original binary metric,
``geneval_strict`` = exact counts + colours + positions + excludes. ShapesEval adds:

* ``n_extra``: detected objects nobody asked for. For each detected shape,
  ``max(0, found − requested)``, where ``requested`` sums the counts of the ``include`` clauses naming
  it (0 for a shape the prompt does not mention); summed over shapes.
* ``strict`` (headline): ``geneval_strict`` and ``n_extra == 0`` — every requested object with its
  colour, count and relation, and no unrequested object. GenEval's partial credit and accuracy ignore
  objects of other classes, which a generator can exploit by drawing clutter; strict does not.
* ``extra_rate``: share of images with at least one extra object.
* ``objects``: per-object credit (:func:`object_credit`), the default training signal.

Summaries average per tag, then ``overall`` = mean of the tag means (GenEval's overall score).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlgen_cli.geneval_rules import (
    Detection,
    GenEvalResult,
    GenEvalThresholds,
    position_holds,
    score_geneval,
    summarise,
)
from rlgen_cli.shapes.detect import ShapeDetector
from rlgen_cli.shapes.vocab import COLORS, SHAPES, TAGS

logger = logging.getLogger(__name__)

__all__ = [
    "METRICS", "ObjectCredit", "ShapesResult", "check_metadata", "count_extra", "format_summary",
    "object_credit", "score_detections", "score_images", "summarise_results",
]  # fmt: skip

METRICS: dict[str, str] = {
    "strict": "strict",
    "accuracy": "accuracy",
    "partial": "score",
    "geneval_strict": "geneval_strict",
    "extra_rate": "has_extra",
    "n_extra": "n_extra",
}
"""Summary name -> :class:`ShapesResult` attribute averaged for it."""


@dataclass
class ShapesResult(GenEvalResult):
    """ShapesEval outcome for one image (``score`` = partial credit, ``accuracy`` = GenEval binary).

    Attributes:
        strict: ShapesEval strict: ``geneval_strict`` and no extra object.
        geneval_strict: GenEval's strict (exact counts, colours, positions, excludes).
        n_extra: Detected objects beyond those requested, per shape.
        n_objects: All detected objects.
        objects: Per-object credit (:func:`object_credit`).
        n_surplus: Detected objects beyond the number requested, whatever their shape.
    """

    geneval_strict: bool = False
    n_extra: int = 0
    n_objects: int = 0
    objects: float = 0.0
    n_surplus: int = 0

    @property
    def has_extra(self) -> bool:
        """True when the image holds at least one unrequested object."""
        return self.n_extra > 0


def check_metadata(metadata: Mapping[str, Any]) -> None:
    """Check that a GenEval dict only names ShapesEval shapes and colours.

    Args:
        metadata: GenEval dict.

    Raises:
        ValueError: If ``tag``/``include`` are missing or a clause names an unknown class or colour.
    """
    if "tag" not in metadata or "include" not in metadata:
        raise ValueError(
            f"ShapesEval metadata needs 'tag' and 'include', got keys {sorted(metadata)}; "
            "use the shapes prompt files (data=shapes)."
        )
    for clause in [*metadata["include"], *metadata.get("exclude", [])]:
        if clause.get("class") not in SHAPES or clause.get("color", COLORS[0]) not in COLORS:
            raise ValueError(
                f"ShapesEval cannot score clause {clause} of {metadata.get('prompt')!r}: classes are "
                f"{SHAPES} and colours {COLORS}; the shapes_geneval reward only scores ShapesEval prompts."
            )


def count_extra(detections: Sequence[Detection], metadata: Mapping[str, Any]) -> int:
    """Return the number of detected objects beyond those the ``include`` clauses request.

    Args:
        detections: Objects found in one image.
        metadata: Its GenEval dict.

    Returns:
        ``Σ_shape max(0, found − requested)``.
    """
    requested: Counter[str] = Counter()
    for clause in metadata["include"]:
        requested[clause["class"]] += int(clause["count"])
    found = Counter(d.label for d in detections)
    return sum(max(0, n - requested[label]) for label, n in found.items())


@dataclass(frozen=True)
class ObjectCredit:
    """Credit of one requested object by how well its matched detection fits it.

    Attributes:
        exact: Right shape and colour (or right shape where no colour is asked).
        wrong_color: Right shape, another colour.
        wrong_shape: An object drawn where one was asked, of another shape.
    """

    exact: float = 1.0
    wrong_color: float = 0.5
    wrong_shape: float = 0.5


def _fit(want: tuple[str, str | None], det: Detection) -> int:
    """How well a detection fits a requested ``(shape, colour)``: 0 exactly, 1 right shape, 2 not."""
    if det.label != want[0]:
        return 2
    return 0 if want[1] in (None, getattr(det, "color", "")) else 1


def _match_slots(
    slots: list[tuple[str, str | None]], detections: Sequence[Detection], credit: ObjectCredit
) -> tuple[list[float], list[Detection]]:
    """Assign detections to requested ``(shape, colour)`` slots, best fits first.

    Returns:
        The credit each slot earned, and the detections left unmatched.
    """
    free = list(detections)
    paid = [0.0] * len(slots)
    open_slots = list(range(len(slots)))
    for tier, value in enumerate((credit.exact, credit.wrong_color, credit.wrong_shape)):
        for i in list(open_slots):
            det = next((d for d in free if _fit(slots[i], d) <= tier), None)
            if det is not None:
                paid[i] = value
                free.remove(det)
                open_slots.remove(i)
    return paid, free


def object_credit(
    detections: Sequence[Detection],
    metadata: Mapping[str, Any],
    credit: ObjectCredit = ObjectCredit(),
    position_margin: float = 0.1,
) -> tuple[float, int]:
    """Per-object credit: every requested object scored by the detection matched to it.

    The ``include`` clauses expand to one slot per requested object (``count`` slots of a clause).
    Detections fill slots in three passes — exact fits, then right shape in another colour, then any
    object — each paying its :class:`ObjectCredit`; a slot left empty pays 0. Each relation
    (``position``) adds one term, 1 when every object of its shape stands in the relation to every
    object of the target's shape (GenEval's rule), else 0. The credit is the mean of those terms.

    Unlike GenEval's partial credit, where a wrong second object zeroes its clause's count term and so
    scores below leaving it out, an object drawn where one was asked always pays something, so the
    count and the layout are rewarded before the shapes are right. Only a strictly correct image
    scores 1. ``exclude`` clauses are not read: every object beyond the requested ones is unmatched.

    Args:
        detections: Objects found in one image.
        metadata: Its ShapesEval GenEval dict.
        credit: The value of each kind of match.
        position_margin: GenEval's position margin.

    Returns:
        ``(credit in [0, 1], detections matched to no requested object)``.
    """
    slots = [(c["class"], c.get("color")) for c in metadata["include"] for _ in range(int(c["count"]))]
    paid, unmatched = _match_slots(slots, detections, credit)
    terms = list(paid)
    clauses = metadata["include"]
    for clause in clauses:
        if "position" in clause:
            relation, target = clause["position"]
            placed = [d for d in detections if d.label == clause["class"]]
            anchors = [d for d in detections if d.label == clauses[target]["class"]]
            holds = bool(placed and anchors) and position_holds(placed, anchors, relation, position_margin)
            terms.append(float(holds))
    return (sum(terms) / len(terms) if terms else 0.0), len(unmatched)


def _detected_colors(objects: Sequence[Detection], classname: str) -> list[str]:
    """GenEval colour function reading :attr:`ShapeDetection.color`."""
    return [str(getattr(obj, "color", "")) for obj in objects]


def score_detections(
    detections: Sequence[Detection],
    metadata: Mapping[str, Any],
    thresholds: GenEvalThresholds = GenEvalThresholds(),
    position_credit: str = "strict",
    credit: ObjectCredit = ObjectCredit(),
) -> ShapesResult:
    """Score one image's detections against its GenEval metadata.

    Args:
        detections: :class:`~rlgen_cli.shapes.detect.ShapeDetection` objects of one image.
        metadata: GenEval dict over ShapesEval shapes and colours.
        thresholds: GenEval settings (position margin 0.1; detections have confidence 1).
        position_credit: Partial-credit terms of a failed position (:func:`score_geneval`); ShapesEval
            pays it a single 0 (``strict``).
        credit: Values of :func:`object_credit`'s matches.

    Returns:
        GenEval metrics plus strict accuracy, extra objects and per-object credit.

    Raises:
        ValueError: If the metadata is not ShapesEval metadata.
    """
    check_metadata(metadata)
    base = score_geneval(detections, metadata, _detected_colors, thresholds, position_credit=position_credit)
    n_extra = count_extra(detections, metadata)
    objects, n_surplus = object_credit(detections, metadata, credit, thresholds.position_margin)
    reasons = list(base.reasons) + ([f"{n_extra} unrequested object(s)"] if n_extra else [])
    return ShapesResult(
        tag=base.tag,
        score=base.score,
        accuracy=base.accuracy,
        strict=base.strict and n_extra == 0,
        reasons=reasons,
        geneval_strict=base.strict,
        n_extra=n_extra,
        n_objects=len(detections),
        objects=objects,
        n_surplus=n_surplus,
    )


def score_images(
    images: Tensor,
    metadata: Sequence[Mapping[str, Any]],
    detector: ShapeDetector | None = None,
    thresholds: GenEvalThresholds = GenEvalThresholds(),
    position_credit: str = "strict",
    credit: ObjectCredit = ObjectCredit(),
) -> list[ShapesResult]:
    """Detect and score a batch of images.

    Args:
        images: ``(B, 3, H, W)`` in [0, 1].
        metadata: B GenEval dicts.
        detector: Default :class:`ShapeDetector` ``()``.
        thresholds: GenEval settings.
        position_credit: See :func:`score_detections`.
        credit: See :func:`score_detections`.

    Returns:
        One result per image.

    Raises:
        ValueError: On mismatched lengths, bad images or non-ShapesEval metadata.
    """
    if images.shape[0] != len(metadata):
        raise ValueError(
            f"got {images.shape[0]} images but {len(metadata)} metadata dicts; pass one per image."
        )
    found = (detector or ShapeDetector()).detect(images)
    return [
        score_detections(d, meta, thresholds, position_credit, credit) for d, meta in zip(found, metadata)
    ]


def summarise_results(results: Sequence[ShapesResult]) -> dict[str, dict[str, float]]:
    """Average every :data:`METRICS` entry per tag, plus ``overall`` = mean of the tag means.

    Args:
        results: Per-image results.

    Returns:
        ``{metric: {tag: mean, …, "overall": mean}}``; tags absent from ``results`` are absent.
    """
    return {name: summarise(results, key=attr) for name, attr in METRICS.items()}


def format_summary(summary: Mapping[str, Mapping[str, float]]) -> str:
    """Render :func:`summarise_results` output as a plain-text table, one row per tag.

    Args:
        summary: ``{metric: {tag: value}}``.

    Returns:
        The table, rows in :data:`~rlgen_cli.shapes.vocab.TAGS` order then ``overall``.
    """
    metrics = list(summary)
    present = {tag for values in summary.values() for tag in values}
    rows = [t for t in (*TAGS, "overall") if t in present]
    lines = [f"{'tag':<14}" + "".join(f"{m:>15}" for m in metrics)]
    for tag in rows:
        cells = "".join(f"{summary[m].get(tag, float('nan')):>15.3f}" for m in metrics)
        lines.append(f"{tag:<14}{cells}")
    return "\n".join(lines)
