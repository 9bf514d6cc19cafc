"""GenEval reward: object detection + CLIP colour check against GenEval metadata.

GenEval (Ghosh et al. 2023, "GenEval: An Object-Focused Framework for Evaluating Text-to-Image
Alignment") checks each image against structured metadata (``include``/``exclude`` clauses with class,
count, colour, relative position). :mod:`rlgen_cli.rewards.geneval_detect` finds the objects (a
transformers Mask2Former with instance masks, as the original, or any box detector),
:mod:`rlgen_cli.rewards.geneval_colour` names their colours (CLIP zero-shot on the instance pasted on
grey, or on the box crop), and :mod:`rlgen_cli.geneval_rules` scores them (``score``, ``accuracy``,
``strict``; thresholds and position credit are documented there).

Comparable with published GenEval numbers: a Mask2Former COCO-instance detector
(``facebook/mask2former-swin-small-coco-instance``: the original's Swin-S architecture, FAIR's weights
rather than mmdetection's), ``colour_crop=mask`` and CLIP ViT-L/14 (``openai/clip-vit-large-patch14``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from PIL import Image

from rlgen_cli.geneval_rules import Detection, GenEvalThresholds, check_position_credit, score_geneval
from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.checkpoints import typed_kwargs
from rlgen_cli.rewards.geneval_colour import (
    COLORS,
    CLIPColorClassifier,
    ColorClassifier,
    ColourCrop,
    check_colour_crop,
    crop_object,
)
from rlgen_cli.rewards.geneval_detect import Detector, TransformersDetector
from rlgen_cli.rewards.registry import register
from rlgen_cli.rewards.requirements import ModelSource

logger = logging.getLogger(__name__)

__all__ = [
    "COLORS", "CLIPColorClassifier", "ColorClassifier", "Detector", "GenEvalKwargs", "GenEvalReward",
    "TransformersDetector", "crop_object", "geneval",
]  # fmt: skip


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

    reads_prompts = False  # the objects its metadata asks for, not the prompt text

    def __init__(
        self,
        detector: Detector,
        color_classifier: ColorClassifier,
        thresholds: GenEvalThresholds = GenEvalThresholds(tie_order="upstream"),
        clamp_count_term: bool = True,
        position_credit: str = "upstream",
        name: str = "geneval",
    ) -> None:
        check_position_credit(position_credit)
        self.detector, self.color_classifier = detector, color_classifier
        self.thresholds, self.clamp_count_term, self.name = thresholds, clamp_count_term, name
        self.position_credit = position_credit

    def requirements(self) -> list[ModelSource]:
        """The detector and the colour CLIP the first score loads (``rewards/requirements.py``)."""
        parts = (("detector_path", self.detector), ("clip_path", self.color_classifier))
        return [
            ModelSource(f"reward.kwargs.{self.name}.{key}", part.path, local_files_only=part.local_files_only)
            for key, part in parts
            if isinstance(getattr(part, "path", None), str)  # a stand-in detector (tests) reads no files
        ]

    def load(self) -> None:
        """Load the detector and the colour CLIP now rather than on the first score (a reward server)."""
        for part in (self.detector, self.color_classifier):
            if hasattr(part, "_load"):
                part._load()

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


@dataclass(frozen=True)
class GenEvalKwargs:
    """``reward.kwargs.geneval``.

    Attributes:
        detector_path: Local dir or hub id of a COCO detector: Mask2Former instance segmentation (masks) or
            any ``AutoModelForObjectDetection`` (boxes). Required.
        clip_path: Local dir or hub id of a CLIP checkpoint (GenEval uses ViT-L/14). Required.
        colour_crop: ``mask`` (the instance on grey, as the original; needs masks) or ``box``.
        local_files_only: Never reach the hub.
        device: Torch device for both models; ``None`` = cuda if available, else cpu.
        threshold, counting_threshold, max_objects, position_margin: See :class:`GenEvalThresholds`.
        clamp_count_term: Floor the count term at 0 (see :func:`score_geneval`).
        label_aliases: Detector label -> GenEval class overrides.
        batch_size: Images per detector forward pass.
        position_credit: ``upstream`` or ``strict`` terms for a failed position (see :func:`score_geneval`).
        tie_order: Detections of equal score: ``upstream`` (later-listed first, as GenEval) or ``listed``
            (see :class:`GenEvalThresholds`).
    """

    detector_path: str | None = None
    clip_path: str | None = None
    colour_crop: Annotated[str, ColourCrop] = "mask"
    local_files_only: bool = False
    device: str | None = "cpu"
    threshold: float = 0.3
    counting_threshold: float = 0.9
    max_objects: int = 16
    position_margin: float = 0.1
    clamp_count_term: bool = True
    label_aliases: dict[str, str] | None = None
    batch_size: int = 8
    position_credit: str = "upstream"
    tie_order: str = "upstream"


@register("geneval", kwargs=GenEvalKwargs)
def geneval(**kwargs: Any) -> GenEvalReward:
    """Build the GenEval reward over a transformers detector and a CLIP colour classifier.

    Args:
        **kwargs: As :class:`GenEvalKwargs`.

    Returns:
        The reward; the models load on first use.

    Raises:
        ValueError: On an unknown kwarg, a missing model path, or an unknown ``position_credit`` or
            ``colour_crop``.
    """
    args = typed_kwargs(GenEvalKwargs, "geneval", kwargs)
    check_position_credit(args.position_credit)
    check_colour_crop(args.colour_crop)
    unset = [key for key in ("detector_path", "clip_path") if not getattr(args, key)]
    if unset:  # both named at once: a user fixes them in one go
        raise ValueError(
            f"reward 'geneval' needs {' and '.join(unset)}: set "
            f"{' '.join(f'reward.kwargs.geneval.{key}=<local dir or hub id>' for key in unset)} (a COCO "
            "Mask2Former or object detector for detector_path, a CLIP one for clip_path)."
        )
    thresholds = GenEvalThresholds(
        args.threshold, args.counting_threshold, args.max_objects, args.position_margin, args.tie_order
    )
    min_threshold = min(args.threshold, args.counting_threshold)
    detector = TransformersDetector(
        str(args.detector_path),
        args.device,
        args.local_files_only,
        min_threshold,
        args.label_aliases,
        args.batch_size,
    )
    colors = CLIPColorClassifier(str(args.clip_path), args.device, args.local_files_only, args.colour_crop)
    return GenEvalReward(detector, colors, thresholds, args.clamp_count_term, args.position_credit)
