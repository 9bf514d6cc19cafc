"""ImageReward through transformers' BLIP classes on a tiny random BLIP saved as an ``ImageReward.pt``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.imagereward import (
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    ImageRewardKwargs,
    ImageRewardModel,
    imagereward_state_dict,
)

CONF = Path(__file__).resolve().parents[2] / "conf" / "reward"
WORDS = ["a", "cat", "dog", "red", "on", "the", "sofa", "two", "blue", "car"]


def _upstream_layout(model: ImageRewardModel) -> dict[str, torch.Tensor]:
    """The model's tensors under ``ImageReward.pt``'s names (BLIP ViT naming, ``blip.`` prefix)."""
    block = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.qkv": "attn.qkv",
             "self_attn.projection": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # fmt: skip
    top = {"embeddings.class_embedding": "cls_token", "embeddings.position_embedding": "pos_embed",
           "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
           "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
           "post_layernorm.weight": "norm.weight", "post_layernorm.bias": "norm.bias"}  # fmt: skip
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("vision_model."):
            name = key.removeprefix("vision_model.")
            if name in top:
                name = top[name]
            else:
                _, _, i, rest = name.split(".", 3)  # encoder.layers.{i}.{module}.{weight|bias}
                module, kind = rest.rsplit(".", 1)
                name = f"blocks.{i}.{block[module]}.{kind}"
            out["blip.visual_encoder." + name] = value
        elif key.startswith("text_encoder."):
            out["blip." + key] = value
        else:
            out[key] = value  # mlp.layers.*
    out["blip.text_encoder.embeddings.position_ids"] = torch.arange(64)[None]
    out["blip.vision_proj.weight"], out["blip.text_proj.weight"] = torch.zeros(8, 32), torch.zeros(8, 32)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, ImageReward.pt, config dir, tokenizer dir) of a tiny BLIP (ViT 16 px, BERT 2 layers)."""
    from transformers import BertTokenizer, BlipConfig

    root = tmp_path_factory.mktemp("tiny_imagereward")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz"]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(str(root / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(root / "tokenizer")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=4, layer_norm_eps=1e-6)  # fmt: skip
    text = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, encoder_hidden_size=32, is_decoder=True,
                pad_token_id=0, bos_token_id=2, sep_token_id=3)  # fmt: skip
    config = BlipConfig(text_config=text, vision_config=vision)
    config.save_pretrained(root / "config")
    torch.manual_seed(0)
    model = ImageRewardModel(config).eval()
    with torch.no_grad():
        for layer in model.mlp.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.normal_(0, 0.5)  # a head that passes differences through
    torch.save(_upstream_layout(model), root / "ImageReward.pt")
    return model, root / "ImageReward.pt", root / "config", root / "tokenizer"


def _reward(tiny, **overrides):
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
    return build_reward("imagereward", **kwargs)


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 20, 24, generator=torch.Generator().manual_seed(seed))


def test_scores_are_the_standardised_head_on_cls(tiny):
    model, *_ = tiny
    reward = _reward(tiny)
    prompts, images = ["a red cat", "two blue car on the sofa"], _images(2)
    result = reward.score(RewardBatch(prompts=prompts, images=images))
    assert result.scores.shape == (2,) and result.scores.dtype == torch.float32
    # By hand with the original model's towers: image tokens, cross-attending text, [CLS], head, standardise.
    from rlgen_cli.rewards.imagereward import imagereward_pixel_values

    tokens = reward._tokenizer(
        prompts, padding="max_length", max_length=35, truncation=True, return_tensors="pt"
    )
    assert tokens["input_ids"].shape == (2, 35) and bool(
        (tokens["input_ids"][:, 0] == 2).all()
    )  # [CLS] first
    with torch.no_grad():
        image_tokens = model.vision_model(
            imagereward_pixel_values(images, reward._image_size)
        ).last_hidden_state
        cls = model.text_encoder(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            encoder_hidden_states=image_tokens,
            is_decoder=False,
        ).last_hidden_state[:, 0]
        expected = (model.mlp(cls).squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD
    torch.testing.assert_close(result.scores, expected, atol=1e-5, rtol=1e-5)
    assert abs(float(result.scores[0] - result.scores[1])) > 1e-3


def test_a_constant_head_gives_the_standardised_constant(tiny, tmp_path):
    model, *_ = tiny
    state = _upstream_layout(model)
    for key in [k for k in state if k.startswith("mlp.layers.")]:
        state[key] = torch.zeros_like(state[key])
    state["mlp.layers.7.bias"] = torch.tensor([1.2])
    torch.save(state, tmp_path / "ImageReward.pt")
    scores = _reward(tiny, model_path=str(tmp_path / "ImageReward.pt")).score(
        RewardBatch(prompts=["a cat", "a dog"], images=_images(2))
    )
    # (1.2 − 0.16717362830052426) / 1.0333394966054072 = 0.99950…
    torch.testing.assert_close(scores.scores, torch.full((2,), 0.999502), atol=1e-5, rtol=0)


def test_identical_pairs_score_equally_and_images_matter(tiny):
    reward = _reward(tiny)
    image = _images(1)
    twins = reward.score(RewardBatch(prompts=["a cat"] * 2, images=image.repeat(2, 1, 1, 1))).scores
    assert twins[0] == pytest.approx(float(twins[1]), abs=1e-5)
    other = reward.score(RewardBatch(prompts=["a cat"] * 2, images=torch.cat([image, 1 - image]))).scores
    assert abs(float(other[0] - other[1])) > 1e-4  # the text attends to the image tokens


def test_converter_maps_blip_vit_names():
    out = imagereward_state_dict(
        {
            "blip.visual_encoder.blocks.3.attn.qkv.weight": torch.zeros(1),
            "blip.visual_encoder.blocks.3.norm2.bias": torch.zeros(1),
            "blip.visual_encoder.cls_token": torch.zeros(1),
            "blip.text_encoder.encoder.layer.0.crossattention.self.key.weight": torch.zeros(1),
            "blip.vision_proj.weight": torch.zeros(1),
        }
    )
    assert sorted(out) == [
        "text_encoder.encoder.layer.0.crossattention.self.key.weight",
        "vision_model.embeddings.class_embedding",
        "vision_model.encoder.layers.3.layer_norm2.bias",
        "vision_model.encoder.layers.3.self_attn.qkv.weight",
    ]
    with pytest.raises(ValueError, match="blip.text_decoder"):
        imagereward_state_dict({"blip.text_decoder.cls.weight": torch.zeros(1)})


def test_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"model_path=.*ImageReward\.pt.*huggingface\.co/THUDM/ImageReward"):
        build_reward("imagereward", model_path=str(tmp_path / "ImageReward.pt"))
    with pytest.raises(ValueError, match="no kwarg 'download_root'"):
        build_reward("imagereward", download_root="x")


def test_config_kwargs_are_valid():
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "imagereward.yaml"))
    assert cfg["weights"] == {"imagereward": 1.0}
    assert ImageRewardKwargs(**cfg["kwargs"]["imagereward"]).model_path == "THUDM/ImageReward/ImageReward.pt"
