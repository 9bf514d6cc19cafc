"""The planner's run of a flow recipe's epoch on the meta device: the base every recipe's tracer extends
(:class:`EpochTracer`: the meta run, the trace's modes, the caches of each traced setting) and what the
tracers and ``rlgen plan`` share of the recipe's training shape. Each flow recipe module defines its own
tracer beside its ``PLAN`` (``recipes/plan_shape.py``), which names it; ``tasks/plan.py`` drives it.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from rlgen_cli.recipes.plan_shape import PlanShape
from rlgen_cli.recipes.registry import plan_of

LAUNCH_KINDS = {
    "local": "local", "accelerate": "ddp", "multinode": "ddp", "deepspeed_zero2": "zero2",
    "deepspeed_zero3": "zero3", "fsdp": "fsdp",
}  # fmt: skip


META = torch.device("meta")


@contextlib.contextmanager
def empty_weights(enabled: bool) -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (accelerate's ``init_empty_weights``,
    buffers kept) when ``enabled``: a loading path allocates nothing."""
    if not enabled:
        yield
        return
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


Encode = Callable[[int], Any]
"""Batch size → the conditioning of that many prompts (and source images) on the meta device."""


def shape_of(cfg: Any) -> PlanShape:
    """What the run's recipe tells the planner about its training (``recipes/plan_shape.py``)."""
    shape = plan_of(cfg)
    assert shape is not None, cfg.recipe  # plan_task refused the recipes without one
    return shape


def micro_batch_of(cfg: Any) -> tuple[int, str | None]:
    """Units in one gradient-carrying training call on one process, and the setting that chooses it (None
    when the recipe derives it): the recipe's :meth:`PlanShape.micro_batch`."""
    return shape_of(cfg).micro_batch(cfg)


def rows_per_unit(cfg: Any) -> int:
    """Rows of a micro-batch unit in the training forwards whose graphs live together (a DPO pair: 2)."""
    return shape_of(cfg).rows_per_unit(cfg)


def folded_steps(cfg: Any) -> int:
    """Trained steps one training forward scores per sample (Flow-GRPO: ``algo.timesteps_per_pass``, at
    most the steps the first epoch's window trains; one in the other recipes)."""
    return shape_of(cfg).folded_steps(cfg)


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks: every element of the module lists directly under ``module`` (diffusers'
    ``transformer_blocks``, ``single_transformer_blocks``, ``blocks``, ``layers``, …) — what gradient
    checkpointing wraps and FSDP / ZeRO-3 gather one at a time. A network that keeps them deeper (BAGEL's
    ``language_model.model.layers``) names them by its checkpointing switch: the module lists of the
    submodules that carry a ``gradient_checkpointing`` attribute."""
    blocks = _blocks_in(module)
    if blocks:
        return blocks
    for sub in module.modules():
        if sub is not module and hasattr(sub, "gradient_checkpointing"):
            blocks += _blocks_in(sub)
    return blocks


def _blocks_in(module: nn.Module) -> list[nn.Module]:
    blocks: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, nn.ModuleList):
            blocks += [block for block in child if any(True for _ in block.parameters())]
    return blocks


@contextlib.contextmanager
def gradient_checkpointing(modules: list[nn.Module], on: bool) -> Iterator[None]:
    """Gradient checkpointing of the trained modules switched ``on`` or off inside (a module without it
    stays as it is), as configured after."""
    switched = [
        m
        for m in modules
        if getattr(m, "gradient_checkpointing", False) != on
        and getattr(m, "_supports_gradient_checkpointing", False)
    ]
    for module in switched:
        module.enable_gradient_checkpointing() if on else module.disable_gradient_checkpointing()
    try:
        yield
    finally:
        for module in switched:
            module.disable_gradient_checkpointing() if on else module.enable_gradient_checkpointing()


class EpochTracer(abc.ABC):
    """Runs the recipe's own sampling and training step on the meta device and traces their peaks
    (``memory_trace.trace_peak``), each setting once. One subclass per recipe (:func:`tracer_for`); this
    base holds what they share: the meta run, the trace's modes, the caches of each traced setting.

    The run it drives is the recipe's, as a :class:`FlowRun` on the meta device (:func:`meta_run`): the
    policy (its ``encode`` the plan's, :class:`PlannedPolicy`), a local ``Dist`` prepared as the run
    prepares it (float64 gradient sums under ``launcher.exact_reduction``), AdamW as a GPU runs it
    (``foreach``) with its moments already there, the EMA. A step's peak is traced over two backwards
    where gradients stay alive from one to the next (the second runs with the first one's gradients, as
    every later one does), so later backwards peak as high as the traced ones.
    """

    phase = "rollout"
    """What the sampling phase of an epoch is (pretraining samples only to evaluate)."""
    update_copies = 2
    """Copies of this process's samples the update holds (Flow-GRPO: the epoch's and the one trained on)."""
    update_global_copies = 0
    """Copies of the whole epoch's samples, over every process, the update holds (DPO / SFT gather them)."""

    def __init__(self, cfg: Any, policy: Any, trained: list[nn.Module], encode: Encode) -> None:
        self.cfg = cfg
        self.policy = policy
        self.trained = trained
        self.encode = encode
        self.run = meta_run(cfg, PlannedPolicy(policy, encode))
        self._rollouts: dict[int, int] = {}
        self._steps: dict[tuple[int, bool], int] = {}
        self._kept: tuple[Tensor, ...] | None = None  # one sampling batch's tensors kept for the update
        self._cond: Any = None  # one sampling batch's conditioning

    def rollout_peak(self, batch: int) -> int:
        """The peak of sampling and decoding one batch of ``batch`` samples (encode included)."""
        if batch not in self._rollouts:
            self._rollouts[batch] = self._trace(lambda: self._rollout(batch))
        return self._rollouts[batch]

    def kept_per_sample(self) -> int:
        """Bytes of one sample's tensors kept from its rollout to the update (trajectory, conditioning)."""
        batch = self.cfg.algo.sample_batch_size
        self.rollout_peak(batch)
        return math.ceil(distinct_bytes(list(self._kept)) / batch)

    def negative_per_sample(self) -> int:
        """Bytes of one sample's negative-prompt conditioning (none without CFG)."""
        self.rollout_peak(self.cfg.algo.sample_batch_size)
        negatives = [t for k, t in self._cond.tensors.items() if k.startswith("neg_")]
        return math.ceil(distinct_bytes(negatives) / len(self._cond))

    def largest_encode(self) -> int:
        """The most prompts the run encodes at once: a sampling batch, or a training call's rows."""
        batch, _ = micro_batch_of(self.cfg)
        return max(self.cfg.algo.sample_batch_size, batch * rows_per_unit(self.cfg) * folded_steps(self.cfg))

    def step_peak(self, micro_batch: int, checkpointing: bool) -> int:
        """The peak of one training step on ``micro_batch`` samples, checkpointing on or off."""
        key = (micro_batch, checkpointing)
        if key not in self._steps:
            self.kept_per_sample()  # the samples' shapes come from a rollout
            update = self._update_of(micro_batch)
            with gradient_checkpointing(self.trained, checkpointing):
                self._steps[key] = self._trace(update)
        return self._steps[key]

    def _trace(self, work: Callable[[], Any]) -> int:
        from rlgen_cli.training.memory.trace import trace_peak

        with self._modes():
            return trace_peak(work)

    @contextlib.contextmanager
    def _modes(self) -> Iterator[None]:
        from rlgen_cli.training.memory.trace import (
            autocast_on_meta,
            fused_attention_on_meta,
            generators_on_meta,
            meta_scalars,
            meta_values,
            recomputed_in_modes,
        )

        blocks = [block for module in self.trained for block in repeated_blocks(module)]
        with (
            autocast_on_meta(),
            meta_values(),
            fused_attention_on_meta(),
            meta_scalars(),
            generators_on_meta(),
            recomputed_in_modes(blocks),
        ):
            yield

    def _keep(self, batch: int, kept: tuple[Tensor, ...], cond: Any) -> None:
        if batch == self.cfg.algo.sample_batch_size:
            self._kept, self._cond = kept, cond

    def _accumulates(self) -> bool:
        """Whether gradients stay alive from one micro-batch to the next (no float64 sums clearing them)."""
        return shape_of(self.cfg).micro_batches_per_process(self.cfg) > 1 and self.run.dist.exact is None

    @abc.abstractmethod
    def _rollout(self, batch: int) -> None:
        """Run the recipe's sampling of one rollout batch of ``batch`` samples (traced by :meth:`rollout_peak`)."""

    @abc.abstractmethod
    def _update_of(self, micro_batch: int) -> Callable[[], Any]:
        """The recipe's optimizer step at ``micro_batch`` samples per forward, as a call to trace."""


class PlannedPolicy:
    """The policy, with the plan's ``encode`` (:data:`Encode`: the planning prompt, shaped as the run's,
    whatever the prompts asked for): a recipe that encodes inside its step (DPO's and SFT's losses,
    pretraining) gets the same conditioning as one handed the plan's. Everything else — attributes set
    included (pretraining's unguided forward sets ``guidance_scale``) — is the policy's own."""

    def __init__(self, policy: Any, encode: Encode) -> None:
        object.__setattr__(self, "_policy", policy)
        object.__setattr__(self, "_encode", encode)
        object.__setattr__(self, "last_cond", None)

    def encode(self, prompts: list[str], images: Any = None) -> Any:
        cond = self._encode(len(prompts))
        object.__setattr__(self, "last_cond", cond)
        return cond

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._policy, name, value)


def rows_of(tensor: Tensor, rows: int) -> Tensor:
    """``rows`` rows of ``tensor`` (its own, repeated)."""
    return tensor[torch.arange(rows) % len(tensor)]


def replaced(obj: Any, /, **fields: Any) -> Any:
    """``obj`` (a config section or the meta run) with some fields replaced, unvalidated (the trace steps
    through other batch sizes)."""
    return types.SimpleNamespace(**{**vars(obj), **fields})


def resized(traj: Any, rows: int, steps: int) -> Any:
    """A trajectory of ``rows`` samples (the rollout's, repeated) and its first ``steps`` trained steps:
    shaped as the run's, and with the values the rollout left on the CPU (per-step σ, stds, a train mask),
    which the loss reads."""
    samples = torch.arange(rows) % len(traj.final)
    per_sample = {
        key: value[samples.to(value.device)][:, :steps]
        if value.dim() > 1 and key != "final"
        else value[samples.to(value.device)]
        for key in traj._PER_SAMPLE
        if isinstance(value := getattr(traj, key), Tensor)
    }
    per_step = {k: getattr(traj, k)[:steps] for k in ("sigmas", "sigmas_next", "step_indices")}
    return dataclasses.replace(traj, **per_sample, **per_step)


def distinct_bytes(tensors: list[Tensor]) -> int:
    from rlgen_cli.training.memory.trace import storage_key

    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def meta_run(cfg: Any, policy: Any) -> Any:
    """What the recipe's functions read of a ``FlowRun``, on the meta device: the policy, a local
    ``Dist`` prepared as the run prepares it, AdamW (``foreach``, as on a GPU) with its moments made, the
    EMA."""
    from rlgen_cli.training.control.ema import EMA
    from rlgen_cli.training.distributed.dist import LocalDist

    algo = cfg.algo
    params = policy.trainable.parameters()
    optimizer = torch.optim.AdamW(params, lr=algo.lr, weight_decay=algo.weight_decay, foreach=True)
    for param in params:  # one step makes the moments: the traced steps find them, as every later step does
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist = LocalDist(META)
    exact = cfg.launcher.reduces_exactly and LAUNCH_KINDS[cfg.launcher.name] in ("local", "ddp")
    dist.prepare(
        policy.trainable,
        optimizer,
        max_grad_norm=algo.max_grad_norm,
        micro_batch_size=algo.train_batch_size,
        compute_dtype=cfg.model.dtype,
        exact_reduction=exact,
    )
    ema = None
    if algo.ema.enabled:
        ema = EMA(params, decay=algo.ema.decay, update_every=algo.ema.update_every, warmup=algo.ema.warmup)
    return types.SimpleNamespace(
        cfg=cfg,
        policy=policy,
        dist=dist,
        optimizer=optimizer,
        ema=ema,
        global_step=0,
        device=META,
        resumed_extra={},
    )
