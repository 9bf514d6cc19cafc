"""ImageReward-v1.0 (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for
Text-to-Image Generation") on transformers' BLIP classes.

ImageReward is BLIP (ViT-L/16 at 224 px + a BERT-base text encoder with cross-attention to the image
tokens) and an MLP head. The prompt is tokenised with BERT's uncased WordPiece (padded to 35 tokens),
encoded while attending to every image token, and the hidden state at ``[CLS]`` goes through the head
(``768 → 1024 → 128 → 64 → 16 → 1``, no activations, the LAION aesthetic head's layout). The reward is
``(head − 0.16717) / 1.03334``: standardised over ImageReward's training set, ≈ −2…2.

Weights: the published ``ImageReward.pt`` (a state dict). Its ``blip.visual_encoder.*`` keys map onto
``BlipVisionModel`` (``cls_token`` → class embedding, ``pos_embed`` → position embedding,
``patch_embed.proj`` → patch embedding, per block ``norm1``/``norm2`` → ``layer_norm1``/``layer_norm2``,
``attn.qkv`` → ``self_attn.qkv``, ``attn.proj`` → ``self_attn.projection``, ``mlp`` as is, ``norm`` →
``post_layernorm``); ``blip.text_encoder.*`` keeps its names in ``BlipTextModel`` (both come from the
same BERT code); ``mlp.*`` is the head. BLIP's contrastive projections (``vision_proj``,
``text_proj``) are not part of the score and are dropped.

Images are preprocessed as ImageReward's ``_transform(224)`` does on the PIL images its callers (Flow-GRPO's
scorer among them) hand it: quantised to uint8, short side to 224 with PIL's bicubic (long side
``int(224 · long / short)``, truncated as torchvision computes it), centre crop of 224 with its offsets
rounded half-to-even (``round((w − 224) / 2)``: 84 px, not 83, for a 391 px side), then ``/ 255`` and the
OpenAI mean/std.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.checkpoint_reward import CheckpointReward
from rlgen_cli.rewards.checkpoints import check_image_batch, typed_kwargs
from rlgen_cli.rewards.clip import AestheticHead, to_pil_images
from rlgen_cli.rewards.registry import register
from rlgen_cli.rewards.requirements import ModelSource, kwargs_sources

__all__ = [
    "IMAGEREWARD_CHECKPOINT", "IMAGEREWARD_MEAN", "IMAGEREWARD_STD", "ImageRewardKwargs", "ImageRewardModel",
    "ImageRewardReward", "imagereward", "imagereward_config", "imagereward_pixel_values", "imagereward_state_dict",
]  # fmt: skip

IMAGEREWARD_CHECKPOINT = "THUDM/ImageReward/ImageReward.pt"
BERT_TOKENIZER = "google-bert/bert-base-uncased"
IMAGEREWARD_MEAN = 0.16717362830052426  # head output statistics over ImageReward's training data
IMAGEREWARD_STD = 1.0333394966054072
PROMPT_TOKENS = 35  # ImageReward pads / truncates every prompt to this many tokens
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
_DOWNLOAD_HINT = "download ImageReward.pt from https://huggingface.co/THUDM/ImageReward and set model_path to the local file"
_VISION_TOP = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}
_VISION_BLOCK = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.qkv": "self_attn.qkv",
                 "attn.proj": "self_attn.projection", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}  # fmt: skip
_DROPPED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")


def imagereward_config() -> Any:
    """ImageReward's BLIP: ViT-L/16 at 224 px (LayerNorm ε 1e-6) and BERT-base with cross-attention."""
    from transformers import BlipConfig

    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=224, patch_size=16, hidden_act="gelu", layer_norm_eps=1e-6)  # fmt: skip
    text = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=12, max_position_embeddings=512, encoder_hidden_size=1024, hidden_act="gelu",
                layer_norm_eps=1e-12, is_decoder=True, pad_token_id=0)  # fmt: skip
    return BlipConfig(text_config=text, vision_config=vision)


def _vision_key(key: str) -> str:
    """``BlipVisionModel`` name of a BLIP ViT tensor; ``KeyError`` when it has none."""
    if key in _VISION_TOP:
        return _VISION_TOP[key]
    if match := re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", key):
        return f"encoder.layers.{match[1]}.{_VISION_BLOCK[match[2]]}.{match[3]}"
    raise KeyError(key)


def imagereward_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an ``ImageReward.pt`` state dict to :class:`ImageRewardModel` keys (see the module doc).

    Raises:
        ValueError: If a tensor has no place in the model.
    """
    out: dict[str, Tensor] = {}
    unknown: list[str] = []
    for key, value in state_dict.items():
        if key.startswith(_DROPPED):
            continue
        try:
            if key.startswith("blip.visual_encoder."):
                out["vision_model." + _vision_key(key.removeprefix("blip.visual_encoder."))] = value
            elif key.startswith(("blip.text_encoder.", "mlp.layers.")):
                out[key.removeprefix("blip.")] = value
            else:
                raise KeyError(key)
        except KeyError:
            unknown.append(key)
    if unknown:
        raise ValueError(f"not an ImageReward checkpoint: no place for {unknown[:5]} ({len(unknown)} keys).")
    return out


def _short_side_size(height: int, width: int, size: int) -> tuple[int, int]:
    """``(h, w)`` with the short side ``size`` and the long side ``int(size · long / short)`` (torchvision's
    ``Resize(size)`` rule, which truncates)."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


def imagereward_pixel_values(images: Tensor, size: int) -> Tensor:
    """ImageReward's ``_transform(size)`` on ``(B, C, H, W)`` floats in [0, 1]: ``(B, 3, size, size)`` float32.

    Each image is quantised to uint8 (``round(x·255)``), resized with PIL's bicubic so its short side is
    ``size``, centre-cropped with offsets ``round((side − size) / 2)`` (Python's half-to-even, as
    torchvision's ``CenterCrop``), scaled by 1/255 and normalised with the OpenAI mean/std.
    """
    from PIL import Image

    mean = torch.tensor(OPENAI_MEAN).view(3, 1, 1)
    std = torch.tensor(OPENAI_STD).view(3, 1, 1)
    out = []
    for image in to_pil_images(images):
        height, width = _short_side_size(image.height, image.width, size)
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), Image.Resampling.BICUBIC)
        top, left = int(round((height - size) / 2)), int(round((width - size) / 2))
        crop = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.uint8)
        pixels = torch.from_numpy(crop.copy()).permute(2, 0, 1).float() / 255
        out.append((pixels - mean) / std)
    return torch.stack(out).to(images.device)


class ImageRewardModel(nn.Module):
    """BLIP vision + cross-attending text encoder + ImageReward's MLP head (raw, unstandardised output)."""

    def __init__(self, config: Any) -> None:
        """Build ``BlipVisionModel``, ``BlipTextModel`` (no pooler) and the head for a ``BlipConfig``."""
        from transformers import BlipTextModel, BlipVisionModel

        super().__init__()
        self.vision_model = BlipVisionModel(config.vision_config)
        self.text_encoder = BlipTextModel(config.text_config, add_pooling_layer=False)
        self.mlp = AestheticHead(int(config.text_config.hidden_size))

    def forward(self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``(B,)`` head outputs for paired images and prompt tokens."""
        image_tokens = self.vision_model(pixel_values=pixel_values).last_hidden_state
        image_mask = torch.ones(image_tokens.shape[:-1], dtype=torch.long, device=image_tokens.device)
        text = self.text_encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=image_tokens,
            encoder_attention_mask=image_mask,
            is_decoder=False,
        ).last_hidden_state
        return self.mlp(text[:, 0].float()).squeeze(-1)


@dataclass(frozen=True)
class ImageRewardKwargs:
    """``reward.kwargs.imagereward``.

    Attributes:
        model_path: ``ImageReward.pt``: a local file or ``owner/repo/filename`` on the hub.
        tokenizer_path: BERT uncased WordPiece tokenizer (hub id or directory).
        config_path: ``BlipConfig`` directory or JSON; ``None`` = ImageReward's ViT-L + BERT-base.
        device: ``None`` = CUDA when available, else CPU.
        dtype: Weight dtype of the BLIP towers (the head runs in float32).
        local_files_only: Never reach the hub.
    """

    model_path: str = IMAGEREWARD_CHECKPOINT
    tokenizer_path: str = BERT_TOKENIZER
    config_path: str | None = None
    device: str | None = None
    dtype: str = "float32"
    local_files_only: bool = False


class ImageRewardReward(CheckpointReward):
    """ImageReward-v1.0 per (prompt, image), standardised; the model loads on the first :meth:`score`.

    Attributes:
        name: ``"imagereward"``.
    """

    name = "imagereward"
    download_hint = _DOWNLOAD_HINT

    def __init__(self, kwargs: ImageRewardKwargs) -> None:
        super().__init__(kwargs)
        self._tokenizer: Any = None
        self._image_size: int | None = None

    def requirements(self) -> list[ModelSource]:
        """The checkpoint, tokenizer and (when set) config :meth:`load` reads (``rewards/requirements.py``)."""
        return kwargs_sources(
            self.name, self.kwargs, files=("model_path",), dirs=("tokenizer_path", "config_path")
        )

    def load(self) -> ImageRewardModel:
        """Read, convert and place the checkpoint, load the tokenizer (once)."""
        if self._model is None:
            from transformers import AutoTokenizer, BlipConfig

            kw = self.kwargs
            path, state = self.read_checkpoint(imagereward_state_dict)
            config = (
                imagereward_config()
                if kw.config_path is None
                else BlipConfig.from_pretrained(kw.config_path, local_files_only=kw.local_files_only)
            )
            model = self.place(lambda: ImageRewardModel(config), state, path)
            model.mlp.float()
            self._tokenizer = AutoTokenizer.from_pretrained(
                kw.tokenizer_path, local_files_only=kw.local_files_only
            )
            self._image_size = int(config.vision_config.image_size)
            self._model = model
        return self._model

    def raw_scores(self, prompts: list[str], images: Tensor) -> Tensor:
        """``(B,)`` float32 head outputs before standardisation."""
        model = self.load()
        pixels = imagereward_pixel_values(images, self._image_size).to(self.device, self.dtype)
        tokens = self._tokenizer(
            prompts, padding="max_length", truncation=True, max_length=PROMPT_TOKENS, return_tensors="pt"
        )
        ids, mask = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        return model(pixels, ids, mask).float()

    @torch.no_grad()
    def score(self, batch: RewardBatch) -> RewardResult:
        """``(head − mean) / std`` per sample (float32, CPU).

        Raises:
            ValueError: If the images are missing, not ``(B, 3, H, W)`` or not finite.
        """
        images = check_image_batch(batch.images, self.name)
        raw = self.raw_scores(list(batch.prompts), images)
        return RewardResult(scores=((raw - IMAGEREWARD_MEAN) / IMAGEREWARD_STD).cpu())


@register("imagereward", kwargs=ImageRewardKwargs)
def imagereward(**kwargs: Any) -> ImageRewardReward:
    """ImageReward-v1.0 on transformers' BLIP; kwargs as :class:`ImageRewardKwargs`.

    Raises:
        ValueError: On an unknown kwarg or a missing local checkpoint.
    """
    return ImageRewardReward(typed_kwargs(ImageRewardKwargs, "imagereward", kwargs))
