"""Local VLM rubric judge (``qwenvl``) and the score parsers shared with remote judges.

``qwenvl`` follows Flow-GRPO's Qwen2.5-VL scorer (Qwen2.5-VL: Bai et al. 2025, "Qwen2.5-VL Technical
Report"): each image is shown to the VLM with a 1–5 rubric prompt, the answer is decoded greedily and
``<Score>X</Score>`` is parsed; the reward is ``X / 5``. An answer without a valid score is ``NaN``,
counted in ``details["unparsed"]`` and logged, never silently 0 (upstream scores it 0).

:func:`parse_final_score` parses UnifiedReward's ``Final Score: x`` (Wang et al. 2025, "Unified Reward
Model for Multimodal Understanding and Generation") for the OpenAI-compatible judge clients.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.clip import resolve_device, resolve_dtype, to_pil_images
from rlgen_cli.rewards.registry import register
from rlgen_cli.rewards.requirements import ModelSource

logger = logging.getLogger(__name__)

__all__ = ["QwenVLJudge", "build_messages", "parse_final_score", "parse_score_tag", "qwenvl"]

QWENVL_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
SCORE_MAX = 5.0
DEFAULT_RUBRIC = """You are an expert judge of image quality. Rate the aesthetic quality of the image:
1. Bad: extremely blurry or noisy, subject indiscernible, chaotic composition.
2. Poor: noticeable blur, poor lighting, washed-out colours, awkward or cut-off composition.
3. Fair: in focus with adequate lighting, dull colours, decent but uninspired composition.
4. Good: sharp, well exposed, vivid colours, thoughtful composition with a clear focal point.
5. Excellent: exceptional clarity, perfect exposure, rich colours, masterful, emotionally striking.
Answer with the score only, as <Score>X</Score> where X is an integer from 1 to 5."""
# Tokens an untrained or confused VLM must never emit while answering in text.
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>")
_NUMBER = r"([-+]?\d+(?:\.\d+)?)"
_SCORE_TAG = re.compile(rf"<Score>\s*{_NUMBER}\s*</Score>", re.IGNORECASE)
_FINAL_SCORE = re.compile(rf"Final\s+Score\s*[:：]\s*\**\s*{_NUMBER}", re.IGNORECASE)


def _last_in_range(pattern: re.Pattern[str], text: str, low: float, high: float) -> float | None:
    """Return the last number ``pattern`` captures in ``text`` if it lies in ``[low, high]``."""
    matches = pattern.findall(text or "")
    if not matches:
        return None
    value = float(matches[-1])
    return value if math.isfinite(value) and low <= value <= high else None


def parse_score_tag(text: str, low: float = 1.0, high: float = SCORE_MAX) -> float | None:
    """Parse the last ``<Score>X</Score>`` of a judge answer.

    Args:
        text: Decoded VLM answer.
        low: Smallest valid score.
        high: Largest valid score.

    Returns:
        ``X`` as a float, or ``None`` if there is no tag or ``X`` is outside ``[low, high]``.
    """
    return _last_in_range(_SCORE_TAG, text, low, high)


def parse_final_score(text: str, low: float = 1.0, high: float = SCORE_MAX) -> float | None:
    """Parse the last ``Final Score: x`` (UnifiedReward's format; markdown bold tolerated).

    Args:
        text: Decoded judge answer.
        low: Smallest valid score.
        high: Largest valid score.

    Returns:
        ``x`` as a float, or ``None`` if absent or outside ``[low, high]``.
    """
    return _last_in_range(_FINAL_SCORE, text, low, high)


def build_messages(rubric: str, prompt: str) -> list[dict[str, Any]]:
    """Build the one-turn chat for one image: the image first, then the rubric text.

    A ``{prompt}`` placeholder in the rubric is replaced by the generation prompt, so prompt-aware
    rubrics (e.g. alignment) work with the same judge.

    Args:
        rubric: Rubric text asking for ``<Score>X</Score>``.
        prompt: The prompt the image was generated from.

    Returns:
        ``[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ...}]}]``.
    """
    text = rubric.replace("{prompt}", prompt)
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


class QwenVLJudge:
    """Score images with a local Qwen2/2.5/3-VL answering a 1–5 rubric: ``X / 5``, ``NaN`` if unparsable.

    Attributes:
        name: Registry name.
        rubric: The rubric prompt.
        max_new_tokens: Decoding budget per answer.
        batch_size: Images per ``generate`` call.
    """

    def __init__(
        self,
        model_path: str = QWENVL_MODEL,
        device: str | None = None,
        dtype: str = "bfloat16",
        local_files_only: bool = False,
        rubric: str = DEFAULT_RUBRIC,
        max_new_tokens: int = 32,
        batch_size: int = 8,
        name: str = "qwenvl",
    ) -> None:
        """Configure the judge; the model loads on the first :meth:`score`.

        Args:
            model_path: Hub id or local directory of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint
                (loaded through the Auto classes, e.g. ``Qwen/Qwen3-VL-8B-Instruct``).
            device: Device; ``None`` = CUDA when available, else CPU.
            dtype: Weight dtype name.
            local_files_only: Load only from local files / the HF cache.
            rubric: Rubric text; must ask for ``<Score>X</Score>``; ``{prompt}`` is substituted.
            max_new_tokens: Tokens to decode; raise it (≈ 512) for rubrics that ask for reasoning first.
            batch_size: Images per ``generate`` call.
            name: Registry name.

        Raises:
            ValueError: If ``max_new_tokens`` or ``batch_size`` is not positive.
        """
        if max_new_tokens < 1 or batch_size < 1:
            raise ValueError(
                f"max_new_tokens and batch_size must be ≥ 1, got {max_new_tokens}, {batch_size}."
            )
        self.name, self.rubric = name, rubric
        self.model_path, self.local_files_only = str(model_path), bool(local_files_only)
        self.device, self.dtype = resolve_device(device), resolve_dtype(dtype)
        self.max_new_tokens, self.batch_size = int(max_new_tokens), int(batch_size)
        self._model: Any = None
        self._processor: Any = None

    def requirements(self) -> list[ModelSource]:
        """The judge model :meth:`load` reads (``rewards/requirements.py``)."""
        return [
            ModelSource(
                f"reward.kwargs.{self.name}.model_path",
                self.model_path,
                local_files_only=self.local_files_only,
            )
        ]

    def load(self) -> tuple[Any, Any]:
        """Load (once) and return ``(model, processor)``; the tokenizer pads on the left for generation."""
        if self._model is None:
            from transformers import AutoModelForImageTextToText, AutoProcessor

            logger.info("loading VLM judge %s on %s (%s)", self.model_path, self.device, self.dtype)
            model = AutoModelForImageTextToText.from_pretrained(
                self.model_path, dtype=self.dtype, local_files_only=self.local_files_only
            )
            self._processor = AutoProcessor.from_pretrained(
                self.model_path, local_files_only=self.local_files_only
            )
            self._processor.tokenizer.padding_side = "left"
            self._model = model.to(self.device).eval().requires_grad_(False)
        return self._model, self._processor

    def _suppressed_ids(self, tokenizer: Any) -> list[int]:
        """Ids of the vision placeholder tokens the tokenizer knows (never valid in an answer)."""
        vocab = tokenizer.get_vocab()
        return [vocab[token] for token in _VISION_TOKENS if token in vocab]

    @torch.no_grad()
    def answer(self, images: Tensor, prompts: list[str]) -> list[str]:
        """Greedy-decode the judge's answer for each (image, prompt).

        Args:
            images: ``(B, 3, H, W)`` float images in [0, 1].
            prompts: The B generation prompts (used by ``{prompt}`` rubrics).

        Returns:
            The B decoded answers, special tokens stripped.
        """
        model, processor = self.load()
        texts = [
            processor.apply_chat_template(
                build_messages(self.rubric, p), tokenize=False, add_generation_prompt=True
            )
            for p in prompts
        ]
        inputs = processor(text=texts, images=to_pil_images(images), padding=True, return_tensors="pt").to(
            self.device
        )
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        generated = model.generate(
            **inputs,
            do_sample=False,  # greedy; top_k/top_p/temperature set explicitly so no generate default applies
            top_k=None,
            top_p=None,
            temperature=None,
            repetition_penalty=1.0,
            max_new_tokens=self.max_new_tokens,
            suppress_tokens=self._suppressed_ids(processor.tokenizer) or None,
        )
        new_tokens = generated[:, inputs["input_ids"].shape[1] :]
        return processor.batch_decode(new_tokens, skip_special_tokens=True)

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score every image of ``batch``.

        Returns:
            ``scores`` = ``X / 5`` (``NaN`` where no valid ``<Score>`` was found); ``details`` holds the
            raw ``answers`` and ``unparsed`` (1.0 per unparsable answer).

        Raises:
            ValueError: If the batch has no ``(B, 1|3, H, W)`` images.
        """
        images = batch.images
        if images is None or images.ndim != 4 or images.shape[1] not in (1, 3):
            shape = None if images is None else tuple(images.shape)
            raise ValueError(
                f"reward {self.name!r} needs images (B, C, H, W) with C in {{1, 3}}, got {shape}."
            )
        answers: list[str] = []
        for start in range(0, len(batch), self.batch_size):
            stop = start + self.batch_size
            answers += self.answer(images[start:stop], list(batch.prompts[start:stop]))
        parsed = [parse_score_tag(a) for a in answers]
        scores = torch.tensor([math.nan if x is None else x / SCORE_MAX for x in parsed], dtype=torch.float32)
        unparsed = torch.tensor([float(x is None) for x in parsed], dtype=torch.float32)
        if unparsed.any():
            logger.warning(
                "reward %r: %d of %d answers had no valid <Score>1-5</Score> (scored NaN), e.g. %r",
                self.name,
                int(unparsed.sum()),
                len(answers),
                answers[int(unparsed.argmax())][:200],
            )
        return RewardResult(scores=scores, details={"answers": answers, "unparsed": unparsed})


@dataclass
class QwenVLKwargs:
    """``reward.kwargs.qwenvl`` (args as :class:`QwenVLJudge`)."""

    model_path: str = QWENVL_MODEL
    device: str | None = None
    dtype: str = "bfloat16"
    local_files_only: bool = False
    rubric: str = DEFAULT_RUBRIC
    max_new_tokens: int = 32
    batch_size: int = 8


@register("qwenvl", kwargs=QwenVLKwargs)
def qwenvl(
    model_path: str = QWENVL_MODEL,
    device: str | None = None,
    dtype: str = "bfloat16",
    local_files_only: bool = False,
    rubric: str = DEFAULT_RUBRIC,
    max_new_tokens: int = 32,
    batch_size: int = 8,
) -> QwenVLJudge:
    """Build the local Qwen2.5-VL rubric judge (``X / 5``). Args as :class:`QwenVLJudge`."""
    return QwenVLJudge(model_path, device, dtype, local_files_only, rubric, max_new_tokens, batch_size)
