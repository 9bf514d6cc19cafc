"""CLIP rewards on a tiny random CLIP saved to disk and loaded through the real loaders (offline)."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards import clip as clip_mod
from rlgen_cli.rewards.registry import REWARDS

PROMPTS = ["a red cube", "two cats on a sofa", "a long prompt " * 20]
CONF = Path(__file__).resolve().parents[2] / "conf" / "reward"


def _image_processor(**overrides):
    from transformers import CLIPImageProcessor

    kwargs = {"size": {"shortest_edge": 20}, "crop_size": {"height": 16, "width": 16}} | overrides
    return CLIPImageProcessor(**kwargs)


@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(model_dir, processor_dir): a tiny CLIP (logit_scale = 50) and its processor, saved apart."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    from rlgen_cli.models.tokenizers import tiny_clip_tokenizer

    root = tmp_path_factory.mktemp("tiny_clip")
    tokenizer = tiny_clip_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
    vision = dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)  # fmt: skip
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=24))
    with torch.no_grad():
        model.logit_scale.fill_(math.log(50.0))
    model.save_pretrained(root / "model")
    CLIPProcessor(image_processor=_image_processor(), tokenizer=tokenizer).save_pretrained(root / "processor")
    CLIPProcessor(image_processor=_image_processor(), tokenizer=tokenizer).save_pretrained(root / "model")
    return root / "model", root / "processor"


@pytest.fixture(autouse=True)
def _fresh_cache():
    clip_mod.clear_model_cache()
    yield
    clip_mod.clear_model_cache()


def _images(n: int = 3, h: int = 24, w: int = 30, seed: int = 0) -> torch.Tensor:
    """Smooth images on the uint8 grid, so PIL and torch see the same pixels."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 3, 5, 6, generator=g)
    return (F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False) * 255).round() / 255


def _reference(
    model_dir: Path, processor_dir: Path, images: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits_per_image diag, logit_scale·cos) straight from the model's forward on processor inputs."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(model_dir, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(processor_dir, local_files_only=True)
    tokens = processor.tokenizer(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(**tokens, pixel_values=clip_mod.clip_pixel_values(images, processor))
    hand = model.logit_scale.exp() * (
        F.normalize(out.image_embeds, dim=-1) * F.normalize(out.text_embeds, dim=-1)
    ).sum(-1)
    return out.logits_per_image.diagonal(), hand


def test_pickscore_is_logit_scale_cosine_over_26(clip_dirs):
    model_dir, processor_dir = clip_dirs
    reward = build_reward(
        "pickscore",
        model_path=str(model_dir),
        processor_path=str(processor_dir),
        device="cpu",
        local_files_only=True,
    )
    images = _images()
    result = reward.score(RewardBatch(prompts=PROMPTS, images=images))
    diag, hand = _reference(model_dir, processor_dir, images)
    assert result.scores.dtype == torch.float32 and result.scores.shape == (3,)
    torch.testing.assert_close(result.scores, hand / 26, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.scores, diag / 26, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.details["cosine"] * 50 / 26, result.scores, atol=1e-4, rtol=1e-4)


def test_clipscore_is_logits_diag_over_30(clip_dirs):
    model_dir, _ = clip_dirs
    reward = build_reward("clipscore", model_path=str(model_dir), device="cpu", local_files_only=True)
    images = _images(seed=1)
    result = reward.score(RewardBatch(prompts=PROMPTS, images=images))
    diag, _ = _reference(model_dir, model_dir, images)
    torch.testing.assert_close(result.scores, diag / 30, atol=1e-5, rtol=1e-5)


def test_image_similarity_self_is_one_and_symmetric(clip_dirs):
    reward = build_reward(
        "image_similarity", model_path=str(clip_dirs[0]), device="cpu", local_files_only=True
    )
    a, b = _images(seed=2), _images(seed=3)
    self_sim = reward.score(RewardBatch(prompts=PROMPTS, images=a, ref_images=a)).scores
    torch.testing.assert_close(self_sim, torch.ones(3), atol=1e-5, rtol=0)
    ab = reward.score(RewardBatch(prompts=PROMPTS, images=a, ref_images=b)).scores
    ba = reward.score(RewardBatch(prompts=PROMPTS, images=b, ref_images=a)).scores
    torch.testing.assert_close(ab, ba)
    assert (ab <= 1 + 1e-5).all() and (ab >= -1 - 1e-5).all()
    with pytest.raises(ValueError, match="ref_images"):
        reward.score(RewardBatch(prompts=PROMPTS, images=a))


def _head_file(path: Path, width: int, bias: float, random: bool = False) -> Path:
    head = clip_mod.AestheticHead(width)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.1 if random else torch.zeros_like(p))
        if not random:
            head.layers[7].bias.fill_(bias)
    torch.save(head.state_dict(), path)
    return path


def test_aesthetic_hand_set_head(clip_dirs, tmp_path):
    model_dir, _ = clip_dirs
    const = _head_file(tmp_path / "const.pth", 24, bias=5.0)
    reward = build_reward(
        "aesthetic", head_path=str(const), model_path=str(model_dir), device="cpu", local_files_only=True
    )
    images = _images(seed=4)
    assert torch.equal(
        reward.score(RewardBatch(prompts=PROMPTS, images=images)).scores, torch.full((3,), 5.0)
    )

    rand = build_reward(
        "aesthetic",
        head_path=str(_head_file(tmp_path / "r.pth", 24, 0.0, random=True)),
        model_path=str(model_dir),
        device="cpu",
        local_files_only=True,
    )
    scores = rand.score(RewardBatch(prompts=PROMPTS, images=images)).scores
    with torch.no_grad():
        feats = rand.model.get_image_features(pixel_values=clip_mod.clip_pixel_values(images, rand.processor))
        expected = rand.head(F.normalize(clip_mod._pooled(feats), dim=-1)).squeeze(-1)
    torch.testing.assert_close(scores, expected)
    assert list(rand.head.state_dict())[0] == "layers.0.weight"


def test_aesthetic_errors(clip_dirs, tmp_path):
    with pytest.raises(ValueError, match="sac\\+logos\\+ava1-l14-linearMSE.pth"):
        build_reward("aesthetic")
    with pytest.raises(ValueError, match="not found"):
        build_reward("aesthetic", head_path=str(tmp_path / "missing.pth"))
    torch.save({"w": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="layers.0.weight"):
        build_reward("aesthetic", head_path=str(tmp_path / "bad.pth"))
    wrong = build_reward(
        "aesthetic",
        head_path=str(_head_file(tmp_path / "h.pth", 768, 5.0)),
        model_path=str(clip_dirs[0]),
        device="cpu",
        local_files_only=True,
    )
    with pytest.raises(ValueError, match="768-d"):
        wrong.score(RewardBatch(prompts=PROMPTS, images=_images()))


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_torch_preprocessing_matches_processor_on_pil(backend):
    from PIL import Image

    if backend == "pil":
        transformers = pytest.importorskip("transformers")
        cls = getattr(transformers, "CLIPImageProcessorPil", None)
        if cls is None:
            pytest.skip("this transformers has no separate PIL CLIP processor")
        processor = cls(size={"shortest_edge": 20}, crop_size={"height": 16, "width": 16})
    else:
        processor = _image_processor()
    for h, w in [(24, 30), (40, 22), (16, 16)]:
        images = _images(2, h, w, seed=h)
        pils = [Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()) for x in images]
        expected = processor(images=pils, return_tensors="pt")["pixel_values"]
        ours = clip_mod.clip_pixel_values(images, processor)
        assert ours.shape == expected.shape == (2, 3, 16, 16)
        torch.testing.assert_close(ours, expected, atol=0.02, rtol=0)  # ≈ 1 uint8 level after /std


def test_preprocessing_falls_back_to_processor_for_fixed_size_resize():
    processor = _image_processor(size={"height": 16, "width": 16}, do_center_crop=False)
    images = _images(2, 20, 28)
    ours = clip_mod.clip_pixel_values(images, processor)
    from PIL import Image

    pils = [Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()) for x in images]
    torch.testing.assert_close(ours, processor(images=pils, return_tensors="pt")["pixel_values"])


def test_grayscale_images_are_expanded():
    processor = _image_processor()
    gray = _images(2)[:, :1]
    torch.testing.assert_close(
        clip_mod.clip_pixel_values(gray, processor),
        clip_mod.clip_pixel_values(gray.expand(-1, 3, -1, -1), processor),
    )


def test_model_cache_loads_shared_clip_once(clip_dirs):
    kwargs = {"model_path": str(clip_dirs[0]), "device": "cpu", "local_files_only": True}
    a, b = build_reward("clipscore", **kwargs), build_reward("image_similarity", **kwargs)
    images = _images()
    a.score(RewardBatch(prompts=PROMPTS, images=images))
    b.score(RewardBatch(prompts=PROMPTS, images=images, ref_images=images))
    assert a.model is b.model
    assert clip_mod.load_clip_model.cache_info().misses == 1
    assert clip_mod.load_clip_processor.cache_info().misses == 1


def test_input_validation_and_lazy_loading(clip_dirs):
    reward = build_reward("clipscore", model_path=str(clip_dirs[0]), device="cpu", local_files_only=True)
    assert clip_mod.load_clip_model.cache_info().currsize == 0  # nothing loads at build time
    with pytest.raises(ValueError, match="images but it is None"):
        reward.score(RewardBatch(prompts=PROMPTS))
    with pytest.raises(ValueError, match="frame by frame"):  # 2 channels: neither images nor videos
        reward.score(RewardBatch(prompts=PROMPTS, images=torch.rand(3, 2, 16, 16)))
    with pytest.raises(ValueError, match="unknown dtype"):
        build_reward("clipscore", dtype="int8")


MY_CONFIGS = ["pickscore", "clipscore", "aesthetic", "image_similarity", "qwenvl", "pickscore_clip_mix"]


@pytest.mark.parametrize("path", [CONF / f"{name}.yaml" for name in MY_CONFIGS], ids=lambda p: p.stem)
def test_reward_configs_name_registered_rewards_and_valid_kwargs(path):
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert set(cfg["weights"]) <= set(REWARDS)
    for name, kwargs in cfg.get("kwargs", {}).items():
        inspect.signature(REWARDS[name]).bind(**kwargs)  # raises TypeError on an unknown kwarg


def _video(seeds: tuple[int, ...]) -> torch.Tensor:
    """(3, 3, F, H, W): frame k is ``_images(seed=seeds[k])``."""
    return torch.stack([_images(seed=s) for s in seeds], dim=2)


@pytest.mark.parametrize("name", ["pickscore", "clipscore"])
def test_a_video_scores_the_mean_of_its_frames(clip_dirs, name: str):
    """Each frame against its own sample's prompt, scored as an image (the model's own logits), then the
    mean over the frames; a sample's frames are not mixed with another sample's."""
    model_dir, processor_dir = clip_dirs
    paths = {"processor_path": str(processor_dir)} if name == "pickscore" else {}
    reward = build_reward(name, model_path=str(model_dir), device="cpu", local_files_only=True, **paths)
    scale = 26.0 if name == "pickscore" else 30.0
    seeds = (4, 5, 6)
    per_frame = torch.stack(
        [_reference(model_dir, processor_dir if paths else model_dir, _images(seed=s))[0] for s in seeds]
    )  # (F, B) logits of each frame as an image batch
    result = reward.score(RewardBatch(prompts=PROMPTS, images=_video(seeds)))
    assert result.scores.shape == (3,) and result.details["cosine"].shape == (3,)
    torch.testing.assert_close(result.scores, per_frame.mean(0) / scale, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result.details["cosine"], per_frame.mean(0) / 50, atol=1e-5, rtol=1e-5)


def test_image_similarity_refuses_a_video(clip_dirs):
    reward = build_reward(
        "image_similarity", model_path=str(clip_dirs[0]), device="cpu", local_files_only=True
    )
    with pytest.raises(ValueError, match="does not score videos"):
        reward.score(RewardBatch(prompts=PROMPTS, images=_video((1, 2)), ref_images=_images()))
