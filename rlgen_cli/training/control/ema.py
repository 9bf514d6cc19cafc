"""Exponential moving average of the trainable weights, for evaluation and saving only.

Flow-GRPO keeps an EMA of the trainable parameters (decay 0.9, updated every 8 optimizer steps,
docs/maths.md §4.7) and evaluates / saves with it while training continues on the live weights:

    every ``update_every`` optimizer steps:  shadow ← decay·shadow + (1 − decay)·param

Shadows are at least float32 copies (bf16 weights would lose the small ``(1 − decay)·Δ`` increments) on the
parameter's device. :meth:`EMA.swap` loads them into the live parameters inside a ``with`` block and
restores the exact live values afterwards.

Differences from upstream's ``EMAModuleWrapper``: upstream updates when ``(step + 1) % interval == 0``
and warms the decay up as ``min((1 + step)/(10 + step), decay)``; here ``step(global_step)`` takes the
number of optimizer steps done so far and the decay is constant unless ``warmup=True`` (upstream's
schedule, for parity). A repeated ``global_step`` (e.g. called once per micro-batch) updates only once.

Sharded weights (DeepSpeed ZeRO-3): ``gather`` is the engine's own context that shows the parameters' full
values (``Dist.gathered``); updates read them inside it, and :meth:`EMA.swap` writes the EMA weights — and
afterwards the live ones — back into the shards through it. Every rank keeps the same full shadows (the
update is the same on every rank), so every rank must call :meth:`EMA.step` and :meth:`EMA.swap` together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

__all__ = ["EMA", "SHADOW_KEY", "STEP_KEY", "Gather", "whole"]

SHADOW_KEY, STEP_KEY = "shadow", "last_step"
# (params, modify) -> context in which ``params`` hold their full values; with ``modify``, writes made
# inside it reach the shards on exit
Gather = Callable[[list[Tensor], bool], AbstractContextManager[Any]]


def whole(params: list[Tensor], modify: bool = False) -> AbstractContextManager[Any]:
    """The :data:`Gather` of unsharded parameters: nothing to do."""
    return nullcontext()


class EMA:
    """EMA shadow copies of a fixed list of parameters.

    Args:
        parameters: The trainable parameters (e.g. the LoRA weights); the order is the state order.
        decay: EMA decay in [0, 1): ``shadow ← decay·shadow + (1 − decay)·param``.
        update_every: Update on optimizer steps that are multiples of this, >= 1.
        warmup: Use upstream's warm-up decay ``min((1 + step)/(10 + step), decay)``.
        gather: How to see (and write) the parameters' full values when an engine shards them
            (``Dist.gathered``); a collective, so every rank updates and swaps together.

    Raises:
        ValueError: On an empty parameter list, ``decay`` outside [0, 1) or ``update_every < 1``.
    """

    def __init__(
        self,
        parameters: Iterable[Tensor],
        decay: float = 0.9,
        update_every: int = 8,
        *,
        warmup: bool = False,
        gather: Gather = whole,
    ) -> None:
        self.params: list[Tensor] = list(parameters)
        if not self.params:
            raise ValueError("EMA got no parameters; pass the trainable parameters (e.g. the LoRA weights).")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}; Flow-GRPO uses 0.9.")
        if update_every < 1:
            raise ValueError(
                f"update_every must be >= 1 optimizer step, got {update_every}; Flow-GRPO uses 8."
            )
        self.decay = decay
        self.update_every = update_every
        self.warmup = warmup
        self.gather = gather
        with gather(self.params, False):
            self.shadow: list[Tensor] = [
                p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True) for p in self.params
            ]
        self.last_step = 0
        self._swapped = False

    def current_decay(self, global_step: int) -> float:
        """The decay applied at ``global_step`` (constant unless ``warmup``)."""
        if not self.warmup:
            return self.decay
        return min((1 + global_step) / (10 + global_step), self.decay)

    @torch.no_grad()
    def step(self, global_step: int) -> bool:
        """Update the shadows if ``global_step`` is a new multiple of ``update_every``.

        Args:
            global_step: Optimizer steps completed so far (1 after the first step).

        Returns:
            Whether the shadows were updated.

        Raises:
            ValueError: If ``global_step < 0``.
            RuntimeError: Inside :meth:`swap` (the live parameters hold the EMA weights).
        """
        if global_step < 0:
            raise ValueError(f"global_step must be >= 0 (optimizer steps done), got {global_step}.")
        if self._swapped:
            raise RuntimeError(
                "EMA.step() inside EMA.swap() would average the EMA into itself; step after the block."
            )
        if global_step == 0 or global_step % self.update_every or global_step <= self.last_step:
            return False
        decay = self.current_decay(global_step)
        with self.gather(self.params, False):
            for shadow, param in zip(self.shadow, self.params, strict=True):
                shadow.mul_(decay).add_(param.detach().to(shadow.dtype), alpha=1.0 - decay)
        self.last_step = global_step
        return True

    @contextmanager
    def swap(self) -> Iterator[None]:
        """Load the EMA weights into the live parameters for the ``with`` block, then restore them.

        Raises:
            RuntimeError: When nested (the inner block would back up EMA weights as the live ones).
        """
        if self._swapped:
            raise RuntimeError("EMA.swap() is already active; nested swaps would lose the live weights.")
        with torch.no_grad(), self.gather(self.params, True):
            backup = [p.detach().clone() for p in self.params]
            self._swapped = True
            for param, shadow in zip(self.params, self.shadow, strict=True):
                param.copy_(shadow)
        try:
            yield
        finally:
            with torch.no_grad(), self.gather(self.params, True):
                for param, saved in zip(self.params, backup, strict=True):
                    param.copy_(saved)
            self._swapped = False

    def state_dict(self) -> dict[str, Any]:
        """Shadows (cloned) and the last update step; the config (decay, interval) comes from the run."""
        return {SHADOW_KEY: [s.clone() for s in self.shadow], STEP_KEY: self.last_step}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output onto this EMA's devices.

        Raises:
            ValueError: If the saved shadows do not match the parameters in number or shape.
        """
        saved = state[SHADOW_KEY]
        if len(saved) != len(self.shadow):
            raise ValueError(
                f"EMA state holds {len(saved)} tensors but this EMA tracks {len(self.shadow)} parameters; "
                "resume with the same trainable parameters (same LoRA rank / targets)."
            )
        for i, (mine, theirs) in enumerate(zip(self.shadow, saved, strict=True)):
            if mine.shape != theirs.shape:
                raise ValueError(
                    f"EMA state tensor {i} has shape {tuple(theirs.shape)}, parameter {i} has "
                    f"{tuple(mine.shape)}; resume with the same trainable parameters."
                )
        for mine, theirs in zip(self.shadow, saved, strict=True):
            mine.copy_(theirs)
        self.last_step = int(state[STEP_KEY])
