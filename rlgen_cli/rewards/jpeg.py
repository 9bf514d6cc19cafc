"""JPEG (in)compressibility rewards, as in DDPO and Flow-GRPO.

Each image is quantised to uint8 (``round(x·255)``, clamped to [0, 255]) and saved with PIL as JPEG at
quality 95; its size in kB (``bytes / 1000``) gives the score ``−kB/500`` (``jpeg_compressibility``)
or ``+kB/500`` (``jpeg_incompressibility``). Videos ``(B, C, F, H, W)`` score the mean size over frames.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from rlgen_cli.rewards.base import RewardBatch, RewardResult, all_finite
from rlgen_cli.rewards.registry import register

logger = logging.getLogger(__name__)

__all__ = [
    "READABLE", "JpegKwargs", "JpegReward", "ReadableDetail", "jpeg_compressibility", "jpeg_incompressibility",
    "jpeg_size_kb",
]  # fmt: skip

KB_SCALE = 500.0  # upstream divides the size in kB by 500


class ReadableDetail(NamedTuple):
    """A detail a reward logs that reads better than its score (−0.00299 is a 1.5 kB image): console
    lines and plot axes show it (``training/reporting/labels.py``)."""

    detail: str
    """The key of the reward's ``details``, logged as ``[eval/]reward/<reward>/<detail>/mean``."""
    unit: str
    """Written after the value on a console line."""
    axis: str
    """A plot axis's title."""


JPEG_SIZE = ReadableDetail("jpeg_kb", "kB/img", "JPEG size (kB per image)")
READABLE = {"jpeg_compressibility": JPEG_SIZE, "jpeg_incompressibility": JPEG_SIZE}
"""Reward name → the detail shown in place of (plots) or beside (console) its score."""


def _to_uint8_hwc(image: Tensor) -> np.ndarray:
    """Quantise one ``(C, H, W)`` float image in [0, 1] (uint8 passes as is) to an ``(H, W, C)`` uint8 array.

    Args:
        image: One image, ``C`` in {1, 3}.

    Returns:
        ``(H, W, C)`` uint8 array (``(H, W)`` for one channel).
    """
    pixels = image.detach().cpu()
    if pixels.dtype != torch.uint8:
        pixels = (pixels.to(torch.float32) * 255.0).round().clamp(0, 255).to(torch.uint8)
    array = pixels.permute(1, 2, 0).numpy()
    return array[:, :, 0] if array.shape[2] == 1 else array


def jpeg_size_kb(image: Tensor, quality: int = 95) -> float:
    """Return the JPEG size of one image in kB (``bytes / 1000``).

    Args:
        image: ``(C, H, W)`` float image in [0, 1] or uint8 pixels, ``C`` in {1, 3}.
        quality: PIL JPEG quality.

    Returns:
        Encoded size in kB.
    """
    buffer = io.BytesIO()
    Image.fromarray(_to_uint8_hwc(image)).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


def _check_images(images: Tensor | None, reward_name: str) -> Tensor:
    """Check that a batch carries finite 1- or 3-channel images or videos.

    Args:
        images: ``RewardBatch.images``.
        reward_name: Used in errors.

    Returns:
        The images, unchanged.

    Raises:
        ValueError: If images are missing, have the wrong rank or channel count, or are not finite.
    """
    if images is None:
        raise ValueError(
            f"reward {reward_name!r} scores images but RewardBatch.images is None; "
            "decode the samples to images before scoring."
        )
    if images.ndim not in (4, 5) or images.shape[1] not in (1, 3):
        raise ValueError(
            f"reward {reward_name!r} expects images (B, C, H, W) or videos (B, C, F, H, W) with C in "
            f"{{1, 3}}, got shape {tuple(images.shape)}; move the channel axis to dim 1."
        )
    if not all_finite(images):
        raise ValueError(f"reward {reward_name!r} got non-finite pixel values; check the decoder output.")
    return images


class JpegReward:
    """Score images by their JPEG size: ``sign · kB / 500``.

    Attributes:
        name: Registry name.
        sign: ``-1.0`` rewards small files (compressibility), ``+1.0`` large ones.
        quality: PIL JPEG quality used for encoding.
    """

    accepts_uint8 = True  # it quantises to uint8 first: served uint8 pixels skip the float round trip
    reads_prompts = False  # the file size alone

    def __init__(self, name: str, sign: float, quality: int = 95) -> None:
        """Create the reward.

        Args:
            name: Registry name, used in logs and errors.
            sign: ``-1.0`` or ``+1.0``.
            quality: JPEG quality in [1, 100].

        Raises:
            ValueError: If ``quality`` is out of range.
        """
        if not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality must be in [1, 100], got {quality}; upstream uses 95.")
        self.name = name
        self.sign = sign
        self.quality = quality

    def _sample_kb(self, sample: Tensor) -> float:
        """Return the JPEG size of an image ``(C, H, W)``, or the frame mean of a video ``(C, F, H, W)``."""
        if sample.ndim == 3:
            return jpeg_size_kb(sample, self.quality)
        frames = sample.unbind(dim=1)
        return sum(jpeg_size_kb(frame, self.quality) for frame in frames) / len(frames)

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score every image (or video) of ``batch``.

        Args:
            batch: Batch with ``images`` ``(B, C, H, W)`` or ``(B, C, F, H, W)`` in [0, 1] (or uint8).

        Returns:
            ``scores = sign · kB / 500`` (float32) and ``details["jpeg_kb"]`` (float32 sizes).

        Raises:
            ValueError: If the batch has no usable images.
        """
        images = _check_images(batch.images, self.name)
        sizes = torch.tensor([self._sample_kb(sample) for sample in images], dtype=torch.float64)
        scores = (self.sign * sizes / KB_SCALE).to(torch.float32)
        return RewardResult(scores=scores, details={"jpeg_kb": sizes.to(torch.float32)})


@dataclass
class JpegKwargs:
    """``reward.kwargs.jpeg_compressibility`` / ``jpeg_incompressibility``."""

    quality: int = 95
    """JPEG quality of the encoding whose size is scored."""


@register("jpeg_compressibility", kwargs=JpegKwargs)
def jpeg_compressibility(quality: int = 95) -> JpegReward:
    """Build the reward ``−kB/500`` (smaller JPEG files score higher).

    Args:
        quality: JPEG quality.

    Returns:
        The reward.
    """
    return JpegReward("jpeg_compressibility", sign=-1.0, quality=quality)


@register("jpeg_incompressibility", kwargs=JpegKwargs)
def jpeg_incompressibility(quality: int = 95) -> JpegReward:
    """Build the reward ``+kB/500`` (larger JPEG files score higher).

    Args:
        quality: JPEG quality.

    Returns:
        The reward.
    """
    return JpegReward("jpeg_incompressibility", sign=1.0, quality=quality)
