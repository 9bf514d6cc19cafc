"""The flow-policy protocol every model family implements, and the pieces families share.

One recipe serves every family because each adapter exposes the same small surface:

* ``encode(prompts, images=None) -> Cond`` — conditioning, negative branch included when CFG is on;
* ``noise(n, generator) -> x`` and ``schedule(num_steps, x) -> sigmas`` (T+1 values ending at 0);
* ``velocity(x, sigma, cond) -> v`` — the ONLY function that calls the transformer: CFG, guidance
  embeddings and packing live inside it, so sampling and training run identical code;
* ``decode(x0) -> images`` in [0, 1];
* ``capabilities``: what the family declares it does (:class:`Capabilities`), so callers read a field
  instead of probing for methods;
* ``trainable``: the training surface (:class:`Trainable`): parameters, frozen reference for KL,
  checkpoint format, distributed forwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, get_args, runtime_checkable

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.schema.choices import CfgGrad
from rlgen_cli.schema.run import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Cond:
    """Batched conditioning: every tensor has the batch on dim 0, so a Cond can be sliced and joined."""

    tensors: dict[str, Tensor]
    extras: dict[str, Any] = field(default_factory=dict)
    """Batch-independent settings (e.g. guidance scale) carried alongside."""

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def index(self, idx: Tensor | slice | Sequence[int]) -> Cond:
        """The sub-batch at ``idx`` (a slice, index list or index tensor)."""
        return Cond({k: v[idx] for k, v in self.tensors.items()}, dict(self.extras))

    def to(self, device: torch.device | str) -> Cond:
        return Cond({k: v.to(device) for k, v in self.tensors.items()}, dict(self.extras))

    @staticmethod
    def cat(conds: Sequence[Cond]) -> Cond:
        """Join sub-batches (all must have the same keys and extras)."""
        keys = conds[0].tensors.keys()
        return Cond({k: torch.cat([c.tensors[k] for c in conds]) for k in keys}, dict(conds[0].extras))


@dataclass(frozen=True)
class Capabilities:
    """What a flow policy declares about itself; every field is a fact the caller branches on."""

    takes_source_images: bool = False
    """Editing families: ``encode`` needs the (B, 3, H, W) source images in [0, 1]."""
    has_cfg: bool = False
    """``encode`` returns a negative branch and ``velocity`` combines two predictions (guidance > 1)."""
    is_video: bool = False
    """``decode`` returns videos (B, 3, F, H, W) instead of images (B, 3, H, W)."""
    encodes_images: bool = False
    """``encode_images(images) -> x0`` exists (pixel-space families: flow-matching pretraining)."""


@runtime_checkable
class Trainable(Protocol):
    """The trained part of a policy: what optimizers, checkpoints, KL and DDP need."""

    @property
    def module(self) -> nn.Module:
        """The trained ``nn.Module`` (the frozen copy while a full-FT ``reference()`` is active)."""
        ...

    def parameters(self) -> list[nn.Parameter]: ...
    def named(self) -> Iterator[tuple[str, nn.Parameter]]: ...
    def reference(self) -> contextlib.AbstractContextManager[None]: ...
    def save(self, directory: Path) -> None: ...
    def load(self, directory: Path) -> None: ...
    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None: ...


@runtime_checkable
class FlowPolicy(Protocol):
    """What a recipe needs from a flow-matching model family (see the module docstring)."""

    family: str
    device: torch.device
    cfg: ModelConfig
    capabilities: Capabilities
    trainable: Trainable
    guidance_scale: float
    """The scale ``velocity`` applies (CFG, or the embedding of guidance-distilled families); flow
    pretraining sets it to 1 while it trains the conditional velocity."""

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond: ...
    def noise(
        self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None
    ) -> Tensor: ...
    def schedule(self, num_steps: int, x: Tensor) -> Tensor: ...
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor: ...
    def decode(self, x0: Tensor) -> Tensor: ...


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name} but CUDA is not available here; use device=cpu or device=auto")
    return device


_CFG_GRAD: contextvars.ContextVar[str] = contextvars.ContextVar("cfg_grad", default="both")


@contextlib.contextmanager
def cfg_gradient(mode: str) -> Iterator[None]:
    """Inside, CFG velocities back-propagate through ``both`` branches or only the ``conditional`` one.

    ``conditional`` detaches the unconditional prediction (docs/maths.md §4.6): ∂v/∂θ = g·∂c/∂θ. The
    families then run that branch as a pass of its own under ``no_grad`` (no activations kept, no backward
    through it) instead of one batch with the conditional branch; the recipe samples under the same mode,
    so the rollout takes the same two passes and the on-policy ratio stays exactly 1.
    """
    assert mode in get_args(CfgGrad), mode
    token = _CFG_GRAD.set(mode)
    try:
        yield
    finally:
        _CFG_GRAD.reset(token)


def uncond_takes_grad() -> bool:
    """Whether the unconditional CFG branch is differentiated here (see :func:`cfg_gradient`)."""
    return _CFG_GRAD.get() == "both"


def cfg_combine(uncond: Tensor, cond: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance: u + g·(c − u), with u detached under ``cfg_gradient("conditional")``."""
    if not uncond_takes_grad():
        uncond = uncond.detach()
    return uncond + scale * (cond - uncond)


def cfg_two_passes(cond: Tensor, unconditional: Callable[[], Tensor], scale: float) -> Tensor:
    """u + g·(c − u) for families whose pipelines run the branches as two calls (Wan, FLUX.2-klein,
    Qwen-Image 2.x): c is already computed, u is ``unconditional()``, run without autograd unless the
    unconditional branch is differentiated (:func:`cfg_gradient`; no activations kept, same values)."""
    with contextlib.nullcontext() if uncond_takes_grad() else torch.no_grad():
        uncond = unconditional()
    return cfg_combine(uncond, cond, scale)


def add_lora(
    module: nn.Module, rank: int, alpha: int, targets: Sequence[str], init: str, exclude: Sequence[str] = ()
) -> None:
    """Attach a peft LoRA adapter through diffusers' PEFT integration (adapter name ``default``)."""
    from peft import LoraConfig

    init_weights: bool | str = True if init == "kaiming" else init  # peft's True: Kaiming A, zero B
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=init_weights,
        exclude_modules=list(exclude) or None,
    )
    module.add_adapter(config)
    if not any("lora_" in name for name, _ in module.named_parameters()):
        raise UserError(
            f"model.lora.target_modules={list(targets)} matched no module of {type(module).__name__}"
        )


def lora_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The LoRA parameters (made trainable); every other parameter is frozen."""
    params = []
    for name, param in module.named_parameters():
        is_lora = "lora_" in name
        param.requires_grad_(is_lora)
        if is_lora:
            params.append(param)
    return params


class ReferenceSwitch:
    """Gives a frozen reference policy for KL: the adapter disabled (LoRA) or a frozen copy (full FT)."""

    def __init__(self, owner: Any, attribute: str, lora: bool) -> None:
        self._owner = owner
        self._attribute = attribute
        self._lora = lora
        self._frozen: nn.Module | None = None
        self._adapter: dict[str, Tensor] | None = None  # LoRA: the refreshed reference's adapter weights
        if not lora:
            self._frozen = copy.deepcopy(getattr(owner, attribute)).requires_grad_(False).eval()

    def refresh(self) -> None:
        """The reference becomes the current policy: a frozen copy of the LoRA weights, swapped in inside
        the context (the base stays as loaded), or the trained weights copied into the full-FT copy."""
        module = getattr(self._owner, self._attribute)
        if self._lora:
            self._adapter = {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}
        else:
            assert self._frozen is not None
            self._frozen.load_state_dict(module.state_dict())

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        module = getattr(self._owner, self._attribute)
        if self._lora and self._adapter is not None:
            params = dict(module.named_parameters())
            live = {name: params[name].data for name in self._adapter}
            for name, frozen in self._adapter.items():
                params[name].data = frozen
            try:
                yield
            finally:
                for name, data in live.items():
                    params[name].data = data
        elif self._lora:
            module.disable_adapters()
            try:
                yield
            finally:
                module.enable_adapters()
        else:
            setattr(self._owner, self._attribute, self._frozen)
            try:
                yield
            finally:
                setattr(self._owner, self._attribute, module)
