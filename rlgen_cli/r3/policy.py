"""The unified-policy protocol R3 trains: think, generate, reflect, edit — text and image in one policy.

The recipe (``recipes/r3.py``) sees only this surface, so a native unified model (BAGEL-style: one
transformer that writes text and denoises images) implements it as well as the composite of three
models (``r3/composite.py``):

* **text** — :meth:`UnifiedPolicy.think` (prompt → plan) and :meth:`UnifiedPolicy.reflect` (image +
  prompt → critique and instruction) sample completions and return them with their token data
  (:class:`Thoughts`); :meth:`~UnifiedPolicy.token_batch` lays rows out for training and
  :meth:`~UnifiedPolicy.token_logprobs` scores them at temperature 1 (π_θ, or π_ref with ``reference``).
* **image** — a flow-policy surface shared by both stages (``models/base.py``'s contract): conditioning
  from :meth:`~UnifiedPolicy.encode_generate` (prompt + plan) or :meth:`~UnifiedPolicy.encode_edit`
  (source image + instruction) carries its stage in ``Cond.extras[STAGE_KEY]``; ``noise`` / ``schedule``
  / ``decode`` take the stage; :meth:`~UnifiedPolicy.velocity` is the only call into the image model, CFG
  included, so rollout and training run the same code.
* **training** — trainable parameters and frozen references per track, a distributed wrapper, and
  checkpoint I/O.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from PIL import Image
from torch import Tensor, nn

from rlgen_cli.models.base import Cond
from rlgen_cli.vlm.rollout import SamplingOptions, TokenBatch

__all__ = ["EDIT", "GENERATE", "IMAGE", "STAGE_KEY", "TEXT", "Thoughts", "UnifiedPolicy", "stage_of"]

GENERATE, EDIT = "generate", "edit"
"""The two image stages: text-to-image (reason) and editing (refine)."""
TEXT, IMAGE = "text", "image"
"""The two trained tracks."""
STAGE_KEY = "r3_stage"
"""``Cond.extras`` key naming the stage a conditioning belongs to."""


def stage_of(cond: Cond) -> str:
    """The stage (``generate`` / ``edit``) a conditioning was encoded for."""
    stage = cond.extras.get(STAGE_KEY)
    if stage not in (GENERATE, EDIT):
        raise ValueError(
            f"conditioning without an R3 stage (extras {sorted(cond.extras)}); encode it with "
            "encode_generate or encode_edit"
        )
    return stage


@dataclass
class Thoughts:
    """Completions of one think / reflect call, in row order; N rows.

    Attributes:
        prompts: The model-ready prompts (chat template applied), reused verbatim for training.
        images: The image each prompt looks at (reflect), or None (think).
        completions: N × (L_i,) sampled token ids, the stop token included when one was sampled.
        texts: The decoded completions (special tokens removed).
        truncated: Whether the token budget ran out before a stop token.
        sampler_logprobs: N × (L_i,) raw-logit log-probs recorded while sampling (temperature 1, vision
            tokens masked): what ``rlgen check-onpolicy`` holds the training forward against.
    """

    prompts: list[str]
    images: list[Image.Image | None]
    completions: list[Tensor]
    texts: list[str]
    truncated: list[bool]
    sampler_logprobs: list[Tensor]

    def __len__(self) -> int:
        return len(self.texts)

    @staticmethod
    def cat(parts: Sequence[Thoughts]) -> Thoughts:
        """Join micro-batches in order."""
        return Thoughts(*(sum((getattr(p, k) for p in parts), []) for k in Thoughts.__dataclass_fields__))


@runtime_checkable
class UnifiedPolicy(Protocol):
    """What the R3 recipe needs from a policy that writes and draws (see the module docstring)."""

    device: torch.device

    # -- text track ---------------------------------------------------------------------------------
    def think(self, prompts: Sequence[str], options: SamplingOptions, seed: int) -> Thoughts: ...
    def reflect(
        self, images: Tensor, prompts: Sequence[str], options: SamplingOptions, seed: int
    ) -> Thoughts: ...
    def token_batch(self, thoughts: Thoughts, rows: slice) -> TokenBatch: ...
    def token_logprobs(self, batch: TokenBatch, reference: bool = False) -> Tensor: ...

    # -- image track: one flow surface, the stage travels with the conditioning ------------------------
    def encode_generate(self, prompts: Sequence[str], plans: Sequence[str]) -> Cond: ...
    def encode_edit(self, images: Tensor, instructions: Sequence[str]) -> Cond: ...
    def noise(self, n: int, generators: Sequence[torch.Generator], stage: str) -> Tensor: ...
    def schedule(self, num_steps: int, x: Tensor, stage: str) -> Tensor: ...
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor: ...
    def decode(self, x0: Tensor, stage: str) -> Tensor: ...
    def image_size(self, stage: str) -> tuple[int, int]: ...

    # -- training -------------------------------------------------------------------------------------
    def trainable_parameters(self, track: str) -> list[nn.Parameter]: ...
    def image_reference(self) -> contextlib.AbstractContextManager[None]: ...
    def keep_reference(self) -> None: ...
    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None: ...
    def save_trainable(self, directory: Path) -> None: ...
    def load_trainable(self, directory: Path) -> None: ...
