"""Brightness reward: the mean pixel value of each image, a sanity-check signal any model can learn.

``brightness`` scores an image ``(C, H, W)`` (or a video ``(C, F, H, W)``) by the mean of its pixels in
[0, 1] over every channel (and frame): 0 for black, 1 for white. It needs no model and is smooth in the
pixels, so even a random-weight model climbs it within a few updates; that makes it the task of the
learning tests and a quick check that a new setup trains in the right direction (``reward=brightness``;
``reward.weights.brightness=-1`` asks for dark images instead).
"""

from __future__ import annotations

import torch

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.jpeg import _check_images
from rlgen_cli.rewards.registry import NoKwargs, register

__all__ = ["BrightnessReward", "brightness"]


class BrightnessReward:
    """Score each image by its mean pixel value in [0, 1].

    Attributes:
        name: Registry name.
    """

    name = "brightness"
    reads_prompts = False  # the pixels alone
    accepts_uint8 = True  # the served uint8 pixels are scaled here, no float round trip needed

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score every image (or video) of ``batch``.

        Args:
            batch: Batch with ``images`` ``(B, C, H, W)`` or ``(B, C, F, H, W)`` in [0, 1] (or uint8).

        Returns:
            ``scores`` = mean pixel value per sample (float32, in [0, 1]).

        Raises:
            ValueError: If the batch has no usable images.
        """
        images = _check_images(batch.images, self.name)
        pixels = images.detach().to(device="cpu", dtype=torch.float64)
        if images.dtype == torch.uint8:
            pixels = pixels / 255.0
        scores = pixels.flatten(start_dim=1).mean(dim=1)
        return RewardResult(scores=scores.to(torch.float32))


@register("brightness", kwargs=NoKwargs)
def brightness() -> BrightnessReward:
    """Build the reward ``mean pixel value`` (brighter images score higher).

    Returns:
        The reward.
    """
    return BrightnessReward()
