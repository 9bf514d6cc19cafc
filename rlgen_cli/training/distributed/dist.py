"""The distributed context a recipe sees: rank, world size, gather, and how the model trains.

Two implementations behind one small interface (null object, no ``if distributed:`` in the loop):
:class:`LocalDist` for one in-process run, and :class:`AccelerateDist` over an ``accelerate.Accelerator``
when ``rlgen`` workers run under ``accelerate launch``. rlgen adds no communication of its own: gathers,
gradient averaging, sharding and barriers are accelerate's / PyTorch's / DeepSpeed's.

The training surface is the same for every engine::

    optimizer = dist.prepare(policy, optimizer, max_grad_norm=1.0, micro_batch_size=4, compute_dtype="float16")
    dist.backward(loss, sync=is_last_backward_before_the_step)   # as often as the recipe needs
    grad_norm = dist.clip_and_step(optimizer, params, max_norm)

* local / DDP (``launcher=accelerate``): the optimizer is torch's own; clipping is ``clip_grad_norm_``.
  Exact reduction (``prepare(..., exact_reduction=True)``, ``launcher.exact_reduction``) sums gradients in
  float64 once per optimizer step, so the weights do not depend on the process count
  (:mod:`rlgen_cli.training.distributed.exact_reduction`); without it DDP averages them in every backward.
* DeepSpeed ZeRO-2/3 (``launcher=deepspeed_zero2|3``): ``accelerator.prepare(model, optimizer)`` builds the
  engine, which owns gradient reduction (on the backward marked ``sync``), clipping (at ``max_grad_norm``)
  and the optimizer step.
* FSDP2 (``launcher=fsdp``): ``accelerator.prepare`` shards the transformer in place; clipping and the step
  go through the prepared optimizer.

ZeRO-3 and FSDP shard the parameters themselves (:attr:`sharded`): every rank then takes part in every
forward (evaluation included) and in :meth:`full_weights` before rank 0 writes a checkpoint.

Optimizer state in checkpoints: torch's full ``state_dict`` for local / DDP / FSDP (FSDP gathers it); under
DeepSpeed ZeRO (:attr:`shards_optimizer`) the engine's own ``save_checkpoint`` writes one shard per rank and
its ``load_checkpoint`` reads them back, for the same ZeRO stage and number of processes.

fp16 compute (``prepare(..., compute_dtype="float16")``, trained weights fp32): local, DDP and FSDP scale
the loss in :meth:`~Dist.backward` and unscale, clip and step (or skip the step on non-finite gradients)
in :meth:`~Dist.clip_and_step` (:mod:`rlgen_cli.training.distributed.loss_scale`); the scaler's state travels in the
optimizer state. DeepSpeed scales only in its own fp16 mode (``launcher.mixed_precision=fp16``).

accelerate's fp16 autocast (``launcher.mixed_precision=fp16``): under DDP it runs inside the wrapped
model, but rlgen calls the backward and steps torch's optimizer itself, so accelerate's GradScaler would
never scale; rlgen's loss scaler does instead. FSDP's backward and step go through accelerate, which
scales with its own. On CPUs accelerate has no fp16 autocast: refused (:func:`require_autocast_device`).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.training.distributed.exact_reduction import ExactGradients, without_gradient_sync
from rlgen_cli.training.distributed.loss_scale import LossScaler, needs_loss_scaling

log = logging.getLogger(__name__)

# what ``accelerate launch --config_file`` exports to the workers for each engine
ENGINE_FLAGS = {"deepspeed": "ACCELERATE_USE_DEEPSPEED", "fsdp": "ACCELERATE_USE_FSDP"}
# what a checkpoint's optimizer entry holds under DeepSpeed: the engine, its ZeRO stage and process count
# (its shards live in the checkpoint's engine/ directory, under DeepSpeed's tag directory ENGINE_TAG)
ENGINE_KEY, ZERO_STAGE_KEY, WORLD_SIZE_KEY, ENGINE_TAG = "engine", "zero_stage", "world_size", "zero"
# the fp16 loss scaler's state, next to torch's optimizer state in a checkpoint's optimizer entry
SCALER_KEY = "loss_scaler"
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Dist(Protocol):
    engine: str | None
    """What trains the model: None (torch, DDP), ``deepspeed`` or ``fsdp``."""
    rank: int
    world_size: int
    device: torch.device
    sharded: bool
    """Parameters are sharded over ranks (ZeRO-3, FSDP): every rank must run every forward."""
    shards_optimizer: bool
    """Checkpoints hold the optimizer state as per-rank engine shards (DeepSpeed ZeRO), not one dict."""

    @property
    def is_main(self) -> bool: ...
    def gather(self, tensor: Tensor) -> Tensor: ...
    def gather_object(self, obj: Any) -> list[Any]: ...
    def wrap_model(self, module: nn.Module) -> nn.Module: ...
    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]: ...
    def barrier(self) -> None: ...
    def prepare(
        self,
        policy: Any,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float,
        micro_batch_size: int,
        compute_dtype: str = "float32",
        exact_reduction: bool = False,
    ) -> torch.optim.Optimizer: ...
    def backward(self, loss: Tensor, sync: bool = True) -> None: ...
    def clip_and_step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float
    ) -> float: ...
    def loss_scale_metrics(self) -> dict[str, float]: ...
    def full_weights(self) -> AbstractContextManager[Any]: ...
    def gathered(self, params: list[Tensor], modify: bool = False) -> AbstractContextManager[Any]: ...
    def optimizer_state(self, optimizer: torch.optim.Optimizer, staging: Path) -> dict[str, Any] | None: ...
    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any] | None, engine_dir: Path
    ) -> None: ...


class LocalDist:
    """One process: gather is the identity, models run unwrapped, the optimizer is torch's."""

    rank, world_size, sharded, shards_optimizer, engine = 0, 1, False, False, None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.scaler: LossScaler | None = None  # fp16 compute only (prepare)
        self.exact: ExactGradients | None = None  # exact_reduction only (prepare)

    @property
    def is_main(self) -> bool:
        return True

    def gather(self, tensor: Tensor) -> Tensor:
        return tensor

    def gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def wrap_model(self, module: nn.Module) -> nn.Module:
        return module

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return nullcontext()

    def barrier(self) -> None:
        return None

    def prepare(
        self,
        policy: Any,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float,
        micro_batch_size: int,
        compute_dtype: str = "float32",
        exact_reduction: bool = False,
    ) -> torch.optim.Optimizer:
        """The optimizer as it is; a loss scaler when the model computes in fp16 (``compute_dtype``: the
        recipe's ``model.dtype``); float64 accumulation with ``exact_reduction`` (the sum a run over
        several processes makes too)."""
        self.scaler = _scaler_for(compute_dtype, optimizer)
        self.exact = ExactGradients(_optimized(optimizer), world_size=1) if exact_reduction else None
        return optimizer

    def backward(self, loss: Tensor, sync: bool = True) -> None:
        _scaled(loss, self.scaler).backward()
        if self.exact is not None:
            self.exact.collect()

    def clip_and_step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float
    ) -> float:
        """Clip the gradients of ``params`` to ``max_norm`` (inf: none), step, zero; the pre-clip norm.
        With a loss scaler the gradients are unscaled first, and non-finite ones skip the step."""
        if self.exact is not None:
            self.exact.reduce()
        return _torch_clip_and_step(optimizer, params, max_norm, self.scaler)

    def loss_scale_metrics(self) -> dict[str, float]:
        """``loss_scale`` and ``skipped_steps`` (run total) under fp16 loss scaling; else nothing."""
        return {} if self.scaler is None else self.scaler.metrics()

    def full_weights(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def gathered(self, params: list[Tensor], modify: bool = False) -> AbstractContextManager[Any]:
        return nullcontext()

    def optimizer_state(self, optimizer: torch.optim.Optimizer, staging: Path) -> dict[str, Any] | None:
        return _with_scaler(optimizer.state_dict(), self.scaler)

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any] | None, engine_dir: Path
    ) -> None:
        optimizer.load_state_dict(_restore_scaler(_require_optimizer_state(state), self.scaler))


class AccelerateDist:
    """Workers under ``accelerate launch``: DDP, or DeepSpeed ZeRO / FSDP2 when the launch's config names
    one (then also for a single process). Tensors are gathered in rank order; on CPUs every engine talks
    gloo."""

    def __init__(self, cpu: bool) -> None:
        from accelerate import Accelerator

        self.engine = launched_engine()
        if self.engine == "deepspeed" and cpu:
            self.accelerator = _cpu_deepspeed_accelerator()
        else:
            self.accelerator = Accelerator(cpu=cpu, kwargs_handlers=[process_group_kwargs()])
            if self.engine == "fsdp":
                _enable_fsdp(self.accelerator)
        self.rank = self.accelerator.process_index
        self.world_size = self.accelerator.num_processes
        self.device = self.accelerator.device
        self.model: nn.Module | None = None  # the prepared transformer (engine or FSDP module)
        self.scaler: LossScaler | None = None  # fp16 compute under DDP / FSDP (prepare)
        self.exact: ExactGradients | None = None  # DDP with exact_reduction (prepare)
        self._synced = False  # DeepSpeed: the last backward reduced the gradients for a step
        self.zero_stage = (
            self.accelerator.state.deepspeed_plugin.zero_stage if self.engine == "deepspeed" else 0
        )
        self.sharded = self.engine == "fsdp" or self.zero_stage == 3
        self.shards_optimizer = self.engine == "deepspeed"
        if self.engine == "deepspeed" and not self.accelerator.state.deepspeed_plugin.zero3_init_flag:
            # accelerate registers its ZeRO config with transformers whatever zero3_init_flag says, and
            # transformers then builds every model (text encoders included) partitioned; rlgen builds whole
            # models and lets the engine partition the transformer it is given
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def gather(self, tensor: Tensor) -> Tensor:
        """Concatenate every rank's tensor along dim 0 (equal sizes on every rank)."""
        return self.accelerator.gather(tensor.to(self.device).contiguous())

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable, any size), in rank order."""
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def wrap_model(self, module: nn.Module) -> nn.Module:
        """DDP around the trainable module; gradients are averaged in every backward."""
        return self.accelerator.prepare_model(module)

    def no_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        return self.accelerator.no_sync(module)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    # -- training through the engine -------------------------------------------------------------
    def prepare(
        self,
        policy: Any,
        optimizer: torch.optim.Optimizer,
        *,
        max_grad_norm: float,
        micro_batch_size: int,
        compute_dtype: str = "float32",
        exact_reduction: bool = False,
    ) -> torch.optim.Optimizer:
        """Route the policy's gradient-carrying forwards through the engine and return the optimizer to
        step. DDP wraps the transformer only; ZeRO / FSDP take the optimizer too (``policy.distribute``
        hands over the transformer, the prepared module comes back). fp16 compute (``compute_dtype``, the
        recipe's ``model.dtype``) gets rlgen's loss scaler under DDP / FSDP, DeepSpeed's own under ZeRO.
        ``exact_reduction`` (DDP only): DDP broadcasts the starting weights but never all-reduces; the
        gradients are summed in float64 once per step (:class:`ExactGradients`)."""
        if exact_reduction and self.engine is not None:
            raise UserError(
                f"launcher.exact_reduction=true needs the gradients in rlgen's hands, and this launch runs "
                f"{self.engine} (from launcher.config_file?), which reduces them inside its engine: pass "
                "launcher.exact_reduction=false, or drop the engine from the config file"
            )
        if self.engine == "deepspeed":
            self._require_deepspeed_scaling(compute_dtype, optimizer)
        else:
            self.scaler = _scaler_for(compute_dtype, optimizer)
            if self.scaler is not None and self.accelerator.scaler is not None:
                raise UserError(
                    "launcher.mixed_precision=fp16 adds accelerate's own autocast and loss scaler, and "
                    "model.dtype=float16 has rlgen's: pass launcher.mixed_precision=fp32 (rlgen autocasts the "
                    "model in model.dtype and scales the loss itself)"
                )
            if self.engine is None and self.accelerator.scaler is not None:
                # accelerate's fp16 autocast runs in the DDP-wrapped forward, but its GradScaler only acts
                # in accelerator.backward and its prepared optimizer, which DDP here never uses
                self.scaler = _scaler_for("float16", optimizer)
        if self.engine is None and exact_reduction:
            self.exact = ExactGradients(_optimized(optimizer), world_size=self.world_size)
            policy.distribute(without_gradient_sync(self.wrap_model))
            return optimizer
        if self.engine is None:
            policy.distribute(self.wrap_model)
            return optimizer
        if self.engine == "deepspeed":  # the recipe's numbers, not accelerate's "auto" defaults
            config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            config["train_micro_batch_size_per_gpu"] = micro_batch_size
            config["gradient_clipping"] = max(max_grad_norm, 0.0)  # 0 = off
        prepared: dict[str, Any] = {}

        def wrap(module: nn.Module) -> nn.Module:
            prepared["model"], prepared["optimizer"] = self.accelerator.prepare(module, optimizer)
            return prepared["model"]

        policy.distribute(wrap)
        self.model = prepared["model"]
        return prepared["optimizer"]

    def backward(self, loss: Tensor, sync: bool = True) -> None:
        """``loss.backward()`` (scaled under fp16); under DeepSpeed the engine's, which reduces the
        accumulated gradients on the backward marked ``sync`` (the last before an optimizer step)."""
        if self.engine == "deepspeed":
            self.model.set_gradient_accumulation_boundary(sync)
            self.model.backward(loss)
            self._synced = sync
        elif self.engine == "fsdp":
            self.accelerator.backward(_scaled(loss, self.scaler))
        else:
            _scaled(loss, self.scaler).backward()
            if self.exact is not None:
                self.exact.collect()

    def clip_and_step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float
    ) -> float:
        """Clip, step, zero the gradients; returns the pre-clip global norm. Engines clip their own
        (sharded) parameters: ``params`` is what DDP clips."""
        if self.engine == "deepspeed":  # clips at prepare's max_grad_norm, steps, zeroes
            if not self._synced:
                raise RuntimeError(
                    "DeepSpeed reduces gradients in the engine's backward: the last backward before a step "
                    "must be dist.backward(loss, sync=True) (a plain loss.backward() bypasses the engine)"
                )
            self._synced = False
            self.model.step()
            norm = self.model.get_global_grad_norm()  # None when the config turns the norm off
            return math.nan if norm is None else float(norm)
        if self.engine == "fsdp":
            live = [p for p in self.model.parameters() if p.requires_grad]

            def clip() -> float:  # the global norm over every rank's shards: ranks skip steps together
                norm = self.accelerator.clip_grad_norm_(live, max_norm)
                return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

            return _step(optimizer, live, clip, self.scaler)
        if self.exact is not None:
            self.exact.reduce()
        return _torch_clip_and_step(optimizer, params, max_norm, self.scaler)

    def loss_scale_metrics(self) -> dict[str, float]:
        """``loss_scale`` and ``skipped_steps`` under rlgen's fp16 loss scaling (DDP, FSDP); else nothing
        (DeepSpeed's fp16 mode logs its own overflows)."""
        return {} if self.scaler is None else self.scaler.metrics()

    def _require_deepspeed_scaling(self, compute_dtype: str, optimizer: torch.optim.Optimizer) -> None:
        """:func:`require_deepspeed_scaling` for this launch (the trained weights must be fp32, too)."""
        if _scaler_for(compute_dtype, optimizer) is not None:
            require_deepspeed_scaling(compute_dtype, self.accelerator.mixed_precision)

    # -- checkpoints -----------------------------------------------------------------------------
    def full_weights(self) -> AbstractContextManager[Any]:
        """Within: ``state_dict()`` of the transformer holds full, unsharded tensors (ZeRO-3 / FSDP gather
        them; a collective, so every rank enters). A no-op for DDP and ZeRO-2, whose weights are whole."""
        if self.engine == "fsdp":
            return _fsdp_full_state_dict(self.model)
        if self.sharded:
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.model.module.parameters()), modifier_rank=None)
        return nullcontext()

    def gathered(self, params: list[Tensor], modify: bool = False) -> AbstractContextManager[Any]:
        """Within: ZeRO-3 ``params`` hold their full values (a collective: every rank enters); with
        ``modify``, rank 0's values are written back to every rank's shards on exit. A no-op for whole
        weights (DDP, ZeRO-2) and for parameters the engine has not partitioned yet. Not for FSDP2, whose
        gathered values never reach its shards (the flow recipe refuses an EMA there)."""
        if self.zero_stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None)

    def optimizer_state(self, optimizer: torch.optim.Optimizer, staging: Path) -> dict[str, Any] | None:
        """The optimizer state for the checkpoint (collective: every rank calls it).

        FSDP: torch's full state dict keyed by parameter names. DeepSpeed: every rank writes its ZeRO shard
        into ``staging`` (:func:`~rlgen_cli.training.checkpoints.checkpoint.engine_staging`) through the engine's
        ``save_checkpoint``; the returned entry names the stage and process count the shards need."""
        if self.engine == "deepspeed":
            return self._save_engine_state(staging)
        if self.engine == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_optimizer_state_dict(self.model, optimizer.optimizer, options=options)
            return _with_scaler(state, self.scaler)
        return _with_scaler(optimizer.state_dict(), self.scaler)

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any] | None, engine_dir: Path
    ) -> None:
        """Restore what :meth:`optimizer_state` wrote, into the prepared optimizer (DeepSpeed: from the
        shards in ``engine_dir``, every rank its own)."""
        if self.engine == "deepspeed":
            self._load_engine_state(state, engine_dir)
            return
        state = _restore_scaler(_require_optimizer_state(state), self.scaler)
        if self.engine == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(self.model, optimizer.optimizer, state, options=options)
        else:
            optimizer.load_state_dict(state)

    def _save_engine_state(self, staging: Path) -> dict[str, Any]:
        if self.is_main:  # a crashed save's leftovers would mix with this save's shards
            shutil.rmtree(staging, ignore_errors=True)
        self.barrier()
        # the frozen base weights come from the model config on resume: only trainable ones are the run's;
        # the engine's save ends with a barrier, so every shard is on disk when this returns
        self.model.save_checkpoint(
            str(staging), tag=ENGINE_TAG, save_latest=False, exclude_frozen_parameters=True
        )
        return {ENGINE_KEY: "deepspeed", ZERO_STAGE_KEY: self.zero_stage, WORLD_SIZE_KEY: self.world_size}

    def _load_engine_state(self, state: dict[str, Any] | None, engine_dir: Path) -> None:
        if not _is_engine_state(state):
            raise UserError(
                "this checkpoint holds one full optimizer state (written by launcher=local, accelerate or fsdp) "
                "and DeepSpeed ZeRO loads only its own per-rank shards: resume with the launcher that wrote "
                "it, or start a fresh run from its weights"
            )
        saved = (state[ZERO_STAGE_KEY], state[WORLD_SIZE_KEY])
        if saved != (self.zero_stage, self.world_size):
            raise UserError(
                f"this checkpoint's optimizer state is sharded for ZeRO-{saved[0]} over {saved[1]} processes, "
                f"this run is ZeRO-{self.zero_stage} over {self.world_size}: resume with "
                f"launcher=deepspeed_zero{saved[0]} and {saved[1]} processes in all (launcher.num_processes × "
                "launcher.num_machines)"
            )
        # the module's trainable weights in the shards equal the checkpoint's raw weights (already loaded);
        # its frozen ones were left out on save, hence non-strict
        path, _ = self.model.load_checkpoint(
            str(engine_dir), tag=ENGINE_TAG, load_module_strict=False, load_lr_scheduler_states=False
        )
        if path is None:
            raise UserError(f"{engine_dir} holds no DeepSpeed checkpoint; resume from an older checkpoint")


def require_deepspeed_scaling(compute_dtype: str, mixed_precision: str) -> None:
    """fp16 compute under ZeRO needs DeepSpeed's fp16 mode: its engine steps, so only its own loss scaler
    can unscale before it clips and skip a step. ``compute_dtype``: ``model.dtype``; ``mixed_precision``:
    the launch's (``launcher.mixed_precision``). Shared by the DeepSpeed workers and ``rlgen plan``.

    Raises:
        UserError: fp16 compute without DeepSpeed's fp16 mode.
    """
    if compute_dtype == "float16" and mixed_precision != "fp16":
        raise UserError(
            "model.dtype=float16 under DeepSpeed trains without loss scaling (fp16 gradients underflow "
            "to 0) unless DeepSpeed's own fp16 mode scales the loss: pass model.dtype=bfloat16, or "
            "launcher.mixed_precision=fp16 (DeepSpeed then holds the trained weights in fp16 with fp32 "
            "master copies), or train with launcher=local, accelerate or fsdp, where rlgen scales the loss"
        )


def require_autocast_device(mixed_precision: str, cpu: bool) -> None:
    """fp16 autocast needs an accelerator: on CPUs accelerate has none and trains in fp32 (bf16 it has).
    ``mixed_precision``: ``launcher.mixed_precision`` (or accelerate's ``fp16`` / ``bf16`` / ``no``).

    Raises:
        UserError: fp16 on CPU processes.
    """
    if cpu and mixed_precision == "fp16":
        raise UserError(
            "launcher.mixed_precision=fp16 does nothing on CPUs: accelerate has no fp16 autocast there, and "
            "the run would train in fp32. Pass launcher.mixed_precision=bf16 (CPU autocast) or fp32, or "
            "train on GPUs"
        )


def _optimized(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _torch_clip_and_step(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    max_norm: float,
    scaler: LossScaler | None = None,
) -> float:
    return _step(optimizer, params, lambda: torch.nn.utils.clip_grad_norm_(params, max_norm).item(), scaler)


def _step(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    clip: Callable[[], float],
    scaler: LossScaler | None,
) -> float:
    """Clip (``clip`` returns the pre-clip global norm), step, zero the gradients; the norm. With a loss
    scaler: unscale before clipping, and a non-finite norm (an inf / NaN gradient anywhere) skips the step
    and backs the scale off, as ``torch.amp.GradScaler`` does."""
    if scaler is not None:
        scaler.unscale_(params)
    grad_norm = clip()
    finite = math.isfinite(grad_norm)
    if scaler is None or finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.update(finite)
    return grad_norm


def _scaler_for(compute_dtype: str, optimizer: torch.optim.Optimizer) -> LossScaler | None:
    """A fresh loss scaler when a model computing in ``compute_dtype`` needs one for ``optimizer``'s
    (fp32) weights; None in bf16 and fp32."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {sorted(COMPUTE_DTYPES)}, not {compute_dtype!r}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return LossScaler() if needs_loss_scaling(COMPUTE_DTYPES[compute_dtype], params) else None


def _scaled(loss: Tensor, scaler: LossScaler | None) -> Tensor:
    return loss if scaler is None else scaler.scaled(loss)


def _with_scaler(state: dict[str, Any], scaler: LossScaler | None) -> dict[str, Any]:
    """The optimizer state, with the loss scaler's next to it when there is one (bf16 / fp32: as is)."""
    return state if scaler is None else {**state, SCALER_KEY: scaler.state_dict()}


def _restore_scaler(state: dict[str, Any], scaler: LossScaler | None) -> dict[str, Any]:
    """Load a checkpoint's loss-scaler state into ``scaler``; the optimizer state without it."""
    saved = state.get(SCALER_KEY)
    if scaler is not None and saved is not None:
        scaler.load_state_dict(saved)
    elif scaler is not None:
        log.warning(
            "this checkpoint was written without fp16 loss scaling: the loss scale starts again at %g",
            scaler.scale,
        )
    elif saved is not None:
        log.info("this checkpoint's fp16 loss scale is not used: this run does not compute in fp16")
    return {key: value for key, value in state.items() if key != SCALER_KEY}


def _is_engine_state(state: dict[str, Any] | None) -> bool:
    """Whether a checkpoint's optimizer entry points at DeepSpeed shards (rather than holding a state)."""
    return isinstance(state, dict) and state.get(ENGINE_KEY) == "deepspeed"


def _require_optimizer_state(state: dict[str, Any] | None) -> dict[str, Any]:
    """A full torch optimizer state, or a :class:`UserError` saying which launcher can resume instead."""
    if _is_engine_state(state):
        raise UserError(
            f"this checkpoint's optimizer state is DeepSpeed ZeRO-{state[ZERO_STAGE_KEY]} shards of "
            f"{state[WORLD_SIZE_KEY]} processes: resume with launcher=deepspeed_zero{state[ZERO_STAGE_KEY]} "
            f"and {state[WORLD_SIZE_KEY]} processes in all (launcher.num_processes × launcher.num_machines), or "
            "start a fresh run from its weights"
        )
    if state is None:
        raise UserError(
            "this checkpoint holds no optimizer state (an older rlgen wrote it under DeepSpeed ZeRO without "
            "its shards); start a fresh run from its weights instead of resuming"
        )
    return state


@contextmanager
def _fsdp_full_state_dict(model: nn.Module) -> Iterator[None]:
    """FSDP2's ``state_dict()`` always returns shards (DTensors); gather the full one (a collective) and
    let the module's ``state_dict()`` return it while the context lasts (rank 0 gets the tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def unsharded(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key in state:
            if key.removeprefix(prefix) in full:
                state[key] = full[key.removeprefix(prefix)]

    handle = model.register_state_dict_post_hook(unsharded)
    try:
        yield
    finally:
        handle.remove()


COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
"""How long a process waits in a collective for the others (torch's NCCL default: 10 minutes). Under DDP
and ZeRO-2 rank 0 evaluates and writes checkpoints alone while the others wait in their next collective;
a whole test split (``data.eval_num_prompts=0``: OCR's 1018 prompts, SD3.5-Medium at 512 px, 40 steps
with CFG: ≈ 200 PFLOP, 8 minutes at 40 % MFU on an H100, then the OCR scoring) comes near or past 10
minutes, and the watchdog would end the run."""


def process_group_kwargs(**kwargs: Any) -> Any:
    """accelerate's process-group settings: :data:`COLLECTIVE_TIMEOUT` and ``kwargs``."""
    from accelerate.utils import InitProcessGroupKwargs

    return InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT, **kwargs)


def _cpu_deepspeed_accelerator() -> Any:
    """accelerate enables DeepSpeed only for a non-CPU Accelerator, and with no accelerator device it leaves
    the backend unset and counts ONE process; naming gloo gives the true ranks. DeepSpeed's optional shared-
    memory allreduce op would be JIT-compiled on first use (minutes): gloo does without it."""
    import deepspeed
    from accelerate import Accelerator

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return Accelerator(kwargs_handlers=[process_group_kwargs(backend="gloo")])


def _enable_fsdp(accelerator: Any) -> None:
    """accelerate turns FSDP on only for accelerator devices (``AcceleratorState``: MULTI_GPU, …); on CPUs
    the launch's FSDP settings are ignored. PyTorch's FSDP2 itself runs on gloo, so switch it on with the
    plugin accelerate would have built from the same environment."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if accelerator.distributed_type == DistributedType.FSDP:
        return
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP


def launched_engine() -> str | None:
    """``deepspeed`` / ``fsdp`` when ``accelerate launch`` ran with such a config, else None (DDP)."""
    for engine, flag in ENGINE_FLAGS.items():
        if os.environ.get(flag, "false").lower() == "true":
            return engine
    return None


def launched_world_size() -> int:
    """Processes of this launch (``WORLD_SIZE`` set by accelerate / torchrun; 1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def close_process_group() -> None:
    """After a run: wait for every rank, then tear the process group down. A rank that exits while
    another's gloo threads still talk to it can abort at interpreter exit ("terminate called without an
    active exception"), failing a run that finished."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def make_dist(device_name: str) -> Dist:
    """:class:`AccelerateDist` inside a multi-process or engine launch, else :class:`LocalDist`."""
    from rlgen_cli.models import resolve_device

    if launched_world_size() > 1 or launched_engine() is not None:
        cpu = device_name == "cpu" or not torch.cuda.is_available()
        on_cpu = cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() == "true"
        require_autocast_device(os.environ.get("ACCELERATE_MIXED_PRECISION", "no"), on_cpu)
        return _require_launched_world(AccelerateDist(cpu=cpu))
    return LocalDist(resolve_device(device_name))


def _require_launched_world(dist: AccelerateDist) -> AccelerateDist:
    """The ranks accelerate set up are the processes the launch started (``WORLD_SIZE``): accelerate counts
    one process where it finds no backend for the device (an engine on CPUs without gloo named)."""
    if dist.world_size != launched_world_size():
        raise UserError(
            f"the launch started {launched_world_size()} processes but accelerate set up {dist.world_size} "
            f"rank(s) ({dist.engine or 'DDP'} on {dist.device}): each would train alone. Check the launch's "
            "accelerate settings (launcher.config_file), or launch with launcher=accelerate and no file"
        )
    return dist
