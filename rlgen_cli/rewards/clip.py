"""CLIP-based local rewards: PickScore, CLIPScore, LAION aesthetic, image similarity.

* ``pickscore``: PickScore_v1 (Kirstain et al. 2023, "Pick-a-Pic: An Open Dataset of User Preferences
  for Text-to-Image Generation"), a CLIP-H fine-tune: ``logit_scale · cos(image, text) / 26``.
* ``clipscore``: CLIP ViT-L/14 (Radford et al. 2021) image–text agreement as in CLIPScore (Hessel et
  al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image Captioning"): ``diag(logits) / 30``.
* ``aesthetic``: the LAION aesthetic predictor (C. Schuhmann, "improved-aesthetic-predictor",
  ``sac+logos+ava1-l14-linearMSE.pth``): an MLP head on L2-normalised CLIP ViT-L/14 image features, ≈ 1–10.
* ``image_similarity``: cosine of CLIP image embeddings of the edited and the source image; with N
  sources per sample (multi-image editing), the mean of its cosines with each source.

Models load lazily on the first ``score`` from a hub id or a local path (``local_files_only`` is passed
through) and are shared through a small LRU cache keyed by (path, device, dtype), so two rewards on the
same CLIP checkpoint load it once. Images are preprocessed in torch (no PIL round trip) with the
processor's own size, crop, mean and std; see :func:`clip_pixel_values`.

Videos ``(B, C, F, H, W)`` (Wan): ``pickscore``, ``clipscore`` and ``aesthetic`` score every frame (each
against its sample's prompt) and take the mean over the frames.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlgen_cli.rewards.base import RewardBatch, RewardResult, all_finite, source_stack
from rlgen_cli.rewards.registry import register
from rlgen_cli.rewards.requirements import ModelSource

logger = logging.getLogger(__name__)

__all__ = [
    "AestheticHead", "ClipReward", "clear_model_cache", "clip_pixel_values",
    "load_aesthetic_head", "load_clip_model", "load_clip_processor", "resolve_device", "resolve_dtype",
    "to_pil_images",
]  # fmt: skip

PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
CLIP_L14 = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD_URL = "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac%2Blogos%2Bava1-l14-linearMSE.pth"
PICKSCORE_SCALE = 26.0  # upstream Flow-GRPO divides PickScore by 26
CLIPSCORE_SCALE = 30.0  # and CLIP logits by 30
_INTERPOLATION = {2: "bilinear", 3: "bicubic"}  # PIL resample codes the torch path reproduces


def resolve_device(device: str | torch.device | None) -> str:
    """Return ``device`` as a string, defaulting to CUDA when available, else ``"cpu"``. CUDA without an
    index becomes ``cuda:K``, K the device current now: a reward is built in the process's main thread,
    where the launcher selected this process's GPU, but loads its model and scores on a worker thread,
    whose current CUDA device is 0 (it is per thread) — every process would put its reward on GPU 0."""
    resolved = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return str(resolved)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn ``"float32"``/``"bfloat16"``/``"float16"`` (or a ``torch.dtype``) into a ``torch.dtype``.

    Raises:
        ValueError: If the name is not a floating torch dtype.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16.")
    return resolved


@functools.lru_cache(maxsize=4)
def load_clip_model(path: str, device: str, dtype: torch.dtype, local_files_only: bool) -> Any:
    """Load a ``transformers.CLIPModel`` (hub id or directory) once per key; eval mode, no gradients."""
    from transformers import CLIPModel

    logger.info("loading CLIP model %s on %s (%s)", path, device, dtype)
    model = CLIPModel.from_pretrained(path, dtype=dtype, local_files_only=local_files_only)
    return model.to(device).eval().requires_grad_(False)


@functools.lru_cache(maxsize=4)
def load_clip_processor(path: str, local_files_only: bool) -> Any:
    """Load (once per path) the ``CLIPProcessor`` (image processor + tokenizer) of a checkpoint."""
    from transformers import CLIPProcessor

    return CLIPProcessor.from_pretrained(path, local_files_only=local_files_only)


def clear_model_cache() -> None:
    """Drop every cached CLIP model and processor (frees their memory once no reward holds them)."""
    load_clip_model.cache_clear()
    load_clip_processor.cache_clear()


def _field(size: Any, key: str) -> int | None:
    """Read ``key`` from a size spec that is a ``dict`` (transformers 4) or a ``SizeDict`` (5)."""
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def _resize_shortest_edge(images: Tensor, shortest: int, mode: str) -> Tensor:
    """Resize so the short side is ``shortest`` (long side ``int(shortest·long/short)``, as transformers)."""
    height, width = images.shape[-2:]
    short, long = (height, width) if height <= width else (width, height)
    new_long = int(shortest * long / short)
    size = (shortest, new_long) if height <= width else (new_long, shortest)
    return F.interpolate(images, size=size, mode=mode, antialias=True, align_corners=False).clamp(0, 1)


def _center_crop(images: Tensor, height: int, width: int) -> Tensor:
    """Centre-crop ``(B, C, H, W)`` to ``(height, width)``, padding with zeros if it is smaller."""
    pad_h, pad_w = max(height - images.shape[-2], 0), max(width - images.shape[-1], 0)
    if pad_h or pad_w:
        images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
    top = (images.shape[-2] - height) // 2
    left = (images.shape[-1] - width) // 2
    return images[..., top : top + height, left : left + width]


def to_pil_images(images: Tensor) -> list[Any]:
    """Quantise ``(B, 1|3, H, W)`` floats in [0, 1] (``round(x·255)``) to RGB PIL images."""
    from PIL import Image

    arrays = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    return [Image.fromarray(a.expand(3, -1, -1).permute(1, 2, 0).numpy()) for a in arrays]


def clip_pixel_values(images: Tensor, processor: Any) -> Tensor:
    """Preprocess ``(B, 3, H, W)`` float images in [0, 1] for a CLIP model, in torch.

    Resizes the short side (bicubic/bilinear with antialiasing), centre-crops and normalises with the
    processor's own ``size``, ``crop_size``, ``image_mean`` and ``image_std``. A processor whose
    settings this cannot reproduce (another resize rule or resample) gets the PIL path instead.

    Args:
        images: ``(B, C, H, W)`` with ``C`` in {1, 3}, values in [0, 1], on any device.
        processor: A ``CLIPProcessor`` or a bare ``CLIPImageProcessor``.

    Returns:
        ``(B, 3, h, w)`` float32 pixel values on the device of ``images``.
    """
    ip = getattr(processor, "image_processor", processor)
    images = images.float().clamp(0, 1)
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    resample = getattr(ip, "resample", 3)
    mode = _INTERPOLATION.get(int(getattr(resample, "value", resample)))
    shortest = _field(ip.size, "shortest_edge") if getattr(ip, "do_resize", True) else None
    if mode is None or (getattr(ip, "do_resize", True) and shortest is None):
        return ip(images=to_pil_images(images), return_tensors="pt")["pixel_values"].to(images.device)
    if shortest is not None:
        images = _resize_shortest_edge(images, int(shortest), mode)
    if getattr(ip, "do_center_crop", False):
        images = _center_crop(images, int(_field(ip.crop_size, "height")), int(_field(ip.crop_size, "width")))
    if getattr(ip, "do_normalize", True):
        mean = torch.tensor(ip.image_mean, device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(ip.image_std, device=images.device).view(1, -1, 1, 1)
        images = (images - mean) / std
    return images


def _pooled(output: Any) -> Tensor:
    """Projected embeddings from ``get_*_features`` (a tensor in transformers 4, an output object in 5)."""
    return output if isinstance(output, Tensor) else output.pooler_output


def _check_images(images: Tensor | None, reward_name: str, field_name: str = "images") -> Tensor:
    """Check for a ``(B, 1|3, H, W)`` finite image batch.

    Raises:
        ValueError: If images are missing, not 4-D with 1 or 3 channels, or not finite.
    """
    if images is None:
        hint = (
            "pass the edit task's source images" if field_name == "ref_images" else "decode the samples first"
        )
        raise ValueError(f"reward {reward_name!r} needs RewardBatch.{field_name} but it is None; {hint}.")
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(
            f"reward {reward_name!r} expects {field_name} (B, C, H, W) with C in {{1, 3}}, got "
            f"{tuple(images.shape)}; videos (B, C, F, H, W) are scored frame by frame by pickscore, "
            "clipscore and aesthetic."
        )
    if not all_finite(images):
        raise ValueError(f"reward {reward_name!r} got non-finite values in {field_name}; check the decoder.")
    return images


class AestheticHead(nn.Module):
    """The LAION improved-aesthetic-predictor MLP: 768→1024→128→64→16→1, dropout, no activations."""

    def __init__(self, input_size: int = 768) -> None:
        """Create the head (upstream state-dict keys ``layers.{0,2,4,6,7}.{weight,bias}``)."""
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: Tensor) -> Tensor:
        """Map ``(B, D)`` normalised CLIP image embeddings to ``(B, 1)`` scores."""
        return self.layers(embeddings)


def load_aesthetic_head(path: str | Path) -> AestheticHead:
    """Load the aesthetic head from a local ``.pth`` (or ``.safetensors``) state dict.

    The input width is read from ``layers.0.weight`` (768 for the upstream CLIP ViT-L/14 head).

    Raises:
        ValueError: If the file does not exist or its keys/shapes do not match the head.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(
            f"aesthetic head file {str(path)!r} not found; download sac+logos+ava1-l14-linearMSE.pth "
            f"from {AESTHETIC_HEAD_URL} and set head_path to it."
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    try:
        head = AestheticHead(int(state["layers.0.weight"].shape[1]))
        head.load_state_dict(state)
    except (KeyError, RuntimeError) as err:
        raise ValueError(
            f"{path} is not an improved-aesthetic-predictor head (keys layers.0.weight … layers.7.bias): {err!r}"
        ) from err
    return head.eval().requires_grad_(False)


PROMPT_KINDS = ("pickscore", "clipscore")
"""The kinds that score an image against its prompt (aesthetic: the image alone; image_similarity: against
its source image)."""


class ClipReward:
    """One CLIP-based reward; ``kind`` picks the score (see the module docstring).

    Attributes:
        name: Registry name (``kind``).
        kind: ``"pickscore"``, ``"clipscore"``, ``"aesthetic"`` or ``"image_similarity"``.
    """

    def __init__(
        self,
        kind: str,
        model_path: str,
        processor_path: str | None = None,
        device: str | None = None,
        dtype: str = "float32",
        local_files_only: bool = False,
        head: AestheticHead | None = None,
    ) -> None:
        """Configure the reward; nothing is loaded until the first :meth:`score`.

        Args:
            kind: Which score to compute; also the registry name.
            model_path: Hub id or local directory of the CLIP model.
            processor_path: Hub id or directory of the processor; defaults to ``model_path``.
            device: Device for the model; ``None`` = CUDA when available, else CPU.
            dtype: Weight dtype name.
            local_files_only: Load only from local files / the HF cache.
            head: Aesthetic head (``kind == "aesthetic"`` only).
        """
        self.name, self.kind, self.head = kind, kind, head
        self.reads_prompts = kind in PROMPT_KINDS
        self.model_path = str(model_path)
        self.processor_path = str(processor_path or model_path)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.local_files_only = bool(local_files_only)
        if head is not None:
            self.head = head.to(self.device)

    def requirements(self) -> list[ModelSource]:
        """The CLIP model and processor :meth:`load` reads (``rewards/requirements.py``)."""
        key = f"reward.kwargs.{self.name}"
        sources = [ModelSource(f"{key}.model_path", self.model_path, local_files_only=self.local_files_only)]
        if self.processor_path != self.model_path:
            sources.append(
                ModelSource(
                    f"{key}.processor_path", self.processor_path, local_files_only=self.local_files_only
                )
            )
        return sources

    def load(self) -> None:
        """Load the model and the processor now rather than on the first score (a reward server)."""
        _ = self.model, self.processor

    @property
    def model(self) -> Any:
        """The (cached) ``CLIPModel``, loaded on first use."""
        return load_clip_model(self.model_path, self.device, self.dtype, self.local_files_only)

    @property
    def processor(self) -> Any:
        """The (cached) ``CLIPProcessor``, loaded on first use."""
        return load_clip_processor(self.processor_path, self.local_files_only)

    def image_embeddings(self, images: Tensor) -> Tensor:
        """L2-normalised float32 image embeddings ``(B, D)``."""
        pixels = clip_pixel_values(images.to(self.device), self.processor).to(self.dtype)
        embeds = _pooled(self.model.get_image_features(pixel_values=pixels)).float()
        return F.normalize(embeds, dim=-1)

    def text_embeddings(self, prompts: list[str]) -> Tensor:
        """L2-normalised float32 text embeddings ``(B, D)`` (truncated to the model's context)."""
        tokenizer = self.processor.tokenizer
        max_length = min(tokenizer.model_max_length, self.model.config.text_config.max_position_embeddings)
        tokens = tokenizer(prompts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        tokens = {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}
        return F.normalize(_pooled(self.model.get_text_features(**tokens)).float(), dim=-1)

    def source_similarity(self, embeddings: Tensor, ref_images: Tensor | None) -> Tensor:
        """``(B,)`` cosine of each sample's embedding with its source's, averaged over N sources when
        ``ref_images`` is ``(B, N, C, H, W)`` (the rule of :mod:`rlgen_cli.rewards.base`)."""
        if ref_images is None:
            _check_images(None, self.name, "ref_images")  # raises, saying what to pass
        sources = source_stack(ref_images, self.name)
        count = sources.shape[1]
        refs = self.image_embeddings(_check_images(sources.flatten(0, 1), self.name, "ref_images"))
        return (refs.view(-1, count, refs.shape[-1]) * embeddings.unsqueeze(1)).sum(-1).mean(1)

    def frames_of(self, images: Tensor | None) -> tuple[Tensor | None, int]:
        """``(B·F, C, H, W)`` frames of videos ``(B, C, F, H, W)`` (sample by sample) and F; an image
        batch is its own frames (F = 1)."""
        if images is None or images.ndim != 5:
            return images, 1
        if self.kind == "image_similarity":
            raise ValueError(
                f"reward {self.name!r} compares images with their sources; it does not score videos "
                f"{tuple(images.shape)} (pickscore, clipscore and aesthetic score them frame by frame)."
            )
        b, c, f, h, w = images.shape
        return images.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w), f

    @torch.no_grad()
    def score(self, batch: RewardBatch) -> RewardResult:
        """Score ``batch``; returns float32 CPU scores and ``details["cosine"]`` where defined. A video
        scores each frame against its prompt and takes the mean over its frames (score and cosine).

        Raises:
            ValueError: If the images (or, for ``image_similarity``, the reference images) are unusable.
        """
        frames, count = self.frames_of(batch.images)
        result = self._score_images(batch, frames, count)
        if count == 1:
            return result
        details = {k: v.view(-1, count).mean(1) for k, v in result.details.items()}
        return RewardResult(scores=result.scores.view(-1, count).mean(1), details=details)

    def _score_images(self, batch: RewardBatch, frames: Tensor | None, count: int) -> RewardResult:
        """Per-image scores of ``frames`` (B·count images; each prompt repeated over its count frames)."""
        images = self.image_embeddings(_check_images(frames, self.name))
        details: dict[str, Any] = {}
        if self.kind == "aesthetic":
            if images.shape[-1] != (width := self.head.layers[0].in_features):
                raise ValueError(
                    f"aesthetic head expects {width}-d CLIP features, {self.model_path} gives "
                    f"{images.shape[-1]}-d; use the CLIP the head was trained on (ViT-L/14 for LAION's)."
                )
            scores = self.head(images).squeeze(-1)
        elif self.kind == "image_similarity":
            scores = self.source_similarity(images, batch.ref_images)
        else:
            texts = self.text_embeddings(list(batch.prompts)).repeat_interleave(count, dim=0)
            cosine = (images * texts).sum(-1)
            logits = self.model.logit_scale.exp().float() * cosine
            scores = logits / (PICKSCORE_SCALE if self.kind == "pickscore" else CLIPSCORE_SCALE)
            details["cosine"] = cosine.cpu()
        return RewardResult(scores=scores.float().cpu(), details=details)


@dataclass
class ClipKwargs:
    """``reward.kwargs.clipscore`` / ``image_similarity`` (args as :class:`ClipReward`)."""

    model_path: str = CLIP_L14
    device: str | None = None
    dtype: str = "float32"
    local_files_only: bool = False


@dataclass
class PickScoreKwargs(ClipKwargs):
    """``reward.kwargs.pickscore``."""

    model_path: str = PICKSCORE_MODEL
    processor_path: str = PICKSCORE_PROCESSOR


@dataclass
class AestheticKwargs(ClipKwargs):
    """``reward.kwargs.aesthetic`` (see :func:`aesthetic`)."""

    head_path: str | None = None


@register("pickscore", kwargs=PickScoreKwargs)
def pickscore(
    model_path: str = PICKSCORE_MODEL,
    processor_path: str = PICKSCORE_PROCESSOR,
    device: str | None = None,
    dtype: str = "float32",
    local_files_only: bool = False,
) -> ClipReward:
    """PickScore_v1: ``logit_scale · cos / 26`` (≈ 0.8–0.92). Args as :class:`ClipReward`."""
    return ClipReward("pickscore", model_path, processor_path, device, dtype, local_files_only)


@register("clipscore", kwargs=ClipKwargs)
def clipscore(
    model_path: str = CLIP_L14,
    device: str | None = None,
    dtype: str = "float32",
    local_files_only: bool = False,
) -> ClipReward:
    """CLIP ViT-L/14 ``diag(logits_per_image) / 30``. Args as :class:`ClipReward`."""
    return ClipReward("clipscore", model_path, None, device, dtype, local_files_only)


@register("image_similarity", kwargs=ClipKwargs)
def image_similarity(
    model_path: str = CLIP_L14,
    device: str | None = None,
    dtype: str = "float32",
    local_files_only: bool = False,
) -> ClipReward:
    """Cosine of CLIP image embeddings of ``images`` and ``ref_images`` (with N sources per sample: the
    mean over them). Args as :class:`ClipReward`."""
    return ClipReward("image_similarity", model_path, None, device, dtype, local_files_only)


@register("aesthetic", kwargs=AestheticKwargs)
def aesthetic(
    head_path: str | None = None,
    model_path: str = CLIP_L14,
    device: str | None = None,
    dtype: str = "float32",
    local_files_only: bool = False,
) -> ClipReward:
    """LAION aesthetic score (≈ 1–10) from a local head file on CLIP ViT-L/14 features.

    Args:
        head_path: Local ``sac+logos+ava1-l14-linearMSE.pth`` (state dict ``layers.0.weight`` …).
        model_path: CLIP ViT-L/14 hub id or directory.
        device: Device; ``None`` = CUDA when available.
        dtype: CLIP weight dtype (the head runs in float32).
        local_files_only: Load CLIP only from local files.

    Raises:
        ValueError: If ``head_path`` is missing or not a valid head.
    """
    if not head_path:
        raise ValueError(
            "reward 'aesthetic' needs head_path: download sac+logos+ava1-l14-linearMSE.pth from "
            f"{AESTHETIC_HEAD_URL} and set reward.kwargs.aesthetic.head_path to the local file."
        )
    head = load_aesthetic_head(head_path)
    return ClipReward("aesthetic", model_path, None, device, dtype, local_files_only, head=head)
