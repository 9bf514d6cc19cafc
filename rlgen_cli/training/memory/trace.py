"""What a training forward keeps for its backward, counted exactly from autograd, on any device.

:func:`trace_saved` runs a forward under ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd
saves for the backward passes through the pack hook, which records its storage once (views and tensors
saved by several ops share one storage) unless it belongs to a weight. The sum is the activation memory of
that forward — the same on every device, and on the meta device it costs no memory and almost no time, so
a real-size model at its real resolution can be traced on a laptop.

Each saved storage is attributed to the repeated block that was running when it was first saved
(forward hooks on ``blocks``), and each block's inputs are recorded too. Gradient checkpointing keeps only
the block inputs and recomputes one block at a time in the backward, so the same trace gives both
figures (:attr:`SavedTrace.checkpointed`): what is saved outside the blocks, plus every block's inputs,
plus the largest block's own saved tensors.

On the meta device, where real autocast does nothing, ``torch.autocast`` casts as CUDA's autocast does
(matrix products in the low dtype, normalisations and softmax in fp32; :class:`_MetaAutocast`), and every
``scaled_dot_product_attention`` is replaced by a stand-in that saves what the
fused (flash / memory-efficient) kernels save — query, key, value, output, the fp32 log-sum-exp and a
mask's additive bias — and not the L × L attention matrix of the math kernel meta tensors would otherwise
be dispatched to: a GPU (and PyTorch's CPU kernel) never materialises that matrix for training.

:func:`trace_peak` follows every storage a function allocates, from the op that makes it to the moment the
last tensor over it dies (a finalizer on the storage), and returns the most that were alive at once: the
peak a caching allocator's ``max_memory_allocated`` reports for the same work, above what existed before.
Run around a training step (forward, backward, optimizer step) it prices what the saved activations leave
out — the intermediates of the forward, the gradients of the activations in flight, the gradients
themselves and the optimizer's temporaries — on any device, the meta device included.

Meta tensors have no values, so code that branches on them (a padding mask's length, a batch's source
shape, which expert runs) cannot run as it is: :class:`_MetaWithCpuValues` keeps integer tensors on the
CPU with their values and moves them to meta only where an op mixes them with meta tensors, and reads
a truth test over meta values as True.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "SavedTrace",
    "autocast_on_meta",
    "fused_attention_on_meta",
    "generators_on_meta",
    "meta_scalars",
    "meta_values",
    "recomputed_in_modes",
    "storage_key",
    "trace_peak",
    "trace_saved",
]


def storage_key(tensor: Tensor) -> int:
    """An id of ``tensor``'s storage, shared by its views (also on the meta device)."""
    return tensor.untyped_storage()._cdata


def _storage_bytes(tensor: Tensor) -> int:
    return tensor.untyped_storage().nbytes()


@dataclass
class SavedTrace:
    """Saved-for-backward bytes of one forward, split by the block that saved them."""

    outside: int = 0
    """Bytes saved outside every block (embeddings, final layers, the loss)."""
    per_block: list[int] = field(default_factory=list)
    """Bytes saved inside each block (first saved there)."""
    block_inputs: int = 0
    """Bytes of the blocks' tensor inputs not already counted in ``outside`` (what checkpointing keeps)."""

    @property
    def total(self) -> int:
        """Without gradient checkpointing: everything saved."""
        return self.outside + sum(self.per_block)

    @property
    def checkpointed(self) -> int:
        """With gradient checkpointing of every block: the blocks' inputs and what is saved outside them,
        plus one block's saved tensors while it is recomputed in the backward."""
        return self.outside + self.block_inputs + max(self.per_block, default=0)


class _FusedAttentionSaves(torch.autograd.Function):
    """Attention whose backward would need what the fused kernels save: q, k, v, output, log-sum-exp, and
    the additive bias of a mask. A boolean mask is turned into a new bias in the query's dtype by every
    call (each layer keeps its own copy, of the mask's unexpanded shape), a floating one is kept as it is.
    The output is made as the fused kernels make it — one tensor of the query's shape with the value's
    width — never by the math kernel, whose L × L scores would count as a peak no GPU reaches."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None) -> Tensor:
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        saved = [query, key, value, out, logsumexp]
        if mask is not None:
            saved.append(query.new_empty(mask.shape) if mask.dtype == torch.bool else mask)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, *_ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), None


LOWER_PRECISION_OPS = frozenset(
    {
        F.linear,
        F.bilinear,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
        F.scaled_dot_product_attention,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.baddbmm,
        torch.addmm,
        torch.addbmm,
        torch.einsum,
        Tensor.matmul,
        Tensor.__matmul__,
        Tensor.mm,
        Tensor.bmm,
    }
)
"""What CUDA autocast runs in the low dtype (the matrix products): their floating inputs are cast."""
FP32_OPS = frozenset(
    {
        F.layer_norm,
        F.group_norm,
        F.softmax,
        F.log_softmax,
        F.mse_loss,
        torch.softmax,
        torch.log_softmax,
        Tensor.softmax,
        Tensor.log_softmax,
    }
)
"""What CUDA autocast runs in fp32 (normalisations, softmax, losses): their floating inputs are cast up."""


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, list | tuple):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class _MetaAutocast(TorchFunctionMode):
    """``torch.autocast`` for meta tensors, which real autocast ignores: CUDA's cast lists for the ops
    that carry the activations (:data:`LOWER_PRECISION_OPS`, :data:`FP32_OPS`), so the saved tensors have
    the dtypes a GPU run gives them (and the cast copies of fp32 LoRA weights are counted, as autocast's
    cache holds them)."""

    active: list[torch.dtype] = []  # the dtypes of the instances entered, innermost last

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __enter__(self) -> _MetaAutocast:
        _MetaAutocast.active.append(self.dtype)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _MetaAutocast.active.pop()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = self.dtype if func in LOWER_PRECISION_OPS else torch.float32 if func in FP32_OPS else None
        if target is not None and any(isinstance(a, Tensor) and a.is_meta for a in [*args, *kwargs.values()]):
            args, kwargs = _cast(args, target), {k: _cast(v, target) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def autocast_on_meta() -> Iterator[None]:
    """``torch.autocast("meta", …)`` (what a model on the meta device asks for) → :class:`_MetaAutocast`;
    every other device type keeps the real one. Restored on exit."""
    real = torch.autocast

    def autocast(
        device_type: str, dtype: torch.dtype | None = None, enabled: bool = True, **kwargs: Any
    ) -> Any:
        if device_type != "meta":
            return real(device_type, dtype=dtype, enabled=enabled, **kwargs)
        if not enabled or dtype is None or dtype == torch.float32:
            return contextlib.nullcontext()
        return _MetaAutocast(dtype)

    torch.autocast = autocast  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch.autocast = real  # type: ignore[misc]


class _FusedAttentionOnMeta(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = (
            dict(zip(("query", "key", "value", "attn_mask"), args, strict=False)) | kwargs
        )  # positional or by name
        query, key, value = named["query"], named["key"], named["value"]
        if not query.is_meta:
            return func(*args, **kwargs)
        return _FusedAttentionSaves.apply(query, key, value, named.get("attn_mask"))


_TRUTH_TESTS = frozenset({Tensor.all, Tensor.any, torch.all, torch.any, Tensor.__bool__})
_FACTORIES = frozenset({torch.zeros, torch.ones, torch.full, torch.empty, torch.eye})
_JOINS = frozenset({torch.cat, torch.stack, torch.concat, torch.concatenate})
_INDEXING = frozenset({Tensor.__getitem__, Tensor.__setitem__, Tensor.index_put_, Tensor.index_put})


def _is_cpu_array(value: Any) -> bool:
    return isinstance(value, Tensor) and value.device.type == "cpu" and value.dim() > 0


class _MetaWithCpuValues(TorchFunctionMode):
    """Lets a model on the meta device read the values it branches on. Integer tensors (token ids, masks,
    source shapes) and floating ones of at most one dimension (σ schedules, timesteps) stay on the CPU (``.to("meta")`` keeps them there), so ``int(mask.sum(1).max())`` and ``e[mask]`` see real values;
    so do boolean masks a model creates on its own device (``torch.zeros(…, dtype=torch.bool, device=…)``,
    then filled by slices: BAGEL's which-expert-per-token mask), which are made on the CPU. An op that
    mixes them with meta tensors gets them moved to meta (indexing keeps its CPU index). A truth test over
    meta values (``high.all()``: which expert runs; an encoder's "no padding?" shortcut) reads True."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        values = [*_flat(args), *_flat(kwargs.values())]
        if func in _TRUTH_TESTS and args and isinstance(args[0], Tensor) and args[0].is_meta:
            return True if func is Tensor.__bool__ else torch.tensor(True)
        if func in _FACTORIES and kwargs.get("dtype") is torch.bool and _on_meta(kwargs.get("device")):
            return func(*args, **(kwargs | {"device": "cpu"}))
        if func is Tensor.to and _keeps_values(args, kwargs):
            dtype = next((v for v in [*args[1:], *kwargs.values()] if isinstance(v, torch.dtype)), None)
            return args[0] if dtype is None else args[0].to(dtype)
        on_meta = any(isinstance(v, Tensor) and v.is_meta for v in values)
        if on_meta and func in _JOINS:  # a CPU scalar (a statistic of values kept on the CPU) joins meta ones
            return func(_to_meta(args[0], scalars=True), *args[1:], **kwargs)
        mixed = on_meta and any(map(_is_cpu_array, values))
        if mixed and func not in _INDEXING:
            args = _to_meta(args)
            kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _on_meta(device: Any) -> bool:
    return isinstance(device, torch.device | str) and torch.device(device).type == "meta"


def _keeps_values(args: tuple, kwargs: dict) -> bool:
    """``cpu_tensor.to("meta")`` of an integer tensor (token ids, masks) or of a floating one of at most
    one dimension (a schedule's σ, per-sample σ and timesteps, which samplers check): kept on the CPU,
    with its values."""
    tensor = args[0] if args else None
    if not (isinstance(tensor, Tensor) and tensor.device.type == "cpu"):
        return False
    if tensor.is_floating_point() and tensor.dim() > 1:
        return False
    targets = [v for v in [*args[1:], *kwargs.values()] if isinstance(v, torch.device | str)]
    return any(torch.device(t).type == "meta" for t in targets)


def _flat(values: Iterable[Any]) -> list[Any]:
    """The values, with lists and tuples opened one level (``torch.cat([a, b])``)."""
    return [item for v in values for item in (v if isinstance(v, list | tuple) else (v,))]


def _to_meta(value: Any, scalars: bool = False) -> Any:
    """``value``'s CPU arrays (and with ``scalars`` its CPU 0-d tensors) on the meta device."""
    if _is_cpu_array(value) or (scalars and isinstance(value, Tensor) and value.device.type == "cpu"):
        return value.to("meta")
    if isinstance(value, list | tuple):
        return type(value)(_to_meta(v, scalars) for v in value)
    return value


@contextlib.contextmanager
def recomputed_in_modes(blocks: Sequence[nn.Module]) -> Iterator[None]:
    """Inside, each of ``blocks`` runs under this module's modes whenever it runs — also when gradient
    checkpointing recomputes it in the backward, where the modes of the forward are not active: fused
    attention, values on the CPU, scalar reads, and the meta autocast the block last ran under."""
    originals = []
    for block in blocks:
        dtypes: list[torch.dtype | None] = [None]

        def forward(
            *args: Any, _forward: Callable[..., Any] = block.forward, _dtypes: list = dtypes, **kwargs: Any
        ) -> Any:
            if _MetaAutocast.active:
                _dtypes[0] = _MetaAutocast.active[-1]
            if _modes_active():  # the forward, under the trace's modes already: a second stack only costs
                return _forward(*args, **kwargs)
            autocast = _MetaAutocast(_dtypes[0]) if _dtypes[0] is not None else contextlib.nullcontext()
            with _FusedAttentionOnMeta(), _MetaWithCpuValues(), _MetaScalars(), autocast:
                return _forward(*args, **kwargs)

        originals.append((block, block.__dict__.get("forward")))
        block.forward = forward
    try:
        yield
    finally:
        for block, original in originals:
            if original is None:
                del block.forward
            else:
                block.forward = original


def _modes_active() -> bool:
    """Whether the block modes are on the function-mode stack (a forward inside the trace), rather than
    off it (a block recomputed by gradient checkpointing in the backward, which runs without them)."""
    from torch.overrides import _get_current_function_mode_stack

    kinds = {type(mode) for mode in _get_current_function_mode_stack()}
    return {_FusedAttentionOnMeta, _MetaWithCpuValues, _MetaScalars} <= kinds


def fused_attention_on_meta() -> TorchFunctionMode:
    """The mode in which attention on the meta device is counted as the fused kernels keep it
    (:class:`_FusedAttentionSaves`)."""
    return _FusedAttentionOnMeta()


def meta_values() -> TorchFunctionMode:
    """The mode in which a model on the meta device may branch on values (:class:`_MetaWithCpuValues`)."""
    return _MetaWithCpuValues()


class _CpuGenerator(torch.Generator):
    """A generator asked for on the meta device, made on the CPU: the meta device has none, and a draw
    on the meta device (``torch.randn(…, generator=g, device="meta")``) reads no state."""

    def __new__(cls, device: Any = "cpu") -> _CpuGenerator:
        on_meta = torch.device(device).type == "meta"
        return super().__new__(cls, device="cpu" if on_meta else device)  # type: ignore[call-arg]


@contextlib.contextmanager
def generators_on_meta() -> Iterator[None]:
    """Inside, ``torch.Generator(device="meta")`` (a recipe's per-sample noise streams on the run's
    device) gives a CPU generator (:class:`_CpuGenerator`) instead of failing. Restored on exit."""
    real = torch.Generator
    torch.Generator = _CpuGenerator  # type: ignore[misc]
    try:
        yield
    finally:
        torch.Generator = real  # type: ignore[misc]


_SCALAR_READS = {Tensor.item: 0.0, Tensor.__float__: 0.0, Tensor.__int__: 0}


class _MetaScalars(TorchFunctionMode):
    """Reads of a meta tensor's value as a Python number (``loss.item()``, ``float(norm)``) give 0: a
    training step logs its statistics that way, and memory does not depend on them."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _SCALAR_READS and args and isinstance(args[0], Tensor) and args[0].is_meta:
            return _SCALAR_READS[func]
        if func is Tensor.tolist and args and isinstance(args[0], Tensor) and args[0].is_meta:
            return torch.zeros(args[0].shape).tolist()
        return func(*args, **(kwargs or {}))


def meta_scalars() -> TorchFunctionMode:
    """The mode in which a step on the meta device may log statistics (:class:`_MetaScalars`)."""
    return _MetaScalars()


class _PeakCounter(TorchDispatchMode):
    """Counts the bytes of every storage an op makes (not one of its inputs'), until the storage dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._sizes:  # a view, an in-place op, or counted already
                continue
            self._sizes[key] = storage.nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out


def trace_peak(work: Callable[[], Any]) -> int:
    """The most bytes that storages made by ``work()`` held at one time (allocator semantics: a storage
    counts from the op that makes it until its last tensor dies). What existed before is not counted."""
    counter = _PeakCounter()
    with counter:
        work()
    return counter.peak


class _Counter:
    """The pack hook: counts each saved storage once, skipping ``excluded`` (weights), per block."""

    def __init__(self, excluded: set[int], num_blocks: int) -> None:
        self.excluded = excluded
        self.seen: set[int] = set()
        self.block: int | None = None
        self.trace = SavedTrace(per_block=[0] * num_blocks)
        self.input_keys: dict[int, int] = {}  # storage → bytes of blocks' inputs
        self.outside_keys: set[int] = set()
        self._inputs: list[Tensor] = []  # kept alive, so no later storage can take an input's id

    def pack(self, tensor: Tensor) -> Tensor:
        key = storage_key(tensor)
        if key not in self.seen and key not in self.excluded:
            self.seen.add(key)
            if self.block is None:
                self.trace.outside += _storage_bytes(tensor)
                self.outside_keys.add(key)
            else:
                self.trace.per_block[self.block] += _storage_bytes(tensor)
        return tensor

    def enter(self, index: int, inputs: Iterable[Any]) -> None:
        self.block = index
        for value in inputs:
            if isinstance(value, Tensor) and value.is_floating_point():
                key = storage_key(value)
                if key not in self.excluded and key not in self.input_keys:
                    self.input_keys[key] = _storage_bytes(value)
                    self._inputs.append(value)

    def finish(self) -> SavedTrace:
        self.trace.block_inputs = sum(n for k, n in self.input_keys.items() if k not in self.outside_keys)
        return self.trace


@contextlib.contextmanager
def _block_hooks(counter: _Counter, blocks: Sequence[nn.Module]) -> Iterator[None]:
    handles = []
    for index, block in enumerate(blocks):

        def pre(module: nn.Module, args: tuple, kwargs: dict, index: int = index) -> None:
            counter.enter(index, [*args, *kwargs.values()])

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            counter.block = None

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def trace_saved(
    forward: Callable[[], Any], weights: Iterable[Tensor], blocks: Sequence[nn.Module] = ()
) -> SavedTrace:
    """The bytes autograd saves while ``forward()`` runs (with gradients enabled), skipping the storages
    of ``weights`` (every parameter and buffer: they are counted as weights), attributed to ``blocks``."""
    counter = _Counter({storage_key(w) for w in weights}, len(blocks))
    with (
        autocast_on_meta(),
        _MetaWithCpuValues(),
        _FusedAttentionOnMeta(),
        _block_hooks(counter, blocks),
        torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda tensor: tensor),
        torch.enable_grad(),
    ):
        forward()
    return counter.finish()
