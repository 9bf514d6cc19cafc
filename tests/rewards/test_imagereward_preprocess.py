"""ImageReward's image transform by hand: torchvision's truncated short-side resize and half-to-even crop."""

from __future__ import annotations

import torch

from rlgen_cli.rewards.imagereward import OPENAI_MEAN, OPENAI_STD, _short_side_size, imagereward_pixel_values


def test_short_side_goes_to_224_and_the_long_side_is_truncated():
    # 224 · 524 / 300 = 391.25 → 391, either orientation
    assert _short_side_size(300, 524, 224) == (224, 391)
    assert _short_side_size(524, 300, 224) == (391, 224)
    # 224 · 333 / 224 = 333 exactly: no resize
    assert _short_side_size(224, 333, 224) == (224, 333)


def _column_ramp(height: int, width: int) -> torch.Tensor:
    """(1, 3, H, W) uint8-exact image whose value at column x is x / 255."""
    return (torch.arange(width, dtype=torch.float32) / 255).expand(1, 3, height, width).clone()


def test_centre_crop_offset_rounds_half_to_even():
    # width 391 (short side already 224: no resize): offset round((391 − 224) / 2) = round(83.5) = 84
    pixels = imagereward_pixel_values(_column_ramp(224, 391), 224)
    first_column = pixels[0, 0, 0, 0] * OPENAI_STD[0] + OPENAI_MEAN[0]
    assert round(float(first_column) * 255) == 84
    # width 393: round(84.5) = 84 as well (a floor would give 84 too; 391 is the case that tells them apart)
    pixels = imagereward_pixel_values(_column_ramp(224, 393), 224)
    assert round(float(pixels[0, 0, 0, 0] * OPENAI_STD[0] + OPENAI_MEAN[0]) * 255) == 84


def test_values_are_quantised_and_normalised():
    image = torch.full((1, 3, 224, 224), 0.5)  # round(127.5) = 128 (half to even) → 128/255
    pixels = imagereward_pixel_values(image, 224)
    expected = torch.tensor([(128 / 255 - m) / s for m, s in zip(OPENAI_MEAN, OPENAI_STD)])
    torch.testing.assert_close(pixels[0, :, 100, 100], expected, rtol=1e-6, atol=1e-6)
    assert pixels.shape == (1, 3, 224, 224) and pixels.dtype == torch.float32
