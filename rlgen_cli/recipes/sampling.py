"""Sampling shared by the recipes and the ``sample`` / ``eval`` tasks: batched ODE/SDE sampling with
per-sample noise streams, source images of editing sets, and the conditioned velocity the sde/ code
expects.

Every sample draws its initial and step noise from its own stream keyed by (seed, epoch, position)
(``sde/noise.py``), so the batch size and the number of processes never change what is sampled.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import Tensor

from rlgen_cli.data import PromptDataset
from rlgen_cli.data.images import load_images, source_image_paths
from rlgen_cli.models import Cond, FlowPolicy
from rlgen_cli.sde.noise import sample_generators
from rlgen_cli.sde.rollout import StepSpec, rollout
from rlgen_cli.sde.window import plan_window
from rlgen_cli.training.progress import Progress

INITIAL_NOISE, STEP_NOISE, WINDOW = 0, 1, 2  # salts of the independent random streams


def batches(n: int, size: int) -> Iterator[slice]:
    """Consecutive slices of at most ``size`` covering ``range(n)``."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


@torch.no_grad()
def sample_latents(
    policy: FlowPolicy,
    prompts: list[str],
    num_steps: int,
    batch_size: int,
    seed: int,
    progress: Progress,
    spec: StepSpec | None = None,
    epoch: int = 0,
    sources: Tensor | None = None,
) -> Tensor:
    """Final latents x_0 for ``prompts`` (ODE unless ``spec`` says otherwise), batch by batch; sample i's
    noise comes from stream (seed, epoch, i) whatever the batch size."""
    spec = spec or StepSpec("ode", 0.0)
    plan = plan_window("all", num_steps, timestep_fraction=1.0)
    initial = sample_generators(seed, epoch, range(len(prompts)), policy.device, salt=INITIAL_NOISE)
    steps = sample_generators(seed, epoch, range(len(prompts)), policy.device, salt=STEP_NOISE)
    latents = []
    task = progress.task("sampling", total=len(prompts))
    for part in batches(len(prompts), batch_size):
        cond = policy.encode(prompts[part], None if sources is None else sources[part].to(policy.device))
        x = policy.noise(part.stop - part.start, initial[part])
        velocity = functools.partial(conditioned, policy, cond)
        latents.append(rollout(velocity, x, policy.schedule(num_steps, x), plan, spec, steps[part]).final)
        progress.advance(task, part.stop - part.start)
    progress.remove(task)
    return torch.cat(latents)


def sample_images(
    policy: FlowPolicy,
    prompts: list[str],
    num_steps: int,
    batch_size: int,
    seed: int,
    progress: Progress,
    spec: StepSpec | None = None,
    sources: Tensor | None = None,
) -> Tensor:
    """Images (B, 3, H, W) in [0, 1] for ``prompts``: :func:`sample_latents`, decoded batch by batch."""
    latents = sample_latents(policy, prompts, num_steps, batch_size, seed, progress, spec, sources=sources)
    return torch.cat([policy.decode(latents[part]).cpu() for part in batches(len(latents), batch_size)])


def source_images_for(policy: FlowPolicy, examples: list, dataset: PromptDataset) -> Tensor | None:
    """Editing families get each example's source image, resized to the model's size; others None."""
    if not getattr(policy, "takes_source_images", False):
        return None
    height, width = policy.cfg.height or policy.cfg.resolution, policy.cfg.width or policy.cfg.resolution
    return load_images(source_image_paths(examples, dataset.source), height, width)


def conditioned(policy: FlowPolicy, cond: Cond, x: Tensor, sigma: Tensor) -> Tensor:
    """``velocity(x, sigma)`` with the conditioning bound (what ``sde.rollout`` expects)."""
    return policy.velocity(x, sigma, cond)
