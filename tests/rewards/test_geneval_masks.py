"""GenEval with instance masks: Mask2Former post-processing by hand, crop modes, and a tiny random Mask2Former
through the real loader (that part needs scipy, which transformers' Mask2Former class imports)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from rlgen_cli.geneval_rules import Detection
from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.geneval import GenEvalKwargs, GenEvalReward, _to_pil
from rlgen_cli.rewards.geneval_colour import CLIPColorClassifier, crop_object
from rlgen_cli.rewards.geneval_detect import TransformersDetector, instance_detections, mask_boxes

LABELS = ["dog", "cat", "mouse"]  # "mouse" exercises the alias to "computer mouse"


def test_mask_boxes_span_the_mask_with_exclusive_ends():
    masks = torch.zeros(2, 5, 6, dtype=torch.bool)
    masks[0, 1:3, 2:5] = True  # rows 1–2, columns 2–4
    assert mask_boxes(masks).tolist() == [[2.0, 1.0, 5.0, 3.0], [0.0, 0.0, 0.0, 0.0]]


def test_instance_scores_are_class_probability_times_mask_probability():
    # Query 0: class probabilities (0.6, 0.3) + "no object" 0.1; query 1: (0.1, 0.1) + 0.8.
    class_logits = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8]]).log()
    mask_logits = torch.full((2, 5, 6), -20.0)
    mask_logits[0, 1:3, 2:5] = 2.0  # inside: sigmoid(2) = 0.8808; query 1's mask is empty
    dets = instance_detections(class_logits, mask_logits, (5, 6), 0.25, lambda i: LABELS[i])
    # Top-2 (query, class) pairs are (0, dog) 0.6 and (0, cat) 0.3, both on query 0's mask.
    assert [d.label for d in dets] == ["dog", "cat"]
    assert [d.score for d in dets] == pytest.approx(
        [0.6 / (1 + math.exp(-2)), 0.3 / (1 + math.exp(-2))], abs=1e-5
    )
    assert dets[0].box == (2.0, 1.0, 5.0, 3.0) and dets[0].mask.shape == (5, 6) and dets[0].mask.sum() == 6
    above = instance_detections(class_logits, mask_logits, (5, 6), 0.3, lambda i: LABELS[i])
    assert [d.label for d in above] == ["dog"]  # 0.3 · 0.88 = 0.26 falls under 0.3


def test_colour_crop_modes():
    image = Image.new("RGB", (10, 10), (255, 0, 0))
    mask = np.zeros((10, 10), dtype=bool)
    mask[:, :5] = True
    masked = Detection("dog", (0, 0, 10, 10), 1.0, mask)
    assert tuple(np.asarray(crop_object(image, masked, "mask"))[0, 9]) == (0x99, 0x99, 0x99)  # grey outside
    assert tuple(np.asarray(crop_object(image, masked, "box"))[0, 9]) == (255, 0, 0)  # the box as it is
    boxed = Detection("dog", (0, 0, 10, 10), 1.0)
    with pytest.raises(ValueError, match="colour_crop=box"):
        CLIPColorClassifier("never/loaded", colour_crop="mask").classify(image, [boxed], "dog")
    with pytest.raises(ValueError, match=r"colour_crop='segment'"):
        build_reward("geneval", detector_path="d", clip_path="c", colour_crop="segment")
    with pytest.raises(ValueError, match=r"no kwarg 'detector'.*valid: detector_path"):
        build_reward("geneval", detector_path="d", clip_path="c", detector="mask2former")


def test_geneval_config_uses_the_original_mask_crop():
    cfg = OmegaConf.to_container(OmegaConf.load(Path(__file__).parents[2] / "conf/reward/geneval.yaml"))
    assert GenEvalKwargs(**cfg["kwargs"]["geneval"]).colour_crop == "mask"
    reward = build_reward("geneval", **{**cfg["kwargs"]["geneval"], "detector_path": "d", "clip_path": "c"})
    assert isinstance(reward, GenEvalReward) and reward.color_classifier.colour_crop == "mask"


def _mask2former_config():
    from transformers import Mask2FormerConfig, SwinConfig

    swin = SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 2, 2],
        window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    return Mask2FormerConfig(
        backbone_config=swin,
        hidden_dim=32,
        mask_feature_size=32,
        feature_size=32,
        num_queries=8,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        dim_feedforward=32,
        encoder_feedforward_dim=32,
        common_stride=4,
        id2label=dict(enumerate(LABELS)),
        label2id={n: i for i, n in enumerate(LABELS)},
    )


def _save_processor(path: Path) -> None:
    from transformers import Mask2FormerImageProcessor

    Mask2FormerImageProcessor(
        size={"shortest_edge": 64, "longest_edge": 128}, size_divisor=32
    ).save_pretrained(path)


def test_mask2former_without_scipy_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    _mask2former_config().save_pretrained(tmp_path)  # a config is enough: the check comes before the weights
    _save_processor(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "scipy" else real(n, *a))
    with pytest.raises(ValueError, match=r"pip install 'rlgen\[geneval\]'.*colour_crop=box"):
        TransformersDetector(str(tmp_path), local_files_only=True).detect([Image.new("RGB", (8, 8))])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(Mask2Former dir, CLIP dir): random tiny models saved with their processors."""
    pytest.importorskip("scipy")
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        Mask2FormerForUniversalSegmentation,
    )

    from rlgen_cli.models.tokenizers import tiny_clip_tokenizer

    root = tmp_path_factory.mktemp("geneval_masks")
    torch.manual_seed(0)
    Mask2FormerForUniversalSegmentation(_mask2former_config()).save_pretrained(root / "m2f")
    _save_processor(root / "m2f")
    tok = tiny_clip_tokenizer()
    clip = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        projection_dim=16,
    )
    CLIPModel(clip).save_pretrained(root / "clip")
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=processor, tokenizer=tok).save_pretrained(root / "clip")
    return str(root / "m2f"), str(root / "clip")


def test_tiny_mask2former_gives_masked_detections_at_each_images_size(tiny_models):
    detector = TransformersDetector(tiny_models[0], local_files_only=True, threshold=0.0)
    images = [Image.new("RGB", (64, 48), (200, 30, 30)), Image.new("RGB", (40, 64), (30, 30, 200))]
    found = detector.detect(images)
    assert detector.gives_masks and len(found) == 2 and any(found)
    for image, dets in zip(images, found):
        for d in dets:
            assert d.label in {"dog", "cat", "computer mouse"} and 0 <= d.score <= 1
            assert d.mask.shape == (image.height, image.width) and d.mask.dtype == bool and d.mask.any()
            assert d.box == tuple(mask_boxes(torch.from_numpy(d.mask)[None])[0].tolist())  # the mask's extent


def test_reward_end_to_end_with_mask_crops(tiny_models):
    m2f, clip = tiny_models
    reward = build_reward(
        "geneval",
        detector_path=m2f,
        clip_path=clip,
        local_files_only=True,
        threshold=0.0,
        counting_threshold=0.0,
    )
    assert reward.color_classifier.colour_crop == "mask"
    images = torch.rand(2, 3, 48, 64)
    found = reward.detector.detect(_to_pil(images))  # what score() will see
    label = found[0][0].label if found[0] else "dog"
    n = max(sum(d.label == label for d in found[0]), 1)
    metas = [
        {"tag": "colors", "include": [{"class": label, "count": n, "color": "red"}]},
        {"tag": "single_object", "include": [{"class": "cat", "count": 1}]},
    ]
    out = reward.score(RewardBatch(prompts=["a", "b"], images=images, metadata=metas))
    assert out.scores.shape == (2,) and bool(((out.scores >= 0) & (out.scores <= 1)).all())
    assert out.details["tag"] == ["colors", "single_object"]
    if found[0]:  # the count matched, so the colour check ran on mask crops
        assert "==" not in out.details["reason"][0]
