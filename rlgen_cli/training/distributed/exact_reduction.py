"""Order-independent gradient sums: results that do not depend on the process count.

A float sum of micro-batch gradients depends on its order — ((g0+g1)+g2)+g3 in one process, (g0+g2)+(g1+g3)
over two, and DDP's all-reduce adds its own — so the weights would depend on the process count by float
rounding. Instead every backward's gradient is added into one float64 buffer per process (DDP's own
all-reduce is switched off: :func:`without_gradient_sync`), the buffers are summed over processes once per
optimizer step (``torch.distributed.all_reduce``), averaged over processes and cast back to the parameters'
dtype: float32 gradients summed in float64 are exact for any realistic spread of magnitudes, so the order —
and with it the process count — no longer changes a bit (:class:`ExactGradients`). Cost: one float64 copy
of the trained parameters and one all-reduce per optimizer step instead of one per backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["ExactGradients", "without_gradient_sync"]


class ExactGradients:
    """Order-independent gradient sums: each backward's gradients are moved into one float64 buffer
    (:meth:`collect`); :meth:`reduce` sums the buffers over processes, averages over them and writes
    the result back as the parameters' gradients. Exactness: a float64 sum of float32 values is exact
    while their magnitudes span fewer than ~2⁹ × 2²⁰ (29 spare mantissa bits, minus the bits the count
    of terms needs), so any order of the same terms gives the same bits; dividing by a power-of-two
    process count is exact too. A parameter no backward reached (on any process) keeps ``grad = None``,
    as in plain accumulation."""

    def __init__(self, params: list[nn.Parameter], world_size: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.world_size = world_size
        sizes = [p.numel() for p in self.params]
        # one flat buffer: the gradients, then one "reached" count per parameter; one all-reduce per step
        self.flat = torch.zeros(sum(sizes) + len(sizes), dtype=torch.float64, device=_device_of(self.params))
        self.views = list(self.flat[: sum(sizes)].split(sizes))
        self.reached = self.flat[sum(sizes) :]

    def collect(self) -> None:
        """Add every parameter's gradient into its float64 buffer and clear it."""
        for i, (param, view) in enumerate(zip(self.params, self.views, strict=True)):
            if param.grad is not None:
                view.add_(param.grad.detach().reshape(-1).to(torch.float64))
                self.reached[i] += 1
                param.grad = None

    def reduce(self) -> None:
        """Sum the buffers over processes, average over them, set the gradients, clear the buffers."""
        self.collect()  # a backward made outside Dist.backward (nothing, normally)
        if self.world_size > 1:
            torch.distributed.all_reduce(self.flat, op=torch.distributed.ReduceOp.SUM)
        for i, (param, view) in enumerate(zip(self.params, self.views, strict=True)):
            if self.reached[i] > 0:
                param.grad = (view / self.world_size).to(param.dtype).view_as(param)
        self.flat.zero_()


def _device_of(params: list[nn.Parameter]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


def without_gradient_sync(wrap: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], nn.Module]:
    """``wrap`` (DDP), with DDP's per-backward all-reduce off for good: DDP still broadcasts rank 0's
    starting weights, :class:`ExactGradients` reduces once per step."""

    def wrapped(module: nn.Module) -> nn.Module:
        prepared = wrap(module)
        if hasattr(prepared, "require_backward_grad_sync"):
            prepared.require_backward_grad_sync = False
        return prepared

    return wrapped
