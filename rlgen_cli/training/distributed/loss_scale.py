"""Dynamic loss scaling for fp16 compute with fp32 trained weights (the rule of ``torch.amp.GradScaler``).

Gradients that flow back through fp16 activations fall below fp16's smallest subnormal (6e-8) and flush
to 0. Multiplying the loss by a large power of two lifts them into range; since scaling by a power of two
is exact in floating point, the fp32 gradients divided by the same factor are the true ones wherever
nothing underflowed or overflowed. An overflow (a non-finite gradient) skips the optimizer step and
halves the scale; ``growth_interval`` clean steps in a row double it.

:class:`~rlgen_cli.training.distributed.dist.LocalDist` and the torch-stepped engines of
:class:`~rlgen_cli.training.distributed.dist.AccelerateDist` (DDP, FSDP) use it; the recipes see none of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

# GradScaler's defaults
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0**16, 2.0, 0.5, 2000


def needs_loss_scaling(compute_dtype: torch.dtype, params: list[Tensor]) -> bool:
    """Whether training in ``compute_dtype`` with trained weights ``params`` needs a loss scaler: fp16
    compute (bf16 has fp32's exponent range). Trained weights are fp32 by design; fp16 ones would need
    fp32 master copies, which rlgen does not keep."""
    if compute_dtype != torch.float16:
        return False
    low = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if low:
        raise RuntimeError(f"fp16 training scales the loss for fp32 trained weights; these are {low}")
    return True


@dataclass
class LossScaler:
    """The scale and its schedule; its state travels in checkpoints (:meth:`state_dict`)."""

    scale: float = INIT_SCALE
    growth_tracker: int = 0
    """Clean steps since the scale last changed."""
    skipped_steps: int = 0
    """Optimizer steps skipped for non-finite gradients, over the whole run."""
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL

    def scaled(self, loss: Tensor) -> Tensor:
        return loss * self.scale

    def unscale_(self, params: list[nn.Parameter]) -> None:
        """Divide the accumulated gradients by the scale, in place (before clipping sees them)."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        """After a step: back off and count a skipped step on an overflow, grow after a clean interval."""
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def metrics(self) -> dict[str, float]:
        return {"loss_scale": self.scale, "skipped_steps": float(self.skipped_steps)}

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - set(asdict(self))
        if unknown:
            raise ValueError(f"not a loss scaler's state: unknown keys {sorted(unknown)}")
        for key, value in state.items():
            setattr(self, key, value)
