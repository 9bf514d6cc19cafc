"""Batched ODE/SDE sampling with per-sample noise streams, shared by the recipes and the ``sample`` /
``eval`` tasks, and the conditioned velocity :func:`sde.rollout.rollout` expects.

Every sample draws its initial and step noise from its own stream keyed by (seed, epoch, position)
(``sde/noise.py``), so the batch size and the number of processes never change what is sampled.

The policy is typed by :class:`SamplingPolicy`, the five model-specific methods and a device, so this
module needs nothing from ``models/``; progress display stays with the caller (``on_batch``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from rlgen_cli.sde.noise import Stream, sample_generators
from rlgen_cli.sde.rollout import StepSpec, rollout
from rlgen_cli.sde.window import plan_window

__all__ = ["SamplingPolicy", "batches", "conditioned", "sample_images", "sample_latents"]


class HasVelocity(Protocol):
    def velocity(self, x: Tensor, sigma: Tensor, cond: Any) -> Tensor: ...


class SamplingPolicy(HasVelocity, Protocol):
    """What sampling needs from a flow policy (a structural subset of ``models.FlowPolicy``)."""

    device: torch.device

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Any: ...
    def noise(self, n: int, generator: Sequence[torch.Generator]) -> Tensor: ...
    def schedule(self, num_steps: int, x: Tensor) -> Tensor: ...
    def decode(self, x0: Tensor) -> Tensor: ...


def batches(n: int, size: int) -> Iterator[slice]:
    """Consecutive slices of at most ``size`` covering ``range(n)``."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def conditioned(policy: HasVelocity, cond: Any, x: Tensor, sigma: Tensor) -> Tensor:
    """``velocity(x, sigma)`` with the conditioning bound (what ``sde.rollout`` expects)."""
    return policy.velocity(x, sigma, cond)


@torch.no_grad()
def sample_latents(
    policy: SamplingPolicy,
    prompts: list[str],
    num_steps: int,
    batch_size: int,
    seed: int,
    *,
    spec: StepSpec | None = None,
    epoch: int = 0,
    sources: Tensor | None = None,
    on_batch: Callable[[int], None] | None = None,
    keys: Sequence[int] | None = None,
) -> Tensor:
    """Final latents x_0 for ``prompts`` (ODE unless ``spec`` says otherwise), batch by batch; sample i's
    noise comes from stream (seed, epoch, keys[i]) whatever the batch size (``keys``: default 0 … n − 1; a
    process of a launched run passes its samples' places in the global batch). ``sources``: editing
    families' source images, row i for prompt i; ``on_batch(n)`` is called after each batch of n samples."""
    spec = spec or StepSpec("ode", 0.0)
    plan = plan_window("all", num_steps, timestep_fraction=1.0)
    keys = range(len(prompts)) if keys is None else keys
    initial = sample_generators(seed, epoch, keys, policy.device, salt=Stream.INITIAL_NOISE)
    steps = sample_generators(seed, epoch, keys, policy.device, salt=Stream.STEP_NOISE)
    latents = []
    for part in batches(len(prompts), batch_size):
        cond = policy.encode(prompts[part], None if sources is None else sources[part].to(policy.device))
        x = policy.noise(part.stop - part.start, initial[part])
        velocity = functools.partial(conditioned, policy, cond)
        latents.append(rollout(velocity, x, policy.schedule(num_steps, x), plan, spec, steps[part]).final)
        if on_batch is not None:
            on_batch(part.stop - part.start)
    return torch.cat(latents)


def sample_images(
    policy: SamplingPolicy,
    prompts: list[str],
    num_steps: int,
    batch_size: int,
    seed: int,
    *,
    spec: StepSpec | None = None,
    epoch: int = 0,
    sources: Tensor | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Tensor:
    """Images (B, 3, H, W) in [0, 1] for ``prompts``: :func:`sample_latents`, decoded batch by batch."""
    latents = sample_latents(
        policy,
        prompts,
        num_steps,
        batch_size,
        seed,
        spec=spec,
        epoch=epoch,
        sources=sources,
        on_batch=on_batch,
    )
    return torch.cat([policy.decode(latents[part]).cpu() for part in batches(len(latents), batch_size)])
