"""OCR rewards: does the image (or video) show the text the prompt asks for?

Text is read with PP-OCR (Du et al. 2020, "PP-OCR: A Practical Ultra Lightweight OCR System") through
``rapidocr_onnxruntime``, whose wheel ships the ONNX detection/recognition models, so this works
offline. As in Flow-GRPO (docs/maths.md §11): the target is the text between the first pair of ``"`` in the
prompt; both strings are lower-cased with whitespace removed; the score is 1 if the target is a
substring of the recognised text, else ``1 − min(Levenshtein, len(target)) / len(target)``.

The text detector's side limit is set to each image's shorter side, so images are read at their own
resolution; the package default upsamples the shorter side to 736 px (≈ 0.24 s vs 0.08 s per 256-px
image on 2 CPU cores).
``video_ocr`` scores every 4th frame and averages. Lines below ``text_score`` confidence are dropped
(PP-OCR's 0.5; Flow-GRPO keeps every line).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.registry import register
from rlgen_cli.rewards.requirements import Package

logger = logging.getLogger(__name__)

__all__ = ["OcrReward", "extract_target", "levenshtein", "normalise_text", "ocr", "ocr_score", "video_ocr"]

TARGET_MODES = ("quoted", "whole_prompt")
VIDEO_FRAME_STRIDE = 4


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1) between two strings.

    Args:
        a: First string.
        b: Second string.

    Returns:
        The minimum number of single-character edits turning ``a`` into ``b``.
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def normalise_text(text: str) -> str:
    """Lower-case and drop all whitespace (the comparison form of both target and OCR output)."""
    return "".join(text.lower().split())


def ocr_score(recognised: str, target: str) -> float:
    """Score recognised text against the target.

    Args:
        recognised: Text read from the image.
        target: Text the prompt asks for.

    Returns:
        1.0 if the normalised target is a substring of the normalised recognised text, otherwise
        ``1 − min(Levenshtein, len(target)) / len(target)`` on the normalised strings.

    Raises:
        ValueError: If the target is empty after normalisation.
    """
    rec, tgt = normalise_text(recognised), normalise_text(target)
    if not tgt:
        raise ValueError(f"OCR target {target!r} is empty after removing whitespace; quote a non-empty text.")
    if tgt in rec:
        return 1.0
    return 1.0 - min(levenshtein(rec, tgt), len(tgt)) / len(tgt)


def extract_target(prompt: str, mode: str = "quoted") -> str:
    """Return the text an image for ``prompt`` should show.

    Args:
        prompt: The generation prompt, e.g. ``'A sign that says "OPEN 24 HOURS"'``.
        mode: ``"quoted"``: the text between the first pair of ``"``; ``"whole_prompt"``: the prompt.

    Returns:
        The target text.

    Raises:
        ValueError: If ``mode`` is unknown, or it is ``"quoted"`` and the prompt has no pair of quotes.
    """
    if mode not in TARGET_MODES:
        raise ValueError(f"unknown OCR target mode {mode!r}; use one of {TARGET_MODES}.")
    if mode == "whole_prompt":
        return prompt
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(
            f"OCR prompt {prompt!r} has no text between a pair of double quotes; quote the text to "
            'render (e.g. a sign that says "OPEN") or set reward.kwargs.ocr.target=whole_prompt.'
        )
    return parts[1]


def _to_uint8_rgb(image: Tensor) -> np.ndarray:
    """Convert one ``(3, H, W)`` float image in [0, 1] to an ``(H, W, 3)`` uint8 RGB array."""
    pixels = (image.detach().to(device="cpu", dtype=torch.float32).clamp(0, 1) * 255.0).round()
    return np.ascontiguousarray(pixels.to(torch.uint8).permute(1, 2, 0).numpy())


class OcrReward:
    """OCR reward over images ``(B, 3, H, W)`` or videos ``(B, 3, F, H, W)``.

    Args:
        name: Registry name.
        target: How the target text is taken from the prompt (see :func:`extract_target`).
        frame_stride: For videos, score every ``frame_stride``-th frame and average.
        text_score: Minimum recognition confidence of a text line (PP-OCR's default 0.5).
        use_cls: Run PP-OCR's text-orientation classifier (Flow-GRPO does not).
        det_limit_side_len: Detector side limit; ``None`` = each image's shorter side (native size).
        engine_kwargs: Extra ``RapidOCR(**kwargs)`` settings.
    """

    def __init__(
        self,
        name: str = "ocr",
        target: str = "quoted",
        frame_stride: int = 1,
        text_score: float = 0.5,
        use_cls: bool = False,
        det_limit_side_len: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if target not in TARGET_MODES:
            raise ValueError(f"unknown OCR target mode {target!r}; use one of {TARGET_MODES}.")
        if frame_stride < 1:
            raise ValueError(f"frame_stride must be ≥ 1, got {frame_stride}.")
        self.name, self.target, self.frame_stride = name, target, frame_stride
        self.text_score, self.use_cls, self.det_limit_side_len = text_score, use_cls, det_limit_side_len
        self.engine_kwargs = dict(engine_kwargs or {})
        self._engine: Any = None

    @property
    def engine(self) -> Any:
        """The ``RapidOCR`` engine, created on first use."""
        if self._engine is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as err:
                raise ImportError(
                    f"reward {self.name!r} needs rapidocr-onnxruntime: pip install rapidocr-onnxruntime"
                ) from err
            kwargs = {"text_score": self.text_score, "det_limit_type": "min", **self.engine_kwargs}
            if self.det_limit_side_len is not None:
                kwargs["det_limit_side_len"] = self.det_limit_side_len
            logger.info("creating the PP-OCR engine (rapidocr_onnxruntime) with %s", kwargs)
            self._engine = RapidOCR(**kwargs)
        return self._engine

    def requirements(self) -> list[Package]:
        """The OCR engine's package (its models ship inside it; ``rewards/requirements.py``)."""
        return [Package(f"reward {self.name!r}", "rapidocr_onnxruntime", "pip install rapidocr-onnxruntime")]

    def load(self) -> None:
        """Create the engine now rather than on the first score (a reward server)."""
        _ = self.engine

    def read(self, image: np.ndarray) -> str:
        """Return all text PP-OCR reads in an ``(H, W, 3)`` uint8 RGB image, lines concatenated.

        Args:
            image: The image.

        Returns:
            Recognised lines in reading order, joined without separator ("" when nothing is found).
        """
        engine = self.engine
        if self.det_limit_side_len is None:
            engine.text_det.limit_side_len = min(image.shape[:2])  # read at native resolution
        # rapidocr treats arrays as OpenCV BGR; reverse the channels.
        lines, _ = engine(np.ascontiguousarray(image[:, :, ::-1]), use_cls=self.use_cls)
        return "".join(str(line[1]) for line in lines or [])

    def _score_frame(self, frame: Tensor, target: str, prompt: str) -> float:
        """OCR one ``(3, H, W)`` frame; NaN (logged) if the engine fails on it."""
        try:
            return ocr_score(self.read(_to_uint8_rgb(frame)), target)
        except Exception:  # an engine failure on one sample must not end the run
            logger.warning(
                "reward %r: OCR failed for prompt %r; scoring NaN", self.name, prompt, exc_info=True
            )
            return math.nan

    def _frames(self, sample: Tensor) -> list[Tensor]:
        """The frames to read: the image itself, or every ``frame_stride``-th frame of a video."""
        return [sample] if sample.ndim == 3 else list(sample[:, :: self.frame_stride].unbind(dim=1))

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score every image or video of ``batch``.

        Args:
            batch: ``images`` ``(B, 3, H, W)`` or ``(B, 3, F, H, W)`` in [0, 1] and their prompts.

        Returns:
            ``scores`` (float32, NaN where OCR failed) and ``details["ocr_target"]`` (list of str).

        Raises:
            ValueError: If images are missing or misshaped, or a prompt has no target text.
        """
        images = batch.images
        if images is None or images.ndim not in (4, 5) or images.shape[1] != 3:
            shape = None if images is None else tuple(images.shape)
            raise ValueError(
                f"reward {self.name!r} needs RGB images (B, 3, H, W) or videos (B, 3, F, H, W), got {shape}."
            )
        targets = [extract_target(prompt, self.target) for prompt in batch.prompts]
        for target in targets:
            if not normalise_text(target):
                raise ValueError(
                    f"reward {self.name!r}: empty OCR target {target!r}; quote a non-empty text."
                )
        scores = []
        for sample, target, prompt in zip(images, targets, batch.prompts):
            frame_scores = [self._score_frame(frame, target, prompt) for frame in self._frames(sample)]
            scores.append(sum(frame_scores) / len(frame_scores))
        return RewardResult(scores=torch.tensor(scores, dtype=torch.float32), details={"ocr_target": targets})


@dataclass
class OcrKwargs:
    """``reward.kwargs.ocr`` (args as :class:`OcrReward`)."""

    target: str = "quoted"
    text_score: float = 0.5
    use_cls: bool = False
    det_limit_side_len: int | None = None
    engine_kwargs: dict[str, Any] | None = None


@dataclass
class VideoOcrKwargs(OcrKwargs):
    """``reward.kwargs.video_ocr``: :class:`OcrKwargs` plus the frame stride."""

    frame_stride: int = VIDEO_FRAME_STRIDE


@register("ocr", kwargs=OcrKwargs)
def ocr(
    target: str = "quoted",
    text_score: float = 0.5,
    use_cls: bool = False,
    det_limit_side_len: int | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> OcrReward:
    """Build the image OCR reward (arguments as in :class:`OcrReward`).

    Returns:
        The reward; the OCR engine is created on first use.
    """
    return OcrReward("ocr", target, 1, text_score, use_cls, det_limit_side_len, engine_kwargs)


@register("video_ocr", kwargs=VideoOcrKwargs)
def video_ocr(
    target: str = "quoted",
    frame_stride: int = VIDEO_FRAME_STRIDE,
    text_score: float = 0.5,
    use_cls: bool = False,
    det_limit_side_len: int | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> OcrReward:
    """Build the video OCR reward: mean score over every ``frame_stride``-th frame (default 4).

    Returns:
        The reward; the OCR engine is created on first use.
    """
    return OcrReward(
        "video_ocr", target, frame_stride, text_score, use_cls, det_limit_side_len, engine_kwargs
    )
