"""Core reward contracts: the batch a reward scores, the result it returns, and the protocol.

Every reward in :mod:`rlgen_cli.rewards` (local model, remote client, rule or mix) takes one
:class:`RewardBatch` and returns one :class:`RewardResult` with a score per sample. A failed sample is
an explicit ``NaN`` (counted and logged by the caller) or an exception, never a silent 0.

Edit tasks hand the source images as ``ref_images``: (B, C, H, W), or (B, N, C, H, W) when every example
has N sources (multi-image editing). A reward that compares a sample with its source compares it with
every source and averages (:func:`source_stack` gives the N axis): each source is content the edit must
keep, and no source is privileged — "picture 1" may be the subject or the scene. With N = 1 this is the
plain comparison.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = [
    "Reward", "RewardBatch", "RewardResult", "accepts_uint8", "all_finite", "check_result", "is_served",
    "reads_prompts", "source_stack",
]  # fmt: skip


def _check_length(field_name: str, actual: int, expected: int) -> None:
    """Raise if an optional batch field does not have one entry per prompt.

    Args:
        field_name: Name of the field being checked, used in the error.
        actual: Number of entries in that field.
        expected: Number of prompts in the batch.

    Raises:
        ValueError: If ``actual != expected``.
    """
    if actual != expected:
        raise ValueError(
            f"RewardBatch.{field_name} has {actual} entries but prompts has {expected}; "
            f"pass exactly one {field_name} entry per prompt (dimension 0 for tensors)."
        )


@dataclass
class RewardBatch:
    """One batch of generated samples to score.

    Attributes:
        prompts: The B prompts the samples were generated from.
        images: Images ``(B, C, H, W)`` or videos ``(B, C, F, H, W)``, float in [0, 1]. A reward that
            sets ``accepts_uint8 = True`` may also get uint8 pixels in [0, 255] (the reward server hands
            it the pixels as they came over the wire, without a float round trip).
        metadata: Per-sample metadata dicts (e.g. GenEval ``include``/``exclude``), length B.
        ref_images: Source images ``(B, C, H, W)`` for edit tasks, or ``(B, N, C, H, W)`` for N sources
            per sample (multi-image editing; compared with each and averaged, see the module docstring).
        texts: Generated texts (VLM policies, R3), length B.
    """

    prompts: list[str]
    images: Tensor | None = None  # (B, C, H, W) or (B, C, F, H, W), float in [0, 1] (or uint8, see above)
    metadata: list[dict] | None = None
    ref_images: Tensor | None = None  # (B, C, H, W) or (B, N, C, H, W): N sources per sample
    texts: list[str] | None = None

    def __post_init__(self) -> None:
        """Check that every provided field has one entry per prompt.

        Raises:
            ValueError: If a field's length differs from ``len(prompts)``.
        """
        n = len(self.prompts)
        if self.images is not None:
            _check_length("images", int(self.images.shape[0]), n)
        if self.metadata is not None:
            _check_length("metadata", len(self.metadata), n)
        if self.ref_images is not None:
            _check_length("ref_images", int(self.ref_images.shape[0]), n)
        if self.texts is not None:
            _check_length("texts", len(self.texts), n)

    def __len__(self) -> int:
        """Return the batch size B (the number of prompts)."""
        return len(self.prompts)


@dataclass
class RewardResult:
    """Scores for one :class:`RewardBatch`.

    Attributes:
        scores: ``(B,)`` float32 scores; ``NaN`` only for a sample whose scoring explicitly failed.
        details: Per-sample extras (tensors or lists of length B), logged alongside the scores.
    """

    scores: Tensor  # (B,) float32
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Check that ``scores`` is one-dimensional.

        Raises:
            ValueError: If ``scores`` is not a 1-D tensor.
        """
        if self.scores.ndim != 1:
            raise ValueError(
                f"RewardResult.scores must have shape (B,), got {tuple(self.scores.shape)}; "
                "return one scalar score per sample."
            )


@runtime_checkable
class Reward(Protocol):
    """Anything that scores a :class:`RewardBatch`.

    Attributes:
        name: Registry name of the reward, used as its key in logs and mixes.
    """

    name: str

    def score(self, batch: RewardBatch) -> RewardResult:
        """Score every sample of ``batch``.

        Args:
            batch: The samples to score.

        Returns:
            One score per sample, plus optional per-sample details.
        """
        ...


def source_stack(ref_images: Tensor, reward_name: str) -> Tensor:
    """Source images as ``(B, N, C, H, W)``: a ``(B, C, H, W)`` batch is one source per sample.

    Raises:
        ValueError: If ``ref_images`` is neither 4-D nor 5-D.
    """
    if ref_images.ndim == 4:
        return ref_images.unsqueeze(1)
    if ref_images.ndim != 5:
        raise ValueError(
            f"reward {reward_name!r} expects ref_images (B, C, H, W) or (B, N, C, H, W) for N sources per "
            f"sample, got {tuple(ref_images.shape)}"
        )
    return ref_images


def accepts_uint8(reward: Reward) -> bool:
    """Whether ``reward`` scores uint8 pixel batches itself (its optional ``accepts_uint8`` attribute).

    Such a reward quantises float images to uint8 anyway (JPEG, PIL-based preprocessing), so a server
    that received uint8 pixels passes them on unchanged instead of converting to float and back.
    """
    return bool(getattr(reward, "accepts_uint8", False))


def is_served(reward: Reward) -> bool:
    """Whether ``reward`` scores by waiting on another process (its optional ``served`` attribute: the
    clients of reward servers and judge APIs), rather than computing here."""
    return bool(getattr(reward, "served", False))


def reads_prompts(reward: Reward) -> bool:
    """Whether ``reward`` scores a sample against its prompt (pickscore, clipscore, HPS, ImageReward, OCR,
    judges): its ``reads_prompts`` attribute, which the rewards that score the image alone (or its
    metadata: GenEval, ShapesEval) set to False.

    A reward that does not say is assumed to read them, so a reward server refuses to score it against
    prompts a request did not send rather than against empty ones; an image-only reward of your own sets
    ``reads_prompts = False``.
    """
    return bool(getattr(reward, "reads_prompts", True))


def all_finite(values: Tensor) -> bool:
    """Whether every element of ``values`` is finite: one min/max pass, ~30× cheaper than ``isfinite``.

    ``aminmax`` propagates NaN into both results and keeps ±inf, so both are finite exactly when all
    elements are.
    """
    if values.numel() == 0 or not values.is_floating_point():
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) and torch.isfinite(high))


def check_result(result: RewardResult, expected: int, reward_name: str) -> None:
    """Check that a reward returned exactly one score per sample.

    Args:
        result: What the reward returned.
        expected: The batch size it was given.
        reward_name: The reward's name, used in the error.

    Raises:
        ValueError: If the number of scores differs from ``expected``.
    """
    got = int(result.scores.shape[0])
    if got != expected:
        raise ValueError(
            f"reward {reward_name!r} returned {got} scores for a batch of {expected}; "
            "a reward must return exactly one score per sample (use NaN for a failed sample)."
        )
