"""The distributed context a recipe sees: rank, world size, device, gather, model wrapping.

Two implementations behind one small interface (null object, no ``if distributed:`` in the loop):
:class:`LocalDist` for one in-process run, and :class:`AccelerateDist` over an ``accelerate.Accelerator``
when ``rlgen`` workers run under ``accelerate launch`` (DDP on GPUs, or gloo on CPUs). rlgen adds no
communication of its own: gathers, DDP gradient averaging and barriers are accelerate's / PyTorch's.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch import Tensor, nn


class Dist(Protocol):
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool: ...
    def gather(self, tensor: Tensor) -> Tensor: ...
    def wrap_model(self, module: nn.Module) -> nn.Module: ...
    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]: ...
    def barrier(self) -> None: ...


class LocalDist:
    """One process: gather is the identity, models run unwrapped."""

    rank, world_size = 0, 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def is_main(self) -> bool:
        return True

    def gather(self, tensor: Tensor) -> Tensor:
        return tensor

    def wrap_model(self, module: nn.Module) -> nn.Module:
        return module

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return nullcontext()

    def barrier(self) -> None:
        return None


class AccelerateDist:
    """Several processes under ``accelerate launch``; tensors are gathered in rank order."""

    def __init__(self, cpu: bool) -> None:
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=cpu)
        self.rank = self.accelerator.process_index
        self.world_size = self.accelerator.num_processes
        self.device = self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def gather(self, tensor: Tensor) -> Tensor:
        """Concatenate every rank's tensor along dim 0 (equal sizes on every rank)."""
        return self.accelerator.gather(tensor.to(self.device).contiguous())

    def wrap_model(self, module: nn.Module) -> nn.Module:
        """DDP (or the configured engine) around the trainable module; gradients are averaged."""
        return self.accelerator.prepare_model(module)

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return self.accelerator.no_sync(module)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()


def launched_world_size() -> int:
    """Processes of this launch (``WORLD_SIZE`` set by accelerate / torchrun; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_dist(device_name: str) -> Dist:
    """:class:`AccelerateDist` inside a multi-process launch, else :class:`LocalDist`."""
    from rlgen_cli.models import resolve_device

    if launched_world_size() > 1:
        return AccelerateDist(cpu=device_name == "cpu" or not torch.cuda.is_available())
    return LocalDist(resolve_device(device_name))
