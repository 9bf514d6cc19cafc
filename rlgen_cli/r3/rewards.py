"""R3 stage rewards and per-track advantages (docs/maths.md §9.1, §9.2).

R3 (reason → reflect → refine) trains a text track (plans and edit instructions, token GRPO) and an image
track (generated and edited images, Flow-GRPO) from one reward per branch:

* **Reason** (plan + image): the completion must be exactly ``<think>plan</think>`` (format bit f). Text
  reward ``f·(r + w_f)``, image reward ``r``, where ``r`` scores the image and ``w_f`` is the format weight.
* **Reflect + refine** (instruction + edit): the completion is ``<think>…</think>instruction``. With
  ``Δ = r_new − r_prev`` the text reward is ``f·(w_f + Δ)`` and the image reward ``r_new``. Answering
  "no further edit needed" keeps the image: on an already perfect image that is the right call and
  ``Δ = 1``; on an imperfect one ``Δ = 0``. Where no edit happened the image track has nothing to train, so
  its advantage is masked.
* **Advantages**: reward minus the group mean, separately per track (no std division by default; the
  std option divides by the group's std + eps). Masked members take no part in the group mean and get
  advantage 0.

Group statistics come from :func:`rlgen_cli.algos.advantages.group_advantages` (and so from
``group_moments``, the seam where statistics are all-reduced over a policy group of ranks): a group that
spans several ranks is one group as long as the rewards are gathered with their group ids first.

Deliberate choices: the format check forbids nested ``<think>``/``</think>`` tags inside the block, as
the upstream checker does; a malformed completion earns text reward exactly 0 even when its image score
is NaN (the image track still sees the NaN and fails loudly in :func:`track_advantages`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlgen_cli.algos.advantages import AdvantageStats, group_advantages

__all__ = [
    "NO_EDIT",
    "REFLECT_PATTERN",
    "STAGES",
    "THINK_PATTERN",
    "StageRewards",
    "extract_instruction",
    "extract_plan",
    "format_ok",
    "format_scores",
    "is_no_edit",
    "reason_rewards",
    "refine_rewards",
    "track_advantages",
    "track_advantages_with_stats",
]

STAGES: tuple[str, ...] = ("reason", "reflect")
NO_EDIT = "no further edit needed"
# A think block whose body holds no further <think> or </think> tag.
_BLOCK = r"<think>(?:(?!<think>|</think>).)*?</think>"
THINK_PATTERN = re.compile(rf"^{_BLOCK}$", re.DOTALL)
REFLECT_PATTERN = re.compile(rf"^{_BLOCK}(?P<instruction>(?:(?!<think>|</think>).)*)$", re.DOTALL)
_OPEN, _CLOSE = "<think>", "</think>"
_TRAILING = " \t\r\n.!。！"
_QUOTES = "\"'`“”‘’"


# ------------------------------------------------------------------------------------------ parsing
def format_ok(text: str, stage: str) -> bool:
    """Whether a completion has the stage's format (surrounding whitespace ignored).

    Args:
        text: The decoded completion, special tokens removed.
        stage: ``"reason"`` (exactly ``<think>…</think>``) or ``"reflect"`` (``<think>…</think>`` followed by
            a non-empty instruction).

    Returns:
        True when the format holds.

    Raises:
        ValueError: On an unknown stage.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown R3 stage {stage!r}; valid stages: {', '.join(STAGES)}.")
    text = (text or "").strip()
    if stage == "reason":
        return THINK_PATTERN.match(text) is not None
    match = REFLECT_PATTERN.match(text)
    return match is not None and bool(match["instruction"].strip())


def format_scores(texts: Sequence[str], stage: str) -> Tensor:
    """The format bit f of every completion as a (N,) float32 tensor of 0.0 / 1.0."""
    return torch.tensor([float(format_ok(t, stage)) for t in texts], dtype=torch.float32)


def extract_plan(text: str) -> str:
    """The plan a reason-stage completion conditions the image on.

    The body of the first closed ``<think>`` block; for a malformed completion, still the best text
    available (the body of an unclosed block, or the whole completion), since the image is generated
    either way and the format reward already penalises the text.

    Args:
        text: The reason-stage completion.

    Returns:
        The stripped plan.
    """
    text = (text or "").strip()
    start = text.find(_OPEN)
    if start == -1:
        return text.replace(_CLOSE, "").strip()
    body = text[start + len(_OPEN) :]
    end = body.find(_CLOSE)
    return (body if end == -1 else body[:end]).strip()


def extract_instruction(text: str) -> str:
    """The edit instruction of a reflect-stage completion.

    The text after the last ``</think>``; ``""`` when a ``<think>`` block was opened but never closed
    (reasoning cut off by the token limit: there is no instruction); the whole text when it holds no think
    tag at all (a bare instruction). :func:`is_no_edit` treats ``""`` as "no edit".

    Args:
        text: A reflect-stage completion, or a bare instruction.

    Returns:
        The stripped instruction.
    """
    text = (text or "").strip()
    if _CLOSE in text:
        return text.rsplit(_CLOSE, 1)[1].strip()
    if _OPEN in text:
        return ""
    return text


def _normalise(instruction: str) -> str:
    """Lower-case, collapse whitespace, drop surrounding quotes and trailing punctuation."""
    words = " ".join(instruction.lower().split()).strip(_QUOTES)
    return words.rstrip(_TRAILING).strip(_QUOTES).rstrip(_TRAILING)


def is_no_edit(text: str) -> bool:
    """Whether a reflect completion (or a bare instruction) asks for no edit.

    True when the instruction (:func:`extract_instruction`) is "no further edit needed" — case, inner
    whitespace, surrounding quotes and trailing punctuation ignored — or is empty. Any longer answer is
    an instruction to edit.

    Args:
        text: A reflect-stage completion or its instruction.

    Returns:
        True when the image is to be kept as it is.
    """
    return _normalise(extract_instruction(text)) in ("", NO_EDIT)


# ------------------------------------------------------------------------------------------ rewards
@dataclass
class StageRewards:
    """Per-branch rewards of one R3 stage; every field is (N,) on the CPU.

    Attributes:
        text: Text-track reward (float32).
        image: Image-track reward (float32).
        image_mask: Bool; False where the image track is masked (no edit happened).
        delta: Refine stage: the improvement Δ (float32); ``None`` for the reason stage.
        format: The format bit f (float32, 0.0 / 1.0).
    """

    text: Tensor
    image: Tensor
    image_mask: Tensor
    delta: Tensor | None
    format: Tensor


def _as_vector(values: Tensor, name: str, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values`` as a detached (n,) CPU tensor of ``dtype``; raises ``ValueError`` on a shape mismatch."""
    values = torch.as_tensor(values).detach().cpu()
    if values.ndim != 1 or values.numel() != n:
        raise ValueError(
            f"{name} must be 1-D with one entry per completion ({n}), got shape {tuple(values.shape)}."
        )
    if dtype == torch.bool and values.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor (True = perfect), got {values.dtype}.")
    return values.to(dtype)


def _gated(fmt: Tensor, value: Tensor) -> Tensor:
    """``f·value`` with exactly 0 where f = 0, even if ``value`` is NaN there."""
    return torch.where(fmt > 0, fmt * value, torch.zeros_like(value))


def reason_rewards(texts: Sequence[str], image_scores: Tensor, format_weight: float) -> StageRewards:
    """Rewards of the reason stage: text ``f·(r + w_f)``, image ``r``, image track never masked.

    Args:
        texts: The N plan completions.
        image_scores: (N,) reward r of each generated image.
        format_weight: w_f, added to r when the format holds.

    Returns:
        The stage rewards (``delta`` is None).

    Raises:
        ValueError: If ``image_scores`` is not (N,).
    """
    r = _as_vector(image_scores, "image_scores", len(texts))
    fmt = format_scores(texts, "reason")
    return StageRewards(
        text=_gated(fmt, r + float(format_weight)),
        image=r.clone(),
        image_mask=torch.ones(len(texts), dtype=torch.bool),
        delta=None,
        format=fmt,
    )


def refine_rewards(
    texts: Sequence[str],
    prev_scores: Tensor,
    new_scores: Tensor,
    prev_perfect: Tensor | None,
    format_weight: float,
    perfect_threshold: float = 1.0,
) -> StageRewards:
    """Rewards of the reflect + refine stage.

    ``Δ = r_new − r_prev`` for an edit; for "no further edit needed" (:func:`is_no_edit`), ``Δ = 1`` when
    the previous image was perfect and ``Δ = 0`` otherwise. Text ``f·(w_f + Δ)``; image ``r_new``, masked
    where no edit happened.

    Args:
        texts: The N reflect completions.
        prev_scores: (N,) reward of the image each branch started from.
        new_scores: (N,) reward of the image after the stage (the kept image where no edit happened).
        prev_perfect: (N,) bool, whether the starting image was perfect (known to the stage-1 buffer);
            ``None`` derives it as ``prev_scores >= perfect_threshold``.
        format_weight: w_f.
        perfect_threshold: Score at which an image counts as perfect when ``prev_perfect`` is None.

    Returns:
        The stage rewards, with ``delta``.

    Raises:
        ValueError: If a tensor is not (N,) or ``prev_perfect`` is not bool.
    """
    n = len(texts)
    prev = _as_vector(prev_scores, "prev_scores", n)
    new = _as_vector(new_scores, "new_scores", n)
    if prev_perfect is None:
        perfect = prev >= float(perfect_threshold)
    else:
        perfect = _as_vector(prev_perfect, "prev_perfect", n, torch.bool)
    kept = torch.tensor([is_no_edit(t) for t in texts], dtype=torch.bool)
    delta = torch.where(kept, perfect.float(), new - prev)
    fmt = format_scores(texts, "reflect")
    return StageRewards(
        text=_gated(fmt, delta + float(format_weight)),
        image=new.clone(),
        image_mask=~kept,
        delta=delta,
        format=fmt,
    )


# --------------------------------------------------------------------------------------- advantages
def track_advantages_with_stats(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor | None = None,
    scale_by_std: bool = False,
    eps: float = 1e-4,
) -> tuple[Tensor, AdvantageStats | None]:
    """:func:`track_advantages` plus the statistics of the masked-in rewards, for logging.

    Args:
        rewards: (N,) float rewards.
        group_ids: (N,) integer group ids.
        mask: (N,) bool; False excludes a member.
        scale_by_std: Divide by the group std + eps.
        eps: Added to the std before dividing.

    Returns:
        ``(advantages, stats)``: (N,) advantages, and the :class:`AdvantageStats` of the masked-in
        rewards, ``None`` when no member is masked in.
    """
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must have the same shape; "
            "pass one group id per reward."
        )
    if mask is None:
        mask = torch.ones_like(rewards, dtype=torch.bool)
    if mask.shape != rewards.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor shaped like rewards {tuple(rewards.shape)}, "
            f"got {mask.dtype} {tuple(mask.shape)}."
        )
    advantages = torch.zeros_like(rewards)
    if not bool(mask.any()):
        return advantages, None
    scale = "std" if scale_by_std else "none"
    kept, stats = group_advantages(rewards[mask], group_ids[mask], eps=eps, clip_max=None, scale=scale)
    advantages[mask] = kept
    return advantages, stats


def track_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor | None = None,
    scale_by_std: bool = False,
    eps: float = 1e-4,
) -> Tensor:
    """Advantages of one track (text or image): reward minus its group's mean.

    With ``mask``, only masked-in members form each group's statistics and masked-out members get 0 (their
    rewards may be NaN: they are never read). ``scale_by_std`` divides by the group's population std +
    ``eps``. A group whose members all have the same reward (or a single member) gets exactly 0. No
    clipping (R3 does not clip advantages).

    Args:
        rewards: (N,) float rewards of every branch, gathered over the ranks of a policy group.
        group_ids: (N,) integer group ids (the prompt's, or the stage-1 image's, dataset index).
        mask: (N,) bool; False excludes a member (image track where no edit happened).
        scale_by_std: Divide by the group std + eps.
        eps: Added to the std before dividing.

    Returns:
        (N,) advantages in ``rewards.dtype``.

    Raises:
        ValueError: On mismatched shapes, non-integer ids, a non-bool mask or a non-finite masked-in reward.
    """
    return track_advantages_with_stats(rewards, group_ids, mask, scale_by_std, eps)[0]
