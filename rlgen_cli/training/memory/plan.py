"""The memory a training process needs, per component, and the cheapest change that makes it fit a device.

Arithmetic over four descriptions, so every number can be checked by hand:

* :class:`ParamGroup` — parameters of one component (``transformer``, ``text_encoder``, ``vae``, a reward
  model) with one dtype, trainable or frozen, LoRA or base (``tasks/plan.py`` counts them on a model built
  on the meta device, without allocating);
* :class:`Activations` — bytes autograd keeps for the backward of one training forward, as a line in the
  micro-batch, without and with gradient checkpointing (``training/memory/trace.py`` traces them);
* :class:`Epoch` — what an epoch adds on top of the state, phase by phase: the rollout (batches of
  ``algo.sample_batch_size`` sampled without gradients, each sample's trajectory and conditioning kept
  for the update) and the update (one training step at a time: forward, backward, optimizer step). Its
  two peak functions are the peaks ``tasks/plan.py`` traces by running the recipe's own code on the meta
  device (``memory_trace.trace_peak``);
* :class:`Launch` and :class:`Training` — how the run spreads over processes and what it keeps besides
  the weights (micro-batch, checkpointing, EMA, a full-fine-tuning reference copy, float64 gradient sums,
  prompt caches).

What each launcher keeps on one process between steps (N processes; trainable weights are fp32 in every
rlgen run):

=====================  =========  =========  ==================  ==================
state                  local/DDP  ZeRO-2     ZeRO-3              FSDP2
=====================  =========  =========  ==================  ==================
frozen weights         whole      whole      trained model / N   trained model / N
trainable weights      4 B        4 B        4 B / N             4 B / N
gradients              (step)     4 B / N    4 B / N             4 B / N
DDP gradient buckets   4 B (N>1)  —          —                   —
float64 gradient sums  8 B        —          —                   —
AdamW states           8 B        8 B / N    8 B / N             8 B / N
fp32 master copy       —          4 B / N    4 B / N             —
reduce bucket          —          ≤ 4 B      ≤ 4 B               —
gathered blocks        —          —          2 × largest block   2 × largest block
=====================  =========  =========  ==================  ==================

(bytes per trainable parameter unless said otherwise; the float64 sums are ``launcher.exact_reduction``,
on by default where rlgen reduces the gradients itself). Under local / DDP the gradients exist only inside
the training step — they are made by the backward and freed by the optimizer step — so the step's traced
peak holds them. Optimizer offload moves the AdamW states and the master copy to host memory. Everything
else is whole on every process: the EMA shadows (fp32), the frozen reference of full fine-tuning (an fp32
copy of the trained model; LoRA's reference is the adapter switched off: nothing), text encoders, VAE,
local reward models and the prompt caches (each at its ``model.prompt_cache_mb`` cap). Not counted: the
allocator's fragmentation and the CUDA context — ``plan.headroom`` keeps a share of the device free for them.

The peak of an epoch on one process (n samples, batches of b, micro-batches of B, kept per sample: s bytes):

* rollout — the batches before the last one keep their samples while the last one samples, and the
  concatenation at its end holds every sample twice: ``max((n − b)·s + rollout_peak(b), 2·n·s)``;
* update — the epoch's samples and the copy the update trains on (the samples it keeps) stay while each
  step runs: ``2·n·s + step_peak(B, checkpointing)``;
* evaluation, with EMA — the live trainable weights backed up while the EMA weights sample (4 B per
  trainable parameter; a checkpoint clones the shadows: as much) + ``rollout_peak(b)``, a bound from
  above (an evaluation keeps no trajectory).

The total is the state plus the largest.

:func:`smallest_fix` tries changes in a fixed order of cost — ZeRO-2 (same processes, no extra compute),
gradient checkpointing (≈ one more forward), a smaller micro-batch with more accumulation (same optimizer
batch, less parallelism), a smaller sampling batch, ZeRO-3 / FSDP (more communication), optimizer offload
(host transfers every step), then more processes — first alone, then accumulated in that order, and
returns the first that fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = [
    "DTYPE_BYTES",
    "CHANGES_BY_COST",
    "COMMON_DEVICES_GB",
    "Activations",
    "Change",
    "DeviceFit",
    "device_fits",
    "Epoch",
    "Fix",
    "Launch",
    "MemoryPlan",
    "ParamGroup",
    "Row",
    "Training",
    "plan_memory",
    "smallest_device",
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
EXACT_SUM_BYTES = 8  # launcher.exact_reduction: a float64 sum per trainable element (and per tensor)
DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size
SHARDED_KINDS = ("zero3", "fsdp")  # the trained model's weights are partitioned
PARTITIONED_KINDS = ("zero2", "zero3", "fsdp")  # gradients and optimizer states are partitioned
DEEPSPEED_KINDS = ("zero2", "zero3")
MAX_PROCESSES = 1024
GIB = 2**30


@dataclass(frozen=True)
class Row:
    """One line of the plan: what, bytes on one process, and how it was counted."""

    what: str
    nbytes: int
    note: str = ""


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
    accumulation_setting: str | None = "algo.gradient_accumulation_steps"
    """The setting that keeps the optimizer batch when the micro-batch shrinks (None: the recipe trains
    every micro-batch of the epoch before it steps, whatever their size)."""
    weight_copies: tuple[str, ...] = ()
    """Further fp32 copies of the trainable weights the recipe keeps (DiffusionNFT's old policy, …)."""
    largest_block_bytes: int = 0
    """The biggest repeated block of the trained model (ZeRO-3 / FSDP gather one at a time, plus one
    prefetched)."""
    sample_batch: int = 1
    """Samples per rollout forward (``algo.sample_batch_size``)."""
    exact_sum_tensors: int = 0
    """Trainable tensors whose gradients are summed in float64 (``launcher.exact_reduction``); 0: off."""
    held: tuple[Row, ...] = ()
    """Other state the run keeps on the device whatever the phase (prompt caches at their cap, reward
    models whose size the user declared)."""


@dataclass(frozen=True)
class Epoch:
    """What an epoch adds on top of the state, on one process (see the module docstring)."""

    samples: int
    """Rollout samples of an epoch over all processes (``algo.prompts_per_epoch × algo.group_size``)."""
    kept_per_sample: int
    """Bytes one sample keeps on the device from its rollout until the update ends (its trajectory and
    conditioning)."""
    rollout_peak: Callable[[int], int]
    """Sample batch → the peak of rolling one batch out: the sampling forwards, the batch's trajectory and
    conditioning, the decode."""
    step_peak: Callable[[int, bool], int]
    """(micro-batch, gradient checkpointing) → the peak of one training step: saved activations, the
    forward's intermediates, the gradients, the backward's buffers, the optimizer step's temporaries."""
    update_copies: int = 2
    """Copies of this process's kept samples the update holds (Flow-GRPO: the epoch's and the copy it
    trains on; NFT / AWM, DPO / SFT: one)."""
    update_global_copies: int = 0
    """Copies of the whole epoch's samples, over every process, the update holds (DPO / SFT gather them)."""
    phase: str = "rollout"
    """What the sampling phase is: ``rollout``, or ``evaluation`` (pretraining samples only to evaluate)."""

    @staticmethod
    def of_activations(activations: Activations) -> Epoch:
        """An epoch whose only cost is a step's saved activations (for arithmetic by hand)."""
        return Epoch(0, 0, lambda batch: 0, activations.at)


@dataclass(frozen=True)
class MemoryPlan:
    rows: tuple[Row, ...]
    """The state kept whatever the phase."""
    peaks: tuple[Row, ...]
    """Each phase of an epoch above the state (rollout, update); the largest counts."""
    launch: Launch
    training: Training

    @property
    def state(self) -> int:
        return sum(row.nbytes for row in self.rows)

    @property
    def peak(self) -> Row:
        """The phase that needs the most."""
        return max(self.peaks, key=lambda row: row.nbytes)

    @property
    def total(self) -> int:
        return self.state + self.peak.nbytes

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
            rows.append(
                Row(
                    f"{component} weights ({dtype}, frozen)",
                    _share(nbytes, launch.processes),
                    f"sharded over {launch.processes}",
                )
            )
        else:
            rows.append(Row(f"{component} weights ({dtype}, frozen)", nbytes))
    what = "LoRA weights (float32)" if lora == trainable else "trainable weights (float32)"
    note = f"sharded over {launch.processes}" if sharded else ""
    rows.append(Row(what, _share(trainable, launch.processes) if sharded else trainable, note))
    return rows


def _state_rows(trainable_numel: int, trained_numel: int, launch: Launch, training: Training) -> list[Row]:
    """Gradients (where an engine keeps them between steps), optimizer states and the copies the launcher
    and the recipe keep."""
    n, kind = launch.processes, launch.kind
    partitioned = kind in PARTITIONED_KINDS
    grads = trainable_numel * GRAD_BYTES
    rows = []
    if partitioned:
        rows.append(Row("gradients (float32)", _share(grads, n), f"partitioned over {n}"))
    elif training.exact_sum_tensors:
        rows.append(
            Row(
                "float64 gradient sums",
                (trainable_numel + training.exact_sum_tensors) * EXACT_SUM_BYTES,
                "launcher.exact_reduction: one float64 per trainable element",
            )
        )
    if kind == "ddp" and n > 1:
        rows.append(
            Row("DDP gradient buckets (float32)", grads, "a flat copy of the gradients to all-reduce")
        )
    if kind in DEEPSPEED_KINDS:
        bucket = min(trainable_numel, DEEPSPEED_REDUCE_BUCKET) * GRAD_BYTES
        rows.append(Row("DeepSpeed reduce bucket (float32)", bucket, "reduce_bucket_size, at most 5e8"))
    adam = trainable_numel * ADAM_BYTES
    adam_here = 0 if launch.offload_optimizer else (_share(adam, n) if partitioned else adam)
    adam_note = (
        "offloaded to host memory"
        if launch.offload_optimizer
        else (f"partitioned over {n}" if partitioned else "")
    )
    rows.append(Row("optimizer states (AdamW, 2 × float32)", adam_here, adam_note))
    if kind in DEEPSPEED_KINDS:
        master = 0 if launch.offload_optimizer else _share(trainable_numel * MASTER_BYTES, n)
        rows.append(
            Row(
                "fp32 master copy (DeepSpeed)",
                master,
                "offloaded to host memory" if launch.offload_optimizer else f"partitioned over {n}",
            )
        )
    if training.ema:
        rows.append(Row("EMA shadows (float32)", trainable_numel * EMA_BYTES, "whole on every process"))
    for copy in training.weight_copies:
        rows.append(Row(f"{copy} (float32)", trainable_numel * EMA_BYTES, "a copy of the trainable weights"))
    if training.full_reference:
        rows.append(
            Row(
                "KL reference copy (float32)",
                trained_numel * 4,
                "full fine-tuning: a frozen copy of the trained model",
            )
        )
    if kind in SHARDED_KINDS:
        rows.append(
            Row(
                "gathered blocks",
                2 * training.largest_block_bytes,
                "the largest block, in use and prefetched",
            )
        )
    return rows + list(training.held)


def _peak_rows(
    activations: Activations, epoch: Epoch, launch: Launch, training: Training, trainable_numel: int
) -> tuple[Row, ...]:
    """The rollout's and the update's peaks above the state, and with EMA the evaluation's (see the module
    docstring)."""
    samples = math.ceil(epoch.samples / launch.processes)
    batch = min(training.sample_batch, samples) if samples else training.sample_batch
    kept = samples * epoch.kept_per_sample
    rollout = max((samples - batch) * epoch.kept_per_sample + epoch.rollout_peak(batch), 2 * kept)
    checkpointing = training.gradient_checkpointing
    step = epoch.step_peak(training.micro_batch, checkpointing)
    saved = activations.at(training.micro_batch, checkpointing)
    other = activations.at(training.micro_batch, not checkpointing)
    held = epoch.update_copies * kept + epoch.update_global_copies * epoch.samples * epoch.kept_per_sample
    sampling = (
        (
            Row(
                f"rollout peak (sample batch {batch})",
                rollout,
                f"{samples} samples kept ({kept / GIB:.2f} GiB) + one batch sampled and decoded",
            ),
        )
        if epoch.phase == "rollout"
        else ()
        if training.ema
        else (
            Row(
                f"evaluation peak (sample batch {batch})",
                epoch.rollout_peak(batch),
                "one batch sampled and decoded",
            ),
        )
    )
    return (
        sampling
        + (
            Row(
                f"training step peak (micro-batch {training.micro_batch})",
                held + step,
                f"one step {step / GIB:.2f} GiB (activations, gradients, the backward's buffers; saved "
                f"activations {saved / GIB:.2f} GiB with gradient checkpointing {'on' if checkpointing else 'off'}, "
                f"{other / GIB:.2f} {'off' if checkpointing else 'on'}) + the samples it trains on "
                f"{held / GIB:.2f} GiB",
            ),
        )
        + _evaluation_rows(epoch, training, trainable_numel, batch)
    )


def _evaluation_rows(epoch: Epoch, training: Training, trainable_numel: int, batch: int) -> tuple[Row, ...]:
    """With EMA, an evaluation swaps the shadows in and backs the live weights up (a checkpoint clones the
    shadows: as much), then samples in batches of ``batch``: at most one rollout batch's peak on top."""
    if not training.ema:
        return ()
    backup = trainable_numel * EMA_BYTES
    return (
        Row(
            f"evaluation peak (sample batch {batch})",
            backup + epoch.rollout_peak(batch),
            f"the live weights backed up while the EMA weights sample ({backup / GIB:.2f} GiB) + one "
            "batch sampled and decoded, its trajectory included (an evaluation keeps none)",
        ),
    )


def plan_memory(
    groups: Iterable[ParamGroup], activations: Activations, launch: Launch, training: Training, epoch: Epoch
) -> MemoryPlan:
    """Bytes on one process of a training run: the state per component, and each phase's peak above it
    (see the module docstring)."""
    groups = list(groups)
    trainable_numel = sum(g.numel for g in groups if g.trainable)
    trained_numel = sum(g.numel for g in groups if g.component in training.trained and not g.lora)
    rows = _weight_rows(groups, launch, training)
    rows += _state_rows(trainable_numel, trained_numel, launch, training)
    peaks = _peak_rows(activations, epoch, launch, training, trainable_numel)
    return MemoryPlan(tuple(rows), peaks, launch, training)


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


@dataclass(frozen=True)
class Judge:
    """Plans a changed run and tells whether it fits the device."""

    plan: Callable[[Launch, Training], MemoryPlan]
    usable_bytes: float

    def fits(self, launch: Launch, training: Training) -> bool:
        return self.plan(launch, training).total <= self.usable_bytes


LAUNCHER_NAMES = {"zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3", "fsdp": "fsdp"}


def _zero2(launch: Launch, training: Training, judge: Judge) -> Change | None:
    if launch.processes == 1 or launch.kind in PARTITIONED_KINDS:
        return None
    return Change(
        dataclasses.replace(launch, kind="zero2"),
        training,
        "DeepSpeed ZeRO-2: gradients and optimizer states partitioned",
        ("launcher=deepspeed_zero2",),
    )


def _checkpointing(launch: Launch, training: Training, judge: Judge) -> Change | None:
    if training.gradient_checkpointing:
        return None
    return Change(
        launch,
        dataclasses.replace(training, gradient_checkpointing=True),
        "gradient checkpointing: only block inputs kept, blocks recomputed in the backward",
        ("model.gradient_checkpointing=true",),
    )


def _micro_batch(launch: Launch, training: Training, judge: Judge) -> Change | None:
    """The largest divisor of the micro-batch below it that fits (else 1), with the accumulation that
    keeps the optimizer batch."""
    batch = training.micro_batch
    if batch == 1 or training.micro_batch_setting is None:
        return None
    divisors = sorted((d for d in range(1, batch) if batch % d == 0), reverse=True)
    smaller = next(
        (d for d in divisors if judge.fits(launch, dataclasses.replace(training, micro_batch=d))), 1
    )
    factor = batch // smaller
    candidate = dataclasses.replace(
        training, micro_batch=smaller, accumulation=training.accumulation * factor
    )
    how = [f"{training.micro_batch_setting}={smaller}"]
    if training.accumulation_setting is not None:
        how.append(f"{training.accumulation_setting}={candidate.accumulation * launch.processes}")
    return Change(
        launch, candidate, f"micro-batch {smaller} with {factor}× the gradient accumulation", tuple(how)
    )


def _sample_batch(launch: Launch, training: Training, judge: Judge) -> Change | None:
    """The largest divisor of the sampling batch below it that fits (else 1): more, smaller rollout
    batches, the same samples. None when no sampling phase is what needs the most."""
    batch = training.sample_batch
    plan = judge.plan(launch, training)
    if batch == 1 or not plan.peak.what.startswith(("rollout", "evaluation")):
        return None
    divisors = sorted((d for d in range(1, batch) if batch % d == 0), reverse=True)
    smaller = next(
        (d for d in divisors if judge.fits(launch, dataclasses.replace(training, sample_batch=d))), 1
    )
    return Change(
        launch,
        dataclasses.replace(training, sample_batch=smaller),
        f"sampling batch {smaller}",
        (f"algo.sample_batch_size={smaller}",),
    )


def _zero3(launch: Launch, training: Training, judge: Judge) -> Change | None:
    if launch.processes == 1 or launch.kind in SHARDED_KINDS:
        return None
    return Change(
        dataclasses.replace(launch, kind="zero3", offload_optimizer=False),
        training,
        "DeepSpeed ZeRO-3 (or FSDP): the trained model's weights partitioned too",
        ("launcher=deepspeed_zero3",),
    )


def _offload(launch: Launch, training: Training, judge: Judge) -> Change | None:
    if launch.offload_optimizer or launch.kind == "fsdp":
        return None
    kind = launch.kind if launch.kind in DEEPSPEED_KINDS else "zero2"
    return Change(
        dataclasses.replace(launch, kind=kind, offload_optimizer=True),
        training,
        f"optimizer offload to host memory (DeepSpeed {LAUNCHER_NAMES[kind]})",
        (
            "launcher=accelerate",
            "launcher.config_file=DS.json with zero_optimization.stage="
            f"{kind[-1]} and offload_optimizer.device=cpu",
        ),
    )


def _more_processes(launch: Launch, training: Training, judge: Judge) -> Change | None:
    """The fewest processes (doubling) that fit with sharded weights (ZeRO-3 unless already sharded)."""
    kind = launch.kind if launch.kind in SHARDED_KINDS else "zero3"
    processes = launch.processes * 2
    while processes < MAX_PROCESSES and not judge.fits(
        dataclasses.replace(launch, kind=kind, processes=processes), training
    ):
        processes *= 2
    processes = min(processes, MAX_PROCESSES)
    return Change(
        dataclasses.replace(launch, kind=kind, processes=processes),
        training,
        f"{processes} processes with {LAUNCHER_NAMES[kind]}",
        (f"launcher={LAUNCHER_NAMES[kind]}", f"launcher.num_processes × launcher.num_machines = {processes}"),
    )


CHANGES_BY_COST = (_zero2, _checkpointing, _micro_batch, _sample_batch, _zero3, _offload, _more_processes)
"""The changes :func:`smallest_fix` tries, cheapest first (see the module docstring)."""


def smallest_fix(
    groups: Iterable[ParamGroup],
    activations: Activations,
    launch: Launch,
    training: Training,
    epoch: Epoch,
    device_bytes: int,
    headroom: float,
) -> Fix | None:
    """The cheapest change (see the module docstring) after which the plan fits; None when it fits already.
    When no single change is enough the changes accumulate in order; the returned :class:`Fix` has
    ``fits=False`` when even all of them together are not enough."""
    groups = list(groups)

    def plan(launch_: Launch, training_: Training) -> MemoryPlan:
        return plan_memory(groups, activations, launch_, training_, epoch)

    judge = Judge(plan, device_bytes * (1 - headroom))
    if judge.fits(launch, training):
        return None
    for step in CHANGES_BY_COST:
        change = step(launch, training, judge)
        if change is not None and judge.fits(change.launch, change.training):
            return Fix((change.what,), change.how, plan(change.launch, change.training))
    whats: list[str] = []
    hows: list[str] = []
    for step in CHANGES_BY_COST:
        change = step(launch, training, judge)
        if change is None:
            continue
        launch, training = change.launch, change.training
        whats.append(change.what)
        hows += change.how
        if judge.fits(launch, training):
            return Fix(tuple(whats), tuple(hows), plan(launch, training))
    return Fix(tuple(whats), tuple(hows), plan(launch, training), fits=False)


COMMON_DEVICES_GB = (24, 40, 48, 80, 141)
"""The memory of the common training devices, smallest first: 24 GB (RTX 4090, L4, A10), 40 GB (A100
40 GB), 48 GB (L40S, RTX 6000 Ada, A6000), 80 GB (A100 / H100 80 GB), 141 GB (H200)."""


@dataclass(frozen=True)
class DeviceFit:
    """The smallest common device a run fits, and how: ``how`` empty when as configured."""

    device_gb: int
    changes: tuple[str, ...]
    how: tuple[str, ...]
    plan: MemoryPlan


def device_fits(
    groups: Iterable[ParamGroup],
    activations: Activations,
    launch: Launch,
    training: Training,
    epoch: Epoch,
    headroom: float,
    devices: Iterable[int] = COMMON_DEVICES_GB,
) -> list[DeviceFit]:
    """The smallest of ``devices`` (GB, counted as ``plan.device_memory_gb`` counts them: 2³⁰ bytes each)
    that holds the run on as many processes as configured — as it is, else after :func:`smallest_fix`'s
    change — then each larger one that holds it with fewer changes, up to the first that holds it as
    configured; empty when none holds it without more processes."""
    groups = list(groups)
    fits: list[DeviceFit] = []
    for size in sorted(devices):
        fix = smallest_fix(groups, activations, launch, training, epoch, int(size * GIB), headroom)
        if fix is None:
            plan = plan_memory(groups, activations, launch, training, epoch)
            return [*fits, DeviceFit(size, (), (), plan)]
        fewer = not fits or len(fix.changes) < len(fits[-1].changes)
        if fix.fits and fix.plan.launch.processes == launch.processes and fewer:
            fits.append(DeviceFit(size, fix.changes, fix.how, fix.plan))
    return fits


def smallest_device(
    groups: Iterable[ParamGroup],
    activations: Activations,
    launch: Launch,
    training: Training,
    epoch: Epoch,
    headroom: float,
    devices: Iterable[int] = COMMON_DEVICES_GB,
) -> DeviceFit | None:
    """The first of :func:`device_fits`: the smallest device that holds one process, None when none does."""
    fits = device_fits(groups, activations, launch, training, epoch, headroom, devices)
    return fits[0] if fits else None
