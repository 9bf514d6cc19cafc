"""GenEval reward: object detection + CLIP colour check against GenEval metadata.

GenEval (Ghosh et al. 2023, "GenEval: An Object-Focused Framework for Evaluating Text-to-Image
Alignment") checks each image against structured metadata (``include``/``exclude`` clauses with class,
count, colour, relative position). Scoring here is pure (dataclasses in, dataclasses out) and separate
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

Thresholds: confidence > 0.3 (> 0.9 for ``counting``), at most 16 objects per class, position margin
0.1 of the summed box sizes, relations on box centres as in the original.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.registry import register

logger = logging.getLogger(__name__)

__all__ = [
    "COLORS", "POSITION_CREDITS", "TAGS", "CLIPColorClassifier", "ColorClassifier", "Detection", "Detector", "GenEvalResult",
    "GenEvalReward", "GenEvalThresholds", "TransformersDetector", "geneval", "relative_position",
    "score_geneval", "select_detections", "summarise"
]  # fmt: skip

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
POSITION_CREDITS = ("upstream", "strict")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
# Detector label spellings (HF COCO / VOC) -> GenEval class names.
DEFAULT_LABEL_ALIASES = {
    "mouse": "computer mouse", "remote": "tv remote", "keyboard": "computer keyboard", "sofa": "couch",
    "hair dryer": "hair drier", "motorbike": "motorcycle", "aeroplane": "airplane", "tvmonitor": "tv",
    "diningtable": "dining table", "pottedplant": "potted plant",
}  # fmt: skip
CROP_BACKGROUND = "#999"  # GenEval's background behind masked crops

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
    """Detection filtering and position settings of the original benchmark."""

    confidence: float = 0.3
    counting_confidence: float = 0.9
    max_objects: int = 16
    position_margin: float = 0.1


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

    Args:
        detections: All detections of one image.
        tag: GenEval tag; ``"counting"`` uses the stricter threshold.
        thresholds: Filtering settings.

    Returns:
        ``{class: detections}`` sorted by descending score, at most ``max_objects`` per class.
    """
    cutoff = thresholds.counting_confidence if tag == "counting" else thresholds.confidence
    grouped: dict[str, list[Detection]] = {}
    for det in sorted(detections, key=lambda d: d.score, reverse=True):
        kept = grouped.setdefault(det.label, [])
        if det.score > cutoff and len(kept) < thresholds.max_objects:
            kept.append(det)
    return {label: dets for label, dets in grouped.items() if dets}


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


def _position_holds(
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
            matched = _position_holds(found, groups[target], relation, margin)
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
                holds = matched and _position_holds(found, groups[target], relation, margin)
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


class Detector(Protocol):
    """Anything that finds objects: ``detect(images) -> detections per image`` (GenEval class labels)."""

    def detect(self, images: Sequence[Image.Image]) -> list[list[Detection]]: ...


class ColorClassifier(Protocol):
    """Anything that names object colours: one of :data:`COLORS` per object."""

    def classify(self, image: Image.Image, objects: Sequence[Detection], classname: str) -> list[str]: ...


def _device(device: str | None) -> torch.device:
    """Parse a device; ``None`` picks cuda when available, else cpu."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


class TransformersDetector:
    """:class:`Detector` over a transformers object-detection model (DETR, YOLOS, …), loaded lazily.

    Args:
        path: Local dir or hub id of an ``AutoModelForObjectDetection`` checkpoint and image processor.
        device: Torch device; ``None`` = cuda if available, else cpu.
        local_files_only: Never reach the hub.
        threshold: Minimum confidence kept by post-processing (scoring applies its own thresholds).
        label_aliases: Detector label -> GenEval class; default :data:`DEFAULT_LABEL_ALIASES`.
        batch_size: Images per forward pass.
    """

    def __init__(
        self,
        path: str,
        device: str | None = "cpu",
        local_files_only: bool = False,
        threshold: float = 0.3,
        label_aliases: Mapping[str, str] | None = None,
        batch_size: int = 8,
    ) -> None:
        self.path, self.device, self.local_files_only = path, _device(device), local_files_only
        self.threshold, self.batch_size = threshold, batch_size
        self.aliases = dict(DEFAULT_LABEL_ALIASES if label_aliases is None else label_aliases)
        self._model: Any = None
        self._processor: Any = None

    def _load(self) -> None:
        """Load the model and its image processor once."""
        if self._model is None:
            from transformers import AutoImageProcessor, AutoModelForObjectDetection

            logger.info("loading GenEval detector from %s", self.path)
            kwargs = {"local_files_only": self.local_files_only}
            self._processor = AutoImageProcessor.from_pretrained(self.path, **kwargs)
            model = AutoModelForObjectDetection.from_pretrained(self.path, **kwargs)
            self._model = model.to(self.device).eval()

    def _label(self, index: int) -> str:
        """Map a class index to a GenEval class name."""
        name = str(self._model.config.id2label.get(int(index), index)).strip().lower().replace("_", " ")
        return self.aliases.get(name, name)

    @torch.no_grad()
    def detect(self, images: Sequence[Image.Image]) -> list[list[Detection]]:
        """Return the detections of every RGB image, boxes in that image's pixels."""
        self._load()
        results: list[list[Detection]] = []
        for start in range(0, len(images), self.batch_size):
            chunk = list(images[start : start + self.batch_size])
            inputs = self._processor(images=chunk, return_tensors="pt").to(self.device)
            processed = self._processor.post_process_object_detection(
                self._model(**inputs),
                threshold=self.threshold,
                target_sizes=[(im.height, im.width) for im in chunk],
            )
            for item in processed:
                boxes, scores, labels = (
                    item[k].float().cpu().tolist() for k in ("boxes", "scores", "labels")
                )
                dets = [
                    Detection(self._label(c), tuple(b), float(s)) for b, s, c in zip(boxes, scores, labels)
                ]
                results.append(dets)
        return results


def crop_object(image: Image.Image, obj: Detection) -> Image.Image:
    """Crop an object as GenEval does: mask onto a grey background (if a mask exists), then box crop."""
    if obj.mask is not None:
        mask = Image.fromarray(np.asarray(obj.mask, dtype=bool).astype(np.uint8) * 255)
        image = Image.composite(image, Image.new("RGB", image.size, CROP_BACKGROUND), mask)
    x0, y0, x1, y1 = (int(round(v)) for v in obj.box)
    x0, y0 = min(max(x0, 0), image.width - 1), min(max(y0, 0), image.height - 1)
    return image.crop((x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)))


def _unit(output: Any) -> torch.Tensor:
    """L2-normalised projected features from ``get_*_features`` (tensor or output with ``pooler_output``)."""
    features = output if isinstance(output, torch.Tensor) else output.pooler_output
    return torch.nn.functional.normalize(features.float(), dim=-1)


class CLIPColorClassifier:
    """:class:`ColorClassifier` by CLIP zero-shot over :data:`COLORS`, GenEval's templates averaged.

    Args:
        path: Local dir or hub id of a ``CLIPModel`` checkpoint with its processor.
        device: Torch device; ``None`` = cuda if available, else cpu.
        local_files_only: Never reach the hub.
    """

    def __init__(self, path: str, device: str | None = "cpu", local_files_only: bool = False) -> None:
        self.path, self.device, self.local_files_only = path, _device(device), local_files_only
        self._model: Any = None
        self._processor: Any = None
        self._text: dict[str, torch.Tensor] = {}

    def _load(self) -> None:
        """Load CLIP and its processor once."""
        if self._model is None:
            from transformers import AutoProcessor, CLIPModel

            logger.info("loading GenEval colour CLIP from %s", self.path)
            kwargs = {"local_files_only": self.local_files_only}
            self._processor = AutoProcessor.from_pretrained(self.path, **kwargs)
            self._model = CLIPModel.from_pretrained(self.path, **kwargs).to(self.device).eval()

    def _class_weights(self, classname: str) -> torch.Tensor:
        """``(len(COLORS), D)`` unit text embeddings for one class, averaged over templates."""
        if classname not in self._text:
            prompts = [t.format(c=c, cls=classname) for c in COLORS for t in COLOR_TEMPLATES]
            tokens = self._processor(text=prompts, return_tensors="pt", padding=True).to(self.device)
            emb = _unit(self._model.get_text_features(**tokens)).view(len(COLORS), len(COLOR_TEMPLATES), -1)
            self._text[classname] = torch.nn.functional.normalize(emb.mean(dim=1), dim=-1)
        return self._text[classname]

    @torch.no_grad()
    def classify(self, image: Image.Image, objects: Sequence[Detection], classname: str) -> list[str]:
        """Return one colour from :data:`COLORS` per object (boxes/masks index into ``image``)."""
        if not objects:
            return []
        self._load()
        crops = [crop_object(image, obj) for obj in objects]
        pixels = self._processor(images=crops, return_tensors="pt").to(self.device)
        feats = _unit(self._model.get_image_features(**pixels))
        best = (feats @ self._class_weights(classname).T).argmax(dim=-1)
        return [COLORS[int(i)] for i in best]


def _to_pil(images: torch.Tensor) -> list[Image.Image]:
    """Convert ``(B, 3, H, W)`` floats in [0, 1] to RGB PIL images."""
    pixels = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    return [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in pixels]


class GenEvalReward:
    """GenEval partial credit as a :class:`~rlgen_cli.rewards.base.Reward`.

    Args:
        detector: Finds objects.
        color_classifier: Names colours.
        thresholds: Detection filtering and position settings.
        clamp_count_term: See :func:`score_geneval`.
        position_credit: See :func:`score_geneval`.
        name: Registry name.
    """

    def __init__(
        self,
        detector: Detector,
        color_classifier: ColorClassifier,
        thresholds: GenEvalThresholds = GenEvalThresholds(),
        clamp_count_term: bool = True,
        position_credit: str = "upstream",
        name: str = "geneval",
    ) -> None:
        check_position_credit(position_credit)
        self.detector, self.color_classifier = detector, color_classifier
        self.thresholds, self.clamp_count_term, self.name = thresholds, clamp_count_term, name
        self.position_credit = position_credit

    def _check(self, batch: RewardBatch) -> None:
        """Raise a ValueError unless the batch has RGB images and GenEval metadata."""
        images = batch.images
        if images is None or images.ndim != 4 or images.shape[1] != 3:
            shape = None if images is None else tuple(images.shape)
            raise ValueError(
                f"reward {self.name!r} needs RGB images (B, 3, H, W), got {shape}; videos are not supported."
            )
        if batch.metadata is None:
            raise ValueError(
                f"reward {self.name!r} needs RewardBatch.metadata (GenEval dicts); "
                "train on a GenEval .jsonl prompt file."
            )

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score images against their GenEval metadata.

        Args:
            batch: ``images (B, 3, H, W)`` in [0, 1] and ``metadata`` (GenEval dicts), length B.

        Returns:
            ``scores`` = partial credit; ``details``: ``accuracy`` and ``strict`` (float 0/1 tensors),
            ``tag`` and ``reason`` (lists of str).

        Raises:
            ValueError: If images or metadata are missing or images are not ``(B, 3, H, W)``.
        """
        self._check(batch)
        images = _to_pil(batch.images)
        results = []
        for image, dets, meta in zip(images, self.detector.detect(images), batch.metadata):

            def colors(objs: Sequence[Detection], cls: str, image: Image.Image = image) -> list[str]:
                return self.color_classifier.classify(image, objs, cls)

            results.append(
                score_geneval(
                    dets, meta, colors, self.thresholds, self.clamp_count_term, self.position_credit
                )
            )
        return RewardResult(
            scores=torch.tensor([r.score for r in results], dtype=torch.float32),
            details={
                "accuracy": torch.tensor([float(r.accuracy) for r in results]),
                "strict": torch.tensor([float(r.strict) for r in results]),
                "tag": [r.tag for r in results],
                "reason": ["; ".join(r.reasons) for r in results],
            },
        )


@register("geneval")
def geneval(
    detector_path: str | None = None,
    clip_path: str | None = None,
    local_files_only: bool = False,
    device: str | None = "cpu",
    threshold: float = 0.3,
    counting_threshold: float = 0.9,
    max_objects: int = 16,
    position_margin: float = 0.1,
    clamp_count_term: bool = True,
    label_aliases: Mapping[str, str] | None = None,
    batch_size: int = 8,
    position_credit: str = "upstream",
) -> GenEvalReward:
    """Build the GenEval reward over a transformers detector and a CLIP colour classifier.

    Args:
        detector_path: Local dir or hub id of an object-detection checkpoint with COCO classes.
        clip_path: Local dir or hub id of a CLIP checkpoint (GenEval uses ViT-L/14).
        local_files_only: Never reach the hub.
        device: Torch device for both models; ``None`` = cuda if available, else cpu.
        threshold, counting_threshold, max_objects, position_margin: See :class:`GenEvalThresholds`.
        clamp_count_term: Floor the count term at 0 (see :func:`score_geneval`).
        label_aliases: Detector label -> GenEval class overrides.
        batch_size: Images per detector forward pass.
        position_credit: ``upstream`` or ``strict`` terms for a failed position (see :func:`score_geneval`).

    Returns:
        The reward; the models load on first use.

    Raises:
        ValueError: If a model path is missing or ``position_credit`` is unknown.
    """
    check_position_credit(position_credit)
    for key, value in (("detector_path", detector_path), ("clip_path", clip_path)):
        if not value:
            raise ValueError(
                f"reward 'geneval' needs {key}: set reward.kwargs.geneval.{key}=<local dir or hub id> "
                "(an AutoModelForObjectDetection checkpoint for detector_path, a CLIP one for clip_path)."
            )
    thresholds = GenEvalThresholds(threshold, counting_threshold, max_objects, position_margin)
    min_threshold = min(threshold, counting_threshold)
    detector = TransformersDetector(
        str(detector_path), device, local_files_only, min_threshold, label_aliases, batch_size
    )
    colors = CLIPColorClassifier(str(clip_path), device, local_files_only)
    return GenEvalReward(detector, colors, thresholds, clamp_count_term, position_credit)
