"""Renderer: determinism, non-overlap, GenEval relations, held-out colours, errors, sizes."""

from __future__ import annotations

import pytest
import torch

from rlgen_cli.geneval_rules import relative_position
from rlgen_cli.shapes.prompts import prompt_universe
from rlgen_cli.shapes.render import RenderConfig, layout, render, render_batch, shape_mask
from rlgen_cli.shapes.vocab import HELDOUT_COLOR_SHAPES, PALETTE

UNIVERSE = prompt_universe()
TWO = {"tag": "two_object", "include": [{"class": "circle", "count": 1}, {"class": "square", "count": 1}]}


def test_same_metadata_and_seed_give_the_same_image():
    a, objs_a = render(TWO, 7)
    b, objs_b = render(TWO, 7)
    assert torch.equal(a, b) and objs_a == objs_b
    assert not torch.equal(a, render(TWO, 8)[0])


def test_image_is_float_rgb_in_unit_range():
    image, objects = render(TWO, 0)
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert image.min() >= 0 and image.max() <= 1
    assert sorted(o.shape for o in objects) == ["circle", "square"]


def test_shape_masks_fill_their_box():
    for shape in ("circle", "square", "triangle"):
        mask = shape_mask(shape, 9)
        assert mask.any(axis=0).all() and mask.any(axis=1).all()  # extent = the whole 9×9 box
    triangle = shape_mask("triangle", 7)
    assert triangle[0].sum() == 1 and triangle[-1].all()  # apex on top, base at the bottom


@pytest.mark.parametrize("tag", list(UNIVERSE))
def test_every_tag_renders_gapped_objects_with_the_requested_colours(tag):
    config = RenderConfig()
    for seed, meta in enumerate(UNIVERSE[tag][:12]):
        objects = layout(meta, seed, config)
        assert len(objects) == sum(c["count"] for c in meta["include"])
        for i, a in enumerate(objects):
            clause = meta["include"][a.clause]
            assert a.shape == clause["class"] and a.color == clause.get("color", a.color)
            for b in objects[i + 1 :]:  # boxes at least `gap` pixels apart along x or y
                apart_x = a.box[2] + config.gap <= b.box[0] or b.box[2] + config.gap <= a.box[0]
                apart_y = a.box[3] + config.gap <= b.box[1] or b.box[3] + config.gap <= a.box[1]
                assert apart_x or apart_y


def test_position_prompts_hold_exactly_their_relation():
    for seed, meta in enumerate(UNIVERSE["position"] * 3):
        ref, obj = layout(meta, seed)
        relation = meta["include"][1]["position"][0]
        assert relative_position(obj.box, ref.box, 0.1) == {relation}, meta["prompt"]


def test_unspecified_colours_avoid_heldout_pairs_unless_asked():
    meta = {"tag": "counting", "include": [{"class": "circle", "count": 4}]}
    colours = {o.color for seed in range(60) for o in layout(meta, seed)}
    assert "purple" not in colours and len(colours) == len(PALETTE) - 1
    colours = {o.color for seed in range(60) for o in layout(meta, seed, avoid=())}
    assert "purple" in colours
    named = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "purple"}]}
    assert ("purple", "circle") in HELDOUT_COLOR_SHAPES and layout(named, 0)[0].color == "purple"


def test_configurable_size():
    image, objects = render(TWO, 3, RenderConfig(size=64))
    assert image.shape == (3, 64, 64)
    assert min(o.box[2] - o.box[0] for o in objects) >= 14  # sides scale with the image (0.22·64)


def test_render_batch_stacks_and_checks_lengths():
    batch = render_batch([TWO, TWO], [0, 1])
    assert batch.shape == (2, 3, 32, 32) and torch.equal(batch[0], render(TWO, 0)[0])
    with pytest.raises(ValueError, match="one seed each"):
        render_batch([TWO], [0, 1])


@pytest.mark.parametrize(
    "meta,match",
    [
        ({"include": [{"class": "dog", "count": 1}]}, "cannot render"),
        ({"include": [{"class": "circle", "count": 1, "color": "black"}]}, "cannot render"),
        ({"include": [{"class": "circle", "count": 1, "position": ["above", 0]}]}, "earlier"),
        ({"include": [{"class": "circle", "count": 40}]}, "could not place"),
    ],
)
def test_unrenderable_metadata_raises(meta, match):
    with pytest.raises(ValueError, match=match):
        render(meta, 0, RenderConfig(max_tries=20))
