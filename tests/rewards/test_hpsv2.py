"""HPSv2 / HPSv2.1 on a tiny random CLIP saved as an OpenCLIP-layout ``.pt`` and read by the real loader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.hpsv2 import OPENAI_MEAN, OPENAI_STD, HPSv2Kwargs, hps_pixel_values, open_clip_to_clip

PROMPTS = ["a red cube", "two cats on a sofa", "a long prompt " * 20]
CONF = Path(__file__).resolve().parents[2] / "conf" / "reward"
WIDTH, LAYERS = 32, 2


def _open_clip_layout(model) -> dict[str, torch.Tensor]:
    """A transformers CLIPModel's tensors under OpenCLIP's names (q/k/v fused, projections as x @ P)."""
    sd = model.state_dict()
    out = {
        "visual.class_embedding": sd["vision_model.embeddings.class_embedding"],
        "visual.positional_embedding": sd["vision_model.embeddings.position_embedding.weight"],
        "visual.conv1.weight": sd["vision_model.embeddings.patch_embedding.weight"],
        "visual.proj": sd["visual_projection.weight"].t(),
        "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
        "positional_embedding": sd["text_model.embeddings.position_embedding.weight"],
        "text_projection": sd["text_projection.weight"].t(),
        "logit_scale": sd["logit_scale"],
        "attn_mask": torch.zeros(77, 77),  # OpenCLIP's causal-mask buffer, dropped by the converter
    }
    norms = {"visual.ln_pre": "vision_model.pre_layrnorm", "visual.ln_post": "vision_model.post_layernorm",
             "ln_final": "text_model.final_layer_norm"}  # fmt: skip
    for old, new in norms.items():
        out |= {f"{old}.weight": sd[f"{new}.weight"], f"{old}.bias": sd[f"{new}.bias"]}
    for old, new in (("visual.transformer", "vision_model"), ("transformer", "text_model")):
        for i in range(LAYERS):
            o, n = f"{old}.resblocks.{i}.", f"{new}.encoder.layers.{i}."
            for kind in ("weight", "bias"):
                qkv = [sd[f"{n}self_attn.{p}_proj.{kind}"] for p in "qkv"]
                out[f"{o}attn.in_proj_{kind}"] = torch.cat(qkv)
                pairs = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
                         "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}  # fmt: skip
                out |= {f"{o}{a}.{kind}": sd[f"{n}{b}.{kind}"] for a, b in pairs.items()}
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, checkpoint .pt, config dir, tokenizer dir): a tiny CLIP with logit_scale 50."""
    from transformers import CLIPConfig, CLIPModel

    from rlgen_cli.models.tokenizers import tiny_clip_tokenizer

    root = tmp_path_factory.mktemp("tiny_hps")
    tokenizer = tiny_clip_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=LAYERS,
                num_attention_heads=4, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)  # fmt: skip
    vision = dict(image_size=16, patch_size=4, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4)  # fmt: skip
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    with torch.no_grad():
        model.logit_scale.fill_(math.log(50.0))
    torch.save({"state_dict": _open_clip_layout(model), "epoch": 3}, root / "HPS_tiny.pt")
    config.save_pretrained(root / "config")
    tokenizer.save_pretrained(root / "tokenizer")
    return model, root / "HPS_tiny.pt", root / "config", root / "tokenizer"


def _reward(tiny, name: str = "hpsv2_1", **overrides):
    _, checkpoint, config, tokenizer = tiny
    kwargs = (
        dict(
            model_path=str(checkpoint),
            config_path=str(config),
            tokenizer_path=str(tokenizer),
            device="cpu",
            local_files_only=True,
        )
        | overrides
    )
    return build_reward(name, **kwargs)


def _images(n: int = 3, h: int = 24, w: int = 30, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.interpolate(
        torch.rand(n, 3, 5, 6, generator=g), size=(h, w), mode="bilinear", align_corners=False
    )


def test_scores_are_the_cosine_of_the_checkpoints_embeddings(tiny):
    model, *_ = tiny
    reward = _reward(tiny)
    images = _images()
    result = reward.score(RewardBatch(prompts=PROMPTS, images=images))
    assert result.scores.shape == (3,) and result.scores.dtype == torch.float32
    assert bool((result.scores.abs() <= 1 + 1e-5).all())
    # Reference: the original (unconverted) model's projected features, cosine without logit_scale.
    tokenizer = reward._tokenizer
    tokens = tokenizer(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(**tokens, pixel_values=hps_pixel_values(images, 16, OPENAI_MEAN, OPENAI_STD))
    cosine = (F.normalize(out.image_embeds, dim=-1) * F.normalize(out.text_embeds, dim=-1)).sum(-1)
    torch.testing.assert_close(result.scores, cosine, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(result.scores, out.logits_per_image.diagonal(), atol=1e-2)  # no logit scale


def test_identical_pairs_score_equally_and_prompts_matter(tiny):
    reward = _reward(tiny)
    image = _images(1)
    same = reward.score(RewardBatch(prompts=["a dog", "a dog"], images=image.repeat(2, 1, 1, 1))).scores
    assert same[0] == pytest.approx(float(same[1]), abs=1e-6)  # equal up to batched-GEMM rounding
    other = reward.score(RewardBatch(prompts=["a dog", "zzz qq"], images=image.repeat(2, 1, 1, 1))).scores
    assert abs(float(other[0] - other[1])) > 1e-3


def test_v2_and_v2_1_are_separate_names_on_the_same_loader(tiny):
    a = _reward(tiny, "hpsv2").score(RewardBatch(prompts=PROMPTS, images=_images()))
    b = _reward(tiny, "hpsv2_1").score(RewardBatch(prompts=PROMPTS, images=_images()))
    torch.testing.assert_close(a.scores, b.scores)
    assert HPSv2Kwargs().model_path.endswith("HPS_v2.1_compressed.pt")
    assert build_reward("hpsv2").kwargs.model_path.endswith("HPS_v2_compressed.pt")  # nothing loads yet


def test_preprocessing_resizes_the_long_side_and_zero_pads_by_hand():
    # 16×8 constant image -> long side 8: an 8×4 constant block centred in 8×8, zeros (before
    # normalisation) in two columns on each side.
    images = torch.full((1, 3, 16, 8), 0.75)
    pixels = hps_pixel_values(images, 8, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert pixels.shape == (1, 3, 8, 8)
    torch.testing.assert_close(pixels[..., 2:6], torch.full((1, 3, 8, 4), 1.0))  # (0.75 − 0.5) / 0.25
    torch.testing.assert_close(pixels[..., :2], torch.full((1, 3, 8, 2), -2.0))  # (0 − 0.5) / 0.25
    torch.testing.assert_close(pixels[..., 6:], torch.full((1, 3, 8, 2), -2.0))


def test_converter_splits_qkv_and_transposes_projections():
    state = {
        "transformer.resblocks.0.attn.in_proj_weight": torch.arange(6.0).view(6, 1),
        "visual.proj": torch.tensor([[1.0, 2.0, 3.0]]),
        "visual.transformer.resblocks.1.mlp.c_fc.bias": torch.ones(2),
    }
    out = open_clip_to_clip(state)
    assert out["text_model.encoder.layers.0.self_attn.k_proj.weight"].flatten().tolist() == [2.0, 3.0]
    assert out["visual_projection.weight"].shape == (3, 1)
    assert "vision_model.encoder.layers.1.mlp.fc1.bias" in out
    with pytest.raises(ValueError, match="ls_1.gamma"):
        open_clip_to_clip({"transformer.resblocks.0.ls_1.gamma": torch.ones(2)})


def test_missing_checkpoint_names_path_and_fix(tmp_path):
    missing = tmp_path / "HPS_v2.1_compressed.pt"
    with pytest.raises(
        ValueError, match=r"model_path=.*HPS_v2\.1_compressed\.pt.*huggingface\.co/xswu/HPSv2"
    ):
        build_reward("hpsv2_1", model_path=str(missing))
    with pytest.raises(ValueError, match=r"no kwarg 'head_path'.*valid: model_path"):
        build_reward("hpsv2_1", head_path="x")


def test_offline_hub_file_that_is_not_cached_says_how_to_fix():
    reward = build_reward("hpsv2_1", model_path="nobody/none/HPS.pt", local_files_only=True, device="cpu")
    with pytest.raises(ValueError, match=r"downloading 'HPS\.pt' from hub repo 'nobody/none' failed"):
        reward.score(RewardBatch(prompts=["a"], images=torch.rand(1, 3, 8, 8)))


def test_checkpoint_of_another_shape_is_rejected(tiny, tmp_path):
    model, *_ = tiny
    state = _open_clip_layout(model)
    state["visual.proj"] = torch.zeros(WIDTH, 7)  # projection width 7 ≠ the config's 24
    torch.save({"state_dict": state}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"wrong shape \['visual_projection.weight'\]"):
        _reward(tiny, model_path=str(tmp_path / "bad.pt")).score(
            RewardBatch(prompts=["a"], images=_images(1))
        )


@pytest.mark.parametrize("name", ["hpsv2", "hpsv2_1"])
def test_configs_name_the_reward_and_valid_kwargs(name):
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))
    assert cfg["weights"] == {name: 1.0}
    kwargs = HPSv2Kwargs(**cfg["kwargs"][name])
    assert kwargs.model_path.endswith(
        "HPS_v2.1_compressed.pt" if name == "hpsv2_1" else "HPS_v2_compressed.pt"
    )


def test_conversion_matches_open_clip_when_installed():
    """The key mapping reproduces OpenCLIP's own forward (runs where open_clip_torch is installed)."""
    open_clip_model = pytest.importorskip("open_clip.model")
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(1)
    vocab = 60
    reference = open_clip_model.CLIP(
        embed_dim=24,
        vision_cfg=dict(image_size=16, layers=2, width=32, head_width=8, patch_size=4),
        text_cfg=dict(context_length=20, vocab_size=vocab, width=32, heads=4, layers=2),
    ).eval()
    with torch.no_grad():  # non-trivial norms and projections
        for name, p in reference.named_parameters():
            if "ln" in name or name in ("text_projection", "visual.proj"):
                p.add_(torch.randn_like(p) * 0.3)
    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=20, hidden_act="gelu", bos_token_id=vocab - 2, eos_token_id=vocab - 1)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=4, hidden_act="gelu")  # fmt: skip
    converted = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)).eval()
    converted.load_state_dict(open_clip_to_clip(reference.state_dict()), strict=True)
    ids = torch.zeros(2, 20, dtype=torch.long)
    ids[:, 0], ids[0, 1:6], ids[0, 6], ids[1, 1:15], ids[1, 15] = vocab - 2, 7, vocab - 1, 9, vocab - 1
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        image = converted.get_image_features(pixel_values=pixels)
        text_out = converted.get_text_features(input_ids=ids)  # causal: tokens after the end do not matter
        image = image if isinstance(image, torch.Tensor) else image.pooler_output
        text_out = text_out if isinstance(text_out, torch.Tensor) else text_out.pooler_output
        torch.testing.assert_close(image, reference.encode_image(pixels), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(text_out, reference.encode_text(ids), atol=1e-5, rtol=1e-4)


def test_checkpoint_with_pickled_objects_is_refused(tmp_path):
    import argparse

    from rlgen_cli.rewards.checkpoints import load_state_dict_file

    torch.save(
        {"state_dict": {"logit_scale": torch.ones(())}, "args": argparse.Namespace(lr=1)}, tmp_path / "x.pt"
    )
    with pytest.raises(ValueError, match=r"Re-save only its state dict"):
        load_state_dict_file(tmp_path / "x.pt")
    torch.save({"state_dict": {"module.logit_scale": torch.ones(())}, "epoch": 3}, tmp_path / "ok.pt")
    assert list(load_state_dict_file(tmp_path / "ok.pt")) == ["logit_scale"]  # DDP prefix dropped
