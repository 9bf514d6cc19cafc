"""Detector: connected components, colours, shape classes, noise, and accuracy on ground truth."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from rlgen_cli.shapes.detect import ShapeDetector, label_components
from rlgen_cli.shapes.prompts import build_splits
from rlgen_cli.shapes.render import render_batch
from rlgen_cli.shapes.score import format_summary, score_images, summarise_results
from rlgen_cli.shapes.vocab import COLORS, SHAPES, TAGS

logger = logging.getLogger(__name__)
DETECTOR = ShapeDetector()


def test_label_components_four_connectivity_and_batch_isolation():
    fg = np.zeros((2, 4, 5), dtype=bool)
    fg[0, 0, 0:2] = fg[0, 1, 1] = True  # an L of 3 pixels: one component, first pixel at index 0
    fg[0, 2, 2] = fg[0, 3, 3] = True  # two diagonal pixels: two components (4-connectivity)
    fg[1, 0, 0] = True  # image 1, same place: its own component (flat index 20)
    labels = label_components(fg)
    assert labels[0, 0, 0] == labels[0, 0, 1] == labels[0, 1, 1] == 0
    assert labels[0, 2, 2] == 12 and labels[0, 3, 3] == 18
    assert labels[1, 0, 0] == 20 and (labels[~fg] == fg.size).all()


def test_label_components_follows_a_long_snake():
    fg = np.zeros((1, 9, 9), dtype=bool)
    fg[0, ::2, :] = True  # rows 0, 2, 4, 6, 8 joined at alternating ends: one winding path
    fg[0, 1::4, 8] = fg[0, 3::4, 0] = True
    assert len(np.unique(label_components(fg)[fg])) == 1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("color", COLORS)
def test_every_shape_and_colour(painter, shape, color):
    (found,) = DETECTOR.detect(painter([(shape, color, 5, 9, 9)])[None])
    expected = [(shape, color, (5.0, 9.0, 14.0, 18.0), 1.0)]
    assert [(d.label, d.color, d.box, d.score) for d in found] == expected


@pytest.mark.parametrize("turns", [1, 2, 3])
def test_triangles_in_any_axis_aligned_orientation(painter, turns):
    image = painter([("triangle", "red", 10, 10, 9)])
    (found,) = DETECTOR.detect(torch.rot90(image, turns, dims=(1, 2))[None])
    assert [d.label for d in found] == ["triangle"]


def test_specks_below_min_area_are_ignored(painter):
    image = painter([("circle", "blue", 2, 2, 8)])
    image[:, 30, 30] = image[:, 30, 31] = 1.0  # a 2-pixel white speck
    assert len(DETECTOR.detect(image[None])[0]) == 1
    assert len(ShapeDetector(min_area=1).detect(image[None])[0]) == 2


def test_colour_is_the_majority_and_noise_is_tolerated(painter):
    image = painter([("square", "green", 4, 4, 10)])
    image[:, 4, 4:7] = torch.tensor([0.9, 0.1, 0.1])[:, None]  # 3 red pixels in a 100-pixel green square
    noisy = (image + 0.08 * torch.randn(image.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    for img in (image, noisy):
        (found,) = DETECTOR.detect(img[None])
        assert [(d.label, d.color) for d in found] == [("square", "green")]


def test_empty_images_and_bad_input():
    assert DETECTOR.detect(torch.zeros(2, 3, 32, 32)) == [[], []]
    with pytest.raises(ValueError, match="RGB images"):
        DETECTOR.detect(torch.zeros(2, 1, 32, 32))
    with pytest.raises(ValueError, match="non-finite"):
        DETECTOR.detect(torch.full((1, 3, 8, 8), float("nan")))
    with pytest.raises(ValueError, match="min_area"):
        ShapeDetector(min_area=0)


def test_strict_accuracy_on_rendered_ground_truth():
    """≥ 99 % ShapesEval strict accuracy on 600 rendered images, 100 per tag (measured: 100 %)."""
    splits = build_splits()
    rows = [m for m in splits["test"] + splits["heldout"] + splits["train"]]
    metas = [m for tag in TAGS for m in [r for r in rows if r["tag"] == tag][:100]]
    images = render_batch(metas, list(range(len(metas))))
    start = time.perf_counter()
    results = score_images(images, metas, DETECTOR)
    per_image_ms = 1000 * (time.perf_counter() - start) / len(metas)
    summary = summarise_results(results)
    logger.info(
        "%d images, %.2f ms/image (detect + score)\n%s", len(metas), per_image_ms, format_summary(summary)
    )
    assert len(metas) == 600
    assert sum(r.strict for r in results) / len(results) >= 0.99
    assert min(summary["strict"][t] for t in TAGS) >= 0.97
    assert summary["n_extra"]["overall"] == 0.0
    assert per_image_ms < 20  # ≈ 0.5–1 ms on 2 busy cores; generous for slow CI


def test_ground_truth_at_64_pixels():
    from rlgen_cli.shapes.render import RenderConfig

    metas = build_splits()["test"][:60]
    images = render_batch(metas, list(range(60)), RenderConfig(size=64))
    assert all(r.strict for r in score_images(images, metas))
