"""ShapesEval reward (``shapes_geneval``): the deterministic shapes detector + GenEval scoring.

Images ``(B, 3, H, W)`` in [0, 1] are read by :class:`~rlgen_cli.shapes.detect.ShapeDetector` and
scored by :func:`~rlgen_cli.shapes.score.score_detections` against their ShapesEval metadata
(:mod:`rlgen_cli.shapes.prompts`). The training signal depends on ``mode``:

* ``"objects"`` (default): per-object credit × ``exp(−extra_penalty · n_surplus)``
  (:func:`~rlgen_cli.shapes.score.object_credit`): each requested object pays 1 when drawn right, 0.5
  in another colour, ``wrong_shape_credit`` (0.5) as another shape, and each relation 1 when it holds;
  ``n_surplus`` counts the objects beyond the number requested. A wrong second object scores above a
  missing one, so the policy is paid for drawing the right number of objects before their shapes are
  right, and only a strictly correct image scores 1.
* ``"clutter"``: ``partial · exp(−extra_penalty · n_extra)``. GenEval's partial credit ignores objects
  nobody asked for, so a policy trained on it learns to draw clutter (dozens of blobs satisfy "a photo
  of a circle"); the penalty makes each unrequested object cost ≈ 40 % (0.5). A wrong second object
  zeroes its clause and counts as extra, so leaving it out scores more than attempting it.
* ``"partial"``: plain Flow-GRPO partial credit (shows reward hacking in benchmarks).
* ``"strict"``: ShapesEval strict accuracy as 0/1.
* ``"lenient"``: GenEval's original binary accuracy as 0/1, which checks only the first ``count``
  detections of each requested class: extra copies of a requested shape and objects of other classes
  cost nothing, so drawing more shapes is paid wherever it makes the requested ones more likely.

Details (per sample): ``strict``, ``accuracy``, ``partial``, ``geneval_strict``, ``n_extra``,
``objects`` (float tensors), ``tag`` and ``reason`` (lists of str).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlgen_cli.geneval_rules import GenEvalThresholds, check_position_credit
from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.registry import register
from rlgen_cli.shapes.detect import ShapeDetector
from rlgen_cli.shapes.score import ObjectCredit, ShapesResult, score_images

logger = logging.getLogger(__name__)

__all__ = ["MODES", "ShapesGenEvalReward", "clutter_score", "shapes_geneval"]

MODES = ("objects", "clutter", "partial", "strict", "lenient")


def clutter_score(partial: float, n_extra: int, extra_penalty: float = 0.5) -> float:
    """Return partial credit discounted per unrequested object: ``partial · exp(−penalty · n_extra)``.

    Args:
        partial: GenEval partial credit in [0, 1].
        n_extra: Unrequested objects in the image.
        extra_penalty: Log-discount per extra object.

    Returns:
        The discounted score.
    """
    return partial * math.exp(-extra_penalty * n_extra)


class ShapesGenEvalReward:
    """ShapesEval scoring as a :class:`~rlgen_cli.rewards.base.Reward` (see the module docstring).

    Attributes:
        name: Registry name.
        mode: One of :data:`MODES`.
        extra_penalty: Log-discount per extra object in ``"objects"`` and ``"clutter"`` modes.
        detector: The shapes detector.
        thresholds: GenEval settings (only the position margin matters: detections have confidence 1).
        position_credit: Partial-credit terms of a failed position (``strict``: one 0; ``upstream``: the
            GenEval server's 0 and 1).
        credit: Values of the per-object matches (``"objects"`` mode).
    """

    reads_prompts = False  # the objects its metadata asks for, not the prompt text

    def __init__(
        self,
        mode: str = "objects",
        extra_penalty: float = 0.5,
        detector: ShapeDetector | None = None,
        thresholds: GenEvalThresholds = GenEvalThresholds(),
        name: str = "shapes_geneval",
        position_credit: str = "strict",
        credit: ObjectCredit = ObjectCredit(),
    ) -> None:
        """Create the reward.

        Raises:
            ValueError: On an unknown mode or a negative penalty.
        """
        if mode not in MODES:
            raise ValueError(f"reward {name!r}: mode must be one of {MODES}, got {mode!r}.")
        if extra_penalty < 0:
            raise ValueError(f"reward {name!r}: extra_penalty must be ≥ 0, got {extra_penalty}.")
        self.name, self.mode, self.extra_penalty = name, mode, extra_penalty
        self.detector = detector or ShapeDetector()
        self.thresholds = thresholds
        check_position_credit(position_credit)
        self.position_credit = position_credit
        self.credit = credit

    def _check(self, batch: RewardBatch) -> tuple[Tensor, list[dict]]:
        """Return the batch's images and metadata; raise a ValueError unless both are usable."""
        images = batch.images
        if images is None or images.ndim != 4 or images.shape[1] != 3:
            shape = None if images is None else tuple(images.shape)
            raise ValueError(
                f"reward {self.name!r} needs RGB images (B, 3, H, W) in [0, 1], got {shape}; "
                "videos are not supported."
            )
        if batch.metadata is None:
            raise ValueError(
                f"reward {self.name!r} needs RewardBatch.metadata (GenEval dicts); train on the "
                "ShapesEval prompt files (data=shapes)."
            )
        return images, batch.metadata

    def _value(self, result: ShapesResult) -> float:
        """The training signal of one image under :attr:`mode`."""
        if self.mode == "partial":
            return result.score
        if self.mode == "strict":
            return float(result.strict)
        if self.mode == "lenient":
            return float(result.accuracy)
        if self.mode == "clutter":
            return clutter_score(result.score, result.n_extra, self.extra_penalty)
        return clutter_score(result.objects, result.n_surplus, self.extra_penalty)

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score images against their ShapesEval metadata.

        Args:
            batch: ``images (B, 3, H, W)`` in [0, 1] and ``metadata`` (GenEval dicts), length B.

        Returns:
            ``scores`` per :attr:`mode`; details as in the module docstring.

        Raises:
            ValueError: If images or metadata are missing or malformed, or metadata is not ShapesEval.
        """
        images, metadata = self._check(batch)
        results = score_images(
            images, metadata, self.detector, self.thresholds, self.position_credit, self.credit
        )

        def column(key: str) -> torch.Tensor:
            return torch.tensor([float(getattr(r, key)) for r in results], dtype=torch.float32)

        return RewardResult(
            scores=torch.tensor([self._value(r) for r in results], dtype=torch.float32),
            details={
                "strict": column("strict"),
                "accuracy": column("accuracy"),
                "partial": column("score"),
                "geneval_strict": column("geneval_strict"),
                "n_extra": column("n_extra"),
                "objects": column("objects"),
                "tag": [r.tag for r in results],
                "reason": ["; ".join(r.reasons) for r in results],
            },
        )


@dataclass
class ShapesGenEvalKwargs:
    """``reward.kwargs.shapes_geneval`` (see :func:`shapes_geneval`)."""

    mode: str = "objects"
    extra_penalty: float = 0.5
    min_area: int | None = None
    position_margin: float = 0.1
    position_credit: str = "strict"
    wrong_shape_credit: float = 0.5


@register("shapes_geneval", kwargs=ShapesGenEvalKwargs)
def shapes_geneval(
    mode: str = "objects",
    extra_penalty: float = 0.5,
    min_area: int | None = None,
    position_margin: float = 0.1,
    position_credit: str = "strict",
    wrong_shape_credit: float = 0.5,
) -> ShapesGenEvalReward:
    """Build the ShapesEval reward.

    Args:
        mode: ``"objects"`` (per-object credit × exp(−extra_penalty·n_surplus)), ``"clutter"``
            (partial credit × exp(−extra_penalty·n_extra)), ``"partial"``, ``"strict"`` or ``"lenient"``
            (GenEval's binary accuracy).
        extra_penalty: Log-discount per surplus object in ``"objects"`` and ``"clutter"`` modes.
        min_area: Smallest component counted as an object; ``None`` = 8 px per 32×32 (size-scaled).
        position_margin: GenEval position margin.
        position_credit: ``strict`` (ShapesEval's) or ``upstream`` partial credit of a failed position.
        wrong_shape_credit: ``"objects"`` mode's pay for an object of another shape where one was asked.

    Returns:
        The reward (no model to load).

    Raises:
        ValueError: On an unknown mode, a negative penalty, ``min_area < 1`` or a wrong-shape credit
            outside [0, 0.5].
    """
    if not 0.0 <= wrong_shape_credit <= 0.5:
        raise ValueError(
            f"reward 'shapes_geneval': wrong_shape_credit must lie in [0, 0.5] (a right shape in the wrong "
            f"colour pays 0.5), got {wrong_shape_credit}."
        )
    thresholds = GenEvalThresholds(position_margin=position_margin)
    return ShapesGenEvalReward(
        mode,
        extra_penalty,
        ShapeDetector(min_area),
        thresholds,
        position_credit=position_credit,
        credit=ObjectCredit(wrong_shape=wrong_shape_credit),
    )
