"""The memory a training process needs, per component, and the cheapest change that makes it fit a device.

Pure arithmetic over three descriptions, so every number can be checked by hand:

* :class:`ParamGroup` — parameters of one component (``transformer``, ``text_encoder``, ``vae``, a reward
  model) with one dtype, trainable or frozen, LoRA or base (``tasks/plan.py`` counts them on a model built
  on the meta device, without allocating);
* :class:`Activations` — bytes autograd keeps for the backward of one training forward, as a line in the
  micro-batch, without and with gradient checkpointing (``training/memory_trace.py`` traces them);
* :class:`Launch` and :class:`Training` — how the run spreads over processes and what it keeps besides
  the weights (micro-batch, checkpointing, EMA, a full-fine-tuning reference copy).

What each launcher keeps on one process (N processes; trainable weights are fp32 in every rlgen run):

=====================  =========  =========  ==================  ==================
state                  local/DDP  ZeRO-2     ZeRO-3              FSDP2
=====================  =========  =========  ==================  ==================
frozen weights         whole      whole      trained model / N   trained model / N
trainable weights      4 B        4 B        4 B / N             4 B / N
gradients              4 B        4 B / N    4 B / N             4 B / N
DDP gradient buckets   4 B (N>1)  —          —                   —
AdamW states           8 B        8 B / N    8 B / N             8 B / N
fp32 master copy       —          4 B / N    4 B / N             —
reduce bucket          —          ≤ 4 B      ≤ 4 B               —
gathered blocks        —          —          2 × largest block   2 × largest block
=====================  =========  =========  ==================  ==================

(bytes per trainable parameter unless said otherwise). Optimizer offload moves the AdamW states and the
master copy to host memory. Everything else is whole on every process: the EMA shadows (fp32), the
frozen reference of full fine-tuning (an fp32 copy of the trained model; LoRA's reference is the adapter
switched off: nothing), text encoders, VAE and local reward models. Not counted: the rollout buffer
(latents and conditioning of an epoch's samples, small next to the weights), the backward's transient
working set (the gradients of the activations in flight) and the allocator's fragmentation and CUDA
context — ``plan.headroom`` keeps a share of the device free for them.

:func:`smallest_fix` tries changes in a fixed order of cost — ZeRO-2 (same processes, no extra compute),
gradient checkpointing (≈ one more forward), a smaller micro-batch with more accumulation (same optimizer
batch, less parallelism), ZeRO-3 / FSDP (more communication), optimizer offload (host transfers every
step), then more processes — first alone, then accumulated in that order, and returns the first that fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = [
    "DTYPE_BYTES",
    "CHANGES_BY_COST",
    "Activations",
    "Change",
    "Fix",
    "Launch",
    "MemoryPlan",
    "ParamGroup",
    "Row",
    "Training",
    "plan_memory",
    "smallest_fix",
]

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1,
    "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int16": 2, "uint16": 2, "complex64": 8, "complex128": 16,
}  # fmt: skip
GRAD_BYTES = 4  # trainable weights are fp32, so are their gradients
ADAM_BYTES = 8  # exp_avg + exp_avg_sq in fp32
MASTER_BYTES = 4  # DeepSpeed's fp32 partition of the trained weights
EMA_BYTES = 4
DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size
SHARDED_KINDS = ("zero3", "fsdp")  # the trained model's weights are partitioned
PARTITIONED_KINDS = ("zero2", "zero3", "fsdp")  # gradients and optimizer states are partitioned
DEEPSPEED_KINDS = ("zero2", "zero3")
MAX_PROCESSES = 1024
GIB = 2**30


@dataclass(frozen=True)
class ParamGroup:
    """Parameters (and buffers) of one component that share a dtype and a role."""

    component: str
    dtype: str
    numel: int
    trainable: bool = False
    lora: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward by one training forward of ``batch`` samples: ``fixed + per_sample·batch``
    without checkpointing, ``checkpointed_fixed + checkpointed_per_sample·batch`` with it (the block inputs
    kept plus one block recomputed during the backward)."""

    fixed: int
    per_sample: int
    checkpointed_fixed: int
    checkpointed_per_sample: int

    def at(self, batch: int, checkpointing: bool) -> int:
        if checkpointing:
            return self.checkpointed_fixed + self.checkpointed_per_sample * batch
        return self.fixed + self.per_sample * batch

    @staticmethod
    def from_two(
        batch_a: int, bytes_a: tuple[int, int], batch_b: int, bytes_b: tuple[int, int]
    ) -> Activations:
        """The line through two traces ``(plain, checkpointed)`` at micro-batches ``batch_a`` < ``batch_b``
        (equal batches: the bytes are taken as all per-sample)."""
        if batch_a == batch_b:
            return Activations(0, bytes_a[0] // batch_a, 0, bytes_a[1] // batch_a)
        slope = [(b - a) // (batch_b - batch_a) for a, b in zip(bytes_a, bytes_b, strict=True)]
        fixed = [max(a - s * batch_a, 0) for a, s in zip(bytes_a, slope, strict=True)]
        return Activations(fixed[0], slope[0], fixed[1], slope[1])


@dataclass(frozen=True)
class Launch:
    """How one run spreads: ``local`` | ``ddp`` | ``zero2`` | ``zero3`` | ``fsdp`` over ``processes``."""

    kind: str
    processes: int = 1
    offload_optimizer: bool = False

    def __post_init__(self) -> None:
        assert self.kind in ("local", "ddp", *PARTITIONED_KINDS), self.kind
        assert self.processes >= 1
        assert not self.offload_optimizer or self.kind in DEEPSPEED_KINDS, "offload is DeepSpeed's"


@dataclass(frozen=True)
class Training:
    """What the training step keeps besides weights and optimizer."""

    micro_batch: int
    """Samples per training forward (``algo.train_batch_size``)."""
    gradient_checkpointing: bool = False
    ema: bool = False
    full_reference: bool = False
    """Full fine-tuning keeps a frozen fp32 copy of the trained model as the KL reference."""
    trained: tuple[str, ...] = ("transformer",)
    """The components the engine trains (and ZeRO-3 / FSDP shard)."""
    accumulation: int = 1
    """Micro-batches per optimizer step on one process (``algo.gradient_accumulation_steps`` ÷ processes)."""
    micro_batch_setting: str | None = "algo.train_batch_size"
    """The setting that chooses the micro-batch (None: the recipe derives it, no smaller one to offer)."""
    weight_copies: tuple[str, ...] = ()
    """Further fp32 copies of the trainable weights the recipe keeps (DiffusionNFT's old policy, …)."""
    largest_block_bytes: int = 0
    """The biggest repeated block of the trained model (ZeRO-3 / FSDP gather one at a time, plus one
    prefetched)."""


@dataclass(frozen=True)
class Row:
    """One line of the plan: what, bytes on one process, and how it was counted."""

    what: str
    nbytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    rows: tuple[Row, ...]
    launch: Launch
    training: Training

    @property
    def total(self) -> int:
        return sum(row.nbytes for row in self.rows)

    def fits(self, device_bytes: int, headroom: float) -> bool:
        """Whether the total leaves ``headroom`` (a share of the device) free."""
        return self.total <= device_bytes * (1 - headroom)


def _share(nbytes: int, processes: int) -> int:
    return math.ceil(nbytes / processes)


def _weight_rows(groups: Iterable[ParamGroup], launch: Launch, training: Training) -> list[Row]:
    """Frozen weights per component and dtype, then the trainable ones (LoRA or the whole model)."""
    rows: list[Row] = []
    frozen: dict[tuple[str, str], int] = {}
    trainable = lora = 0
    for group in groups:
        if group.trainable:
            trainable += group.nbytes
            lora += group.nbytes if group.lora else 0
        else:
            frozen[group.component, group.dtype] = (
                frozen.get((group.component, group.dtype), 0) + group.nbytes
            )
    sharded = launch.kind in SHARDED_KINDS
    for (component, dtype), nbytes in sorted(frozen.items()):
        if sharded and component in training.trained:
            rows.append(Row(f"{component} weights ({dtype}, frozen)", _share(nbytes, launch.processes),
                            f"sharded over {launch.processes}"))  # fmt: skip
        else:
            rows.append(Row(f"{component} weights ({dtype}, frozen)", nbytes))
    what = "LoRA weights (float32)" if lora == trainable else "trainable weights (float32)"
    note = f"sharded over {launch.processes}" if sharded else ""
    rows.append(Row(what, _share(trainable, launch.processes) if sharded else trainable, note))
    return rows


def _state_rows(trainable_numel: int, trained_numel: int, launch: Launch, training: Training) -> list[Row]:
    """Gradients, optimizer states and the copies the launcher and the recipe keep."""
    n, kind = launch.processes, launch.kind
    partitioned = kind in PARTITIONED_KINDS
    grads = trainable_numel * GRAD_BYTES
    rows = [Row("gradients (float32)", _share(grads, n) if partitioned else grads,
                f"partitioned over {n}" if partitioned else "")]  # fmt: skip
    if kind == "ddp" and n > 1:
        rows.append(
            Row("DDP gradient buckets (float32)", grads, "a flat copy of the gradients to all-reduce")
        )
    if kind in DEEPSPEED_KINDS:
        bucket = min(trainable_numel, DEEPSPEED_REDUCE_BUCKET) * GRAD_BYTES
        rows.append(Row("DeepSpeed reduce bucket (float32)", bucket, "reduce_bucket_size, at most 5e8"))
    adam = trainable_numel * ADAM_BYTES
    adam_here = 0 if launch.offload_optimizer else (_share(adam, n) if partitioned else adam)
    adam_note = "offloaded to host memory" if launch.offload_optimizer else (
        f"partitioned over {n}" if partitioned else "")  # fmt: skip
    rows.append(Row("optimizer states (AdamW, 2 × float32)", adam_here, adam_note))
    if kind in DEEPSPEED_KINDS:
        master = 0 if launch.offload_optimizer else _share(trainable_numel * MASTER_BYTES, n)
        rows.append(Row("fp32 master copy (DeepSpeed)", master,
                        "offloaded to host memory" if launch.offload_optimizer else f"partitioned over {n}"))  # fmt: skip
    if training.ema:
        rows.append(Row("EMA shadows (float32)", trainable_numel * EMA_BYTES, "whole on every process"))
    for copy in training.weight_copies:
        rows.append(Row(f"{copy} (float32)", trainable_numel * EMA_BYTES, "a copy of the trainable weights"))
    if training.full_reference:
        rows.append(Row("KL reference copy (float32)", trained_numel * 4,
                        "full fine-tuning: a frozen copy of the trained model"))  # fmt: skip
    if kind in SHARDED_KINDS:
        rows.append(Row("gathered blocks", 2 * training.largest_block_bytes,
                        "the largest block, in use and prefetched"))  # fmt: skip
    return rows


def plan_memory(
    groups: Iterable[ParamGroup], activations: Activations, launch: Launch, training: Training
) -> MemoryPlan:
    """Bytes on one process of a training run, per component (see the module docstring)."""
    groups = list(groups)
    trainable_numel = sum(g.numel for g in groups if g.trainable)
    trained_numel = sum(g.numel for g in groups if g.component in training.trained and not g.lora)
    rows = _weight_rows(groups, launch, training)
    rows += _state_rows(trainable_numel, trained_numel, launch, training)
    checkpointing = training.gradient_checkpointing
    rows.append(Row(
        f"activations (micro-batch {training.micro_batch})",
        activations.at(training.micro_batch, checkpointing),
        f"gradient checkpointing {'on' if checkpointing else 'off'}; "
        f"{'off' if checkpointing else 'on'}: {activations.at(training.micro_batch, not checkpointing) / GIB:.2f} GiB",
    ))  # fmt: skip
    return MemoryPlan(tuple(rows), launch, training)


@dataclass(frozen=True)
class Change:
    """One step of :func:`smallest_fix`: the run after it, what it is, and how to ask for it."""

    launch: Launch
    training: Training
    what: str
    how: tuple[str, ...]


@dataclass(frozen=True)
class Fix:
    """The change(s) to the run, how to ask for them, and the plan after them (``fits``: whether it fits)."""

    changes: tuple[str, ...]
    how: tuple[str, ...]
    plan: MemoryPlan
    fits: bool = True


Fits = Callable[[Launch, Training], bool]
LAUNCHER_NAMES = {"zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3", "fsdp": "fsdp"}


def _zero2(launch: Launch, training: Training, fits: Fits) -> Change | None:
    if launch.processes == 1 or launch.kind in PARTITIONED_KINDS:
        return None
    return Change(dataclasses.replace(launch, kind="zero2"), training,
                  "DeepSpeed ZeRO-2: gradients and optimizer states partitioned", ("launcher=deepspeed_zero2",))  # fmt: skip


def _checkpointing(launch: Launch, training: Training, fits: Fits) -> Change | None:
    if training.gradient_checkpointing:
        return None
    return Change(launch, dataclasses.replace(training, gradient_checkpointing=True),
                  "gradient checkpointing: only block inputs kept, blocks recomputed in the backward",
                  ("model.gradient_checkpointing=true",))  # fmt: skip


def _micro_batch(launch: Launch, training: Training, fits: Fits) -> Change | None:
    """The largest divisor of the micro-batch below it that fits (else 1), with the accumulation that
    keeps the optimizer batch."""
    batch = training.micro_batch
    if batch == 1 or training.micro_batch_setting is None:
        return None
    divisors = sorted((d for d in range(1, batch) if batch % d == 0), reverse=True)
    smaller = next((d for d in divisors if fits(launch, dataclasses.replace(training, micro_batch=d))), 1)
    factor = batch // smaller
    candidate = dataclasses.replace(
        training, micro_batch=smaller, accumulation=training.accumulation * factor
    )
    return Change(launch, candidate, f"micro-batch {smaller} with {factor}× the gradient accumulation",
                  (f"{training.micro_batch_setting}={smaller}", f"algo.gradient_accumulation_steps={candidate.accumulation * launch.processes}"))  # fmt: skip


def _zero3(launch: Launch, training: Training, fits: Fits) -> Change | None:
    if launch.processes == 1 or launch.kind in SHARDED_KINDS:
        return None
    return Change(dataclasses.replace(launch, kind="zero3", offload_optimizer=False), training,
                  "DeepSpeed ZeRO-3 (or FSDP): the trained model's weights partitioned too",
                  ("launcher=deepspeed_zero3",))  # fmt: skip


def _offload(launch: Launch, training: Training, fits: Fits) -> Change | None:
    if launch.offload_optimizer or launch.kind == "fsdp":
        return None
    kind = launch.kind if launch.kind in DEEPSPEED_KINDS else "zero2"
    return Change(dataclasses.replace(launch, kind=kind, offload_optimizer=True), training,
                  f"optimizer offload to host memory (DeepSpeed {LAUNCHER_NAMES[kind]})",
                  ("launcher=accelerate", "launcher.config_file=DS.json with zero_optimization.stage="
                   f"{kind[-1]} and offload_optimizer.device=cpu"))  # fmt: skip


def _more_processes(launch: Launch, training: Training, fits: Fits) -> Change | None:
    """The fewest processes (doubling) that fit with sharded weights (ZeRO-3 unless already sharded)."""
    kind = launch.kind if launch.kind in SHARDED_KINDS else "zero3"
    processes = launch.processes * 2
    while processes < MAX_PROCESSES and not fits(
        dataclasses.replace(launch, kind=kind, processes=processes), training
    ):
        processes *= 2
    processes = min(processes, MAX_PROCESSES)
    return Change(dataclasses.replace(launch, kind=kind, processes=processes), training,
                  f"{processes} processes with {LAUNCHER_NAMES[kind]}",
                  (f"launcher={LAUNCHER_NAMES[kind]}", f"launcher.num_processes × launcher.num_machines = {processes}"))  # fmt: skip


CHANGES_BY_COST = (_zero2, _checkpointing, _micro_batch, _zero3, _offload, _more_processes)
"""The changes :func:`smallest_fix` tries, cheapest first (see the module docstring)."""


def smallest_fix(
    groups: Iterable[ParamGroup],
    activations: Activations,
    launch: Launch,
    training: Training,
    device_bytes: int,
    headroom: float,
) -> Fix | None:
    """The cheapest change (see the module docstring) after which the plan fits; None when it fits already.
    When no single change is enough the changes accumulate in order; the returned :class:`Fix` has
    ``fits=False`` when even all of them together are not enough."""
    groups = list(groups)

    def plan(launch_: Launch, training_: Training) -> MemoryPlan:
        return plan_memory(groups, activations, launch_, training_)

    def fits(launch_: Launch, training_: Training) -> bool:
        return plan(launch_, training_).fits(device_bytes, headroom)

    if fits(launch, training):
        return None
    for step in CHANGES_BY_COST:
        change = step(launch, training, fits)
        if change is not None and fits(change.launch, change.training):
            return Fix((change.what,), change.how, plan(change.launch, change.training))
    whats: list[str] = []
    hows: list[str] = []
    for step in CHANGES_BY_COST:
        change = step(launch, training, fits)
        if change is None:
            continue
        launch, training = change.launch, change.training
        whats.append(change.what)
        hows += change.how
        if fits(launch, training):
            return Fix(tuple(whats), tuple(hows), plan(launch, training))
    return Fix(tuple(whats), tuple(hows), plan(launch, training), fits=False)
