"""HPSv2 and HPSv2.1 (Wu et al. 2023, "Human Preference Score v2"): a fine-tuned OpenCLIP ViT-H-14.

The score is the cosine of the L2-normalised image and prompt embeddings (no logit scale), what the
official scorer returns and what DanceGRPO / DiffusionNFT train on: ≈ 0.2–0.35. Papers print it ×100
(e.g. 27.3 for 0.273).

Weights: the published ``HPS_v2_compressed.pt`` / ``HPS_v2.1_compressed.pt`` (``{"state_dict": …}`` of an
OpenCLIP ViT-H-14), loaded into transformers' ``CLIPModel`` — the same architecture (pre-LN ViT, causal
text transformer pooled at the end-of-text token, exact GELU, LayerNorm ε 1e-5), which is why LAION ships
its own ViT-H-14 in both formats. :func:`open_clip_to_clip` converts the keys once at load:

* per block ``ln_1``/``ln_2`` → ``layer_norm1``/``layer_norm2``, ``attn.in_proj_{weight,bias}`` split in
  three along dim 0 → ``self_attn.{q,k,v}_proj``, ``attn.out_proj`` → ``self_attn.out_proj``,
  ``mlp.c_fc``/``mlp.c_proj`` → ``mlp.fc1``/``mlp.fc2``;
* ``visual.conv1`` → patch embedding, ``visual.class_embedding`` / ``visual.positional_embedding`` →
  class / position embeddings, ``visual.ln_pre`` → ``pre_layrnorm``, ``visual.ln_post`` →
  ``post_layernorm``; ``token_embedding``, ``positional_embedding``, ``ln_final`` → the text model's;
* the projections ``visual.proj`` and ``text_projection`` are matrices applied as ``x @ P``, so the
  ``Linear`` weights are their transposes; ``logit_scale`` is kept.

Preprocessing is HPSv2's evaluation transform: resize the long side to 224 (bicubic, antialiased, no
clamp), zero-pad to a centred square, normalise with the OpenAI CLIP mean and std. Prompts are cleaned as
OpenCLIP's tokenizer cleans them (:func:`openclip_clean`: ``ftfy.fix_text``, HTML entities unescaped, runs of
whitespace to one space, lower case: "don’t" becomes "don't", "&amp;" "&", "ﬁ" "fi", full-width letters
ASCII), then go through the CLIP BPE tokenizer (LAION's ViT-H-14 repository ships it), truncated to 77
tokens.
"""

from __future__ import annotations

import html
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.checkpoints import (
    check_checkpoint_path,
    check_image_batch,
    load_state_dict_file,
    materialise,
    resolve_checkpoint,
    typed_kwargs,
)
from rlgen_cli.rewards.clip import resolve_device, resolve_dtype
from rlgen_cli.rewards.registry import register
from rlgen_cli.rewards.requirements import ModelSource, kwargs_sources

logger = logging.getLogger(__name__)

__all__ = [
    "HPSV2_CHECKPOINTS", "HPSv2Kwargs", "HPSv2Reward", "hps_pixel_values", "hpsv2", "hpsv2_1",
    "open_clip_to_clip", "openclip_clean", "vit_h_14_config",
]  # fmt: skip

HPSV2_CHECKPOINTS = {
    "hpsv2": "xswu/HPSv2/HPS_v2_compressed.pt",
    "hpsv2_1": "xswu/HPSv2/HPS_v2.1_compressed.pt",
}
HPS_TOKENIZER = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
_DOWNLOAD_HINT = (
    "download HPS_v2_compressed.pt or HPS_v2.1_compressed.pt from https://huggingface.co/xswu/HPSv2 and "
    "set model_path to the local file"
)
# Within one transformer block: OpenCLIP name prefix -> transformers' name prefix.
_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
          "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}  # fmt: skip
_TOWERS = {"visual.transformer.resblocks.": "vision_model.encoder.layers.",
           "transformer.resblocks.": "text_model.encoder.layers."}  # fmt: skip
_TOP = {
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "logit_scale": "logit_scale",
}
_NORMS = {"visual.ln_pre": "vision_model.pre_layrnorm", "visual.ln_post": "vision_model.post_layernorm",
          "ln_final": "text_model.final_layer_norm"}  # fmt: skip
_TRANSPOSED = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}
_BUFFERS = {"attn_mask"}  # OpenCLIP's causal mask; transformers builds its own


def vit_h_14_config() -> Any:
    """The ``CLIPConfig`` of OpenCLIP's ViT-H-14 (HPSv2's backbone)."""
    from transformers import CLIPConfig

    text = dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu", layer_norm_eps=1e-5,
                bos_token_id=49406, eos_token_id=49407, pad_token_id=0)  # fmt: skip
    vision = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                  image_size=224, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-5)  # fmt: skip
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=1024)


def _block_entries(prefix: str, sub: str, value: Tensor) -> dict[str, Tensor]:
    """One OpenCLIP block tensor (``sub`` after ``…resblocks.{i}.``) under transformers' names."""
    if sub.startswith("attn.in_proj_"):
        kind = sub.removeprefix("attn.in_proj_")  # weight or bias
        q, k, v = value.chunk(3, dim=0)
        return {f"{prefix}self_attn.{n}_proj.{kind}": t for n, t in zip("qkv", (q, k, v))}
    for old, new in _BLOCK.items():
        if sub.startswith(old + "."):
            return {prefix + new + sub[len(old) :]: value}
    raise KeyError(sub)


def _convert_key(key: str, value: Tensor) -> dict[str, Tensor]:
    """transformers' name(s) and tensor(s) for one OpenCLIP tensor; ``KeyError`` when it has none."""
    if key in _TOP:
        return {_TOP[key]: value}
    if key in _TRANSPOSED:
        return {_TRANSPOSED[key]: value.t().contiguous()}
    for old, new in _NORMS.items():
        if key.startswith(old + "."):
            return {new + key[len(old) :]: value}
    for old, new in _TOWERS.items():
        if match := re.fullmatch(re.escape(old) + r"(\d+)\.(.+)", key):
            return _block_entries(f"{new}{match[1]}.", match[2], value)
    raise KeyError(key)


def open_clip_to_clip(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename an OpenCLIP ViT CLIP state dict to transformers' ``CLIPModel`` keys (see the module doc).

    Raises:
        ValueError: If a tensor has no counterpart (LayerScale, attention pooling, a ResNet tower …).
    """
    out: dict[str, Tensor] = {}
    unknown: list[str] = []
    for key, value in state_dict.items():
        if key.rsplit(".", 1)[-1] in _BUFFERS:
            continue
        try:
            out.update(_convert_key(key, value))
        except KeyError:
            unknown.append(key)
    if unknown:
        raise ValueError(
            f"not an OpenCLIP ViT CLIP checkpoint with a plain text tower: no counterpart for {unknown[:5]} "
            f"({len(unknown)} keys); HPSv2's HPS_v2*_compressed.pt files convert."
        )
    return out


def hps_pixel_values(images: Tensor, size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """HPSv2's evaluation transform on ``(B, 3, H, W)`` floats in [0, 1].

    The long side goes to ``size`` (short side ``round(short · size / long)``), bicubic with antialiasing
    and no clamping; the rest is zero-padded around the centre, then each channel is normalised.
    """
    height, width = images.shape[-2:]
    scale = size / max(height, width)
    new_h, new_w = round(height * scale), round(width * scale)
    if (new_h, new_w) != (height, width):
        images = F.interpolate(
            images, size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False
        )
    pad_h, pad_w = size - new_h, size - new_w
    images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
    mean_t = torch.tensor(mean, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=images.device).view(1, -1, 1, 1)
    return (images - mean_t) / std_t


def openclip_clean(text: str) -> str:
    """A prompt as OpenCLIP's ``SimpleTokenizer.encode`` sees it before BPE: ``ftfy.fix_text``, HTML
    entities unescaped twice, whitespace runs collapsed to one space, stripped, lower-cased.

    The transformers CLIP tokenizer does none of the first two (it normalises NFC, whitespace and case
    only), so without this "don’t", "&amp;" or "ﬁ" tokenise differently from what HPSv2 was trained on.
    """
    import ftfy

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip().lower()


def _unit(output: Any) -> Tensor:
    """L2-normalised float32 projected features (a tensor, or an output with ``pooler_output``)."""
    features = output if isinstance(output, Tensor) else output.pooler_output
    return F.normalize(features.float(), dim=-1)


@dataclass(frozen=True)
class HPSv2Kwargs:
    """``reward.kwargs.hpsv2`` / ``reward.kwargs.hpsv2_1``.

    Attributes:
        model_path: The HPS checkpoint: a local ``.pt`` or ``owner/repo/filename`` on the hub.
        tokenizer_path: CLIP BPE tokenizer (hub id or directory).
        config_path: ``CLIPConfig`` directory or JSON; ``None`` = OpenCLIP ViT-H-14.
        device: ``None`` = CUDA when available, else CPU.
        dtype: Weight dtype (``float32`` keeps the official scorer's numbers closest).
        local_files_only: Never reach the hub.
    """

    model_path: str = HPSV2_CHECKPOINTS["hpsv2_1"]
    tokenizer_path: str = HPS_TOKENIZER
    config_path: str | None = None
    device: str | None = None
    dtype: str = "float32"
    local_files_only: bool = False


class HPSv2Reward:
    """HPSv2 / HPSv2.1 image–prompt score (cosine); the model loads on the first :meth:`score`.

    Attributes:
        name: ``"hpsv2"`` or ``"hpsv2_1"``.
    """

    def __init__(self, name: str, kwargs: HPSv2Kwargs) -> None:
        check_checkpoint_path(kwargs.model_path, name, "model_path", _DOWNLOAD_HINT)
        self.name, self.kwargs = name, kwargs
        self.device, self.dtype = resolve_device(kwargs.device), resolve_dtype(kwargs.dtype)
        self._model: Any = None
        self._tokenizer: Any = None

    def requirements(self) -> list[ModelSource]:
        """The checkpoint, tokenizer and (when set) config :meth:`load` reads (``rewards/requirements.py``)."""
        return kwargs_sources(
            self.name, self.kwargs, files=("model_path",), dirs=("tokenizer_path", "config_path")
        )

    def _config(self) -> Any:
        """The architecture: ``config_path`` if set, else ViT-H-14."""
        if self.kwargs.config_path is None:
            return vit_h_14_config()
        from transformers import CLIPConfig

        return CLIPConfig.from_pretrained(
            self.kwargs.config_path, local_files_only=self.kwargs.local_files_only
        )

    def load(self) -> Any:
        """Read, convert and place the checkpoint and load the tokenizer (once); returns the ``CLIPModel``."""
        if self._model is None:
            from transformers import AutoTokenizer, CLIPModel

            path = resolve_checkpoint(
                self.kwargs.model_path, self.name, "model_path", _DOWNLOAD_HINT, self.kwargs.local_files_only
            )
            logger.info("loading %s from %s on %s (%s)", self.name, path, self.device, self.dtype)
            config = self._config()
            state = open_clip_to_clip(load_state_dict_file(path))
            self._model = materialise(lambda: CLIPModel(config), state, self.dtype, self.device, str(path))
            self._tokenizer = AutoTokenizer.from_pretrained(
                self.kwargs.tokenizer_path, local_files_only=self.kwargs.local_files_only
            )
        return self._model

    def image_embeddings(self, images: Tensor) -> Tensor:
        """Unit image embeddings ``(B, D)`` of ``(B, 3, H, W)`` floats in [0, 1]."""
        model = self.load()
        size = int(model.config.vision_config.image_size)
        pixels = hps_pixel_values(images.to(self.device).float(), size, OPENAI_MEAN, OPENAI_STD)
        return _unit(model.get_image_features(pixel_values=pixels.to(self.dtype)))

    def text_embeddings(self, prompts: list[str]) -> Tensor:
        """Unit prompt embeddings ``(B, D)``: prompts cleaned as OpenCLIP's (:func:`openclip_clean`),
        truncated to the model's context (77)."""
        model = self.load()
        context = int(model.config.text_config.max_position_embeddings)
        tokens = self._tokenizer(
            [openclip_clean(p) for p in prompts],
            padding=True,
            truncation=True,
            max_length=context,
            return_tensors="pt",
        )
        return _unit(
            model.get_text_features(
                input_ids=tokens["input_ids"].to(self.device),
                attention_mask=tokens["attention_mask"].to(self.device),
            )
        )

    @torch.no_grad()
    def score(self, batch: RewardBatch) -> RewardResult:
        """Cosine of image and prompt embeddings per sample (float32, CPU).

        Raises:
            ValueError: If the images are missing, not ``(B, 3, H, W)`` or not finite.
        """
        images = check_image_batch(batch.images, self.name)
        cosine = (self.image_embeddings(images) * self.text_embeddings(list(batch.prompts))).sum(-1)
        return RewardResult(scores=cosine.float().cpu())


@register("hpsv2", kwargs=HPSv2Kwargs)
def hpsv2(**kwargs: Any) -> HPSv2Reward:
    """HPSv2 (v2.0 weights by default); kwargs as :class:`HPSv2Kwargs`.

    Raises:
        ValueError: On an unknown kwarg or a missing local checkpoint.
    """
    defaults = {"model_path": HPSV2_CHECKPOINTS["hpsv2"]}
    return HPSv2Reward("hpsv2", typed_kwargs(HPSv2Kwargs, "hpsv2", defaults | kwargs))


@register("hpsv2_1", kwargs=HPSv2Kwargs)
def hpsv2_1(**kwargs: Any) -> HPSv2Reward:
    """HPSv2.1 (the weights DanceGRPO and DiffusionNFT train on); kwargs as :class:`HPSv2Kwargs`.

    Raises:
        ValueError: On an unknown kwarg or a missing local checkpoint.
    """
    return HPSv2Reward("hpsv2_1", typed_kwargs(HPSv2Kwargs, "hpsv2_1", kwargs))
