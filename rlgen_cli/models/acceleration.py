"""Memory and speed settings of the trained networks, applied in one place for every family.

Three settings of the model section, none of which changes what is computed beyond kernel rounding
(tolerances measured in docs/memory_speed.md):

* ``model.gradient_checkpointing`` — the transformer's blocks (a VLM's decoder and vision layers) keep only
  their inputs in the forward pass and recompute the rest in the backward pass: less activation memory,
  one more forward per update. Non-reentrant ``torch.utils.checkpoint`` (diffusers' default, and
  ``use_reentrant=False`` for transformers), so a frozen base with LoRA needs no input that requires
  grad; the recompute runs the same operations in the same order, so loss and gradients equal those
  without it. It acts only while gradients are on (the update's recompute); rollouts, the reference and
  evaluation run under ``no_grad`` and are untouched.
* ``model.attention`` — ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``, which picks a fused
  kernel (flash / memory-efficient on GPUs, the flash CPU kernel on CPUs). ``eager``: the explicit
  softmax(QKᵀ/√d)·V. Flow transformers: every diffusers attention processor that dispatches through
  diffusers' attention backends (FLUX.1, FLUX.2, Qwen-Image, Wan, Z-Image) gets the backend ``native``
  (sdpa) or ``_native_math`` (PyTorch's math kernel) on the processor itself — not diffusers' process-wide
  active backend, which would leak into other models; for ``eager`` every processor also runs inside
  :class:`MathKernel`, which reaches the calls no backend setting does (SD3's joint attention calls sdpa
  itself; Qwen-Image 2's prefill dispatches with no backend named). VLMs: transformers' ``attn_implementation``
  (``sdpa`` / ``eager``), set on the whole model (language and vision). A network without diffusers
  attention modules (the ShapesEval UNet) has no eager alternative and refuses it at build.
* ``model.compile`` — ``torch.compile`` with ``mode="default"`` (no CUDA graphs: the batch changes between
  rollout, update and CFG, and "reduce-overhead" would pin a static memory pool per shape) and
  ``dynamic=None`` (PyTorch's automatic dynamic shapes: the first shape is compiled static, a second
  shape recompiles with a dynamic batch, so rollout, update and evaluation batches share one graph
  instead of exhausting the recompile limit). Flow families: the transformer's forward in place
  (``nn.Module.compile``: parameters, LoRA and checkpoints keep their names), on rollouts and updates
  alike. VLMs: the training forward only (:func:`compiled`; ``generate``'s growing KV cache would
  recompile at every length), so π_old and π_θ still take the same path.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from rlgen_cli.errors import UserError
from rlgen_cli.schema.run import ModelConfig

DIFFUSERS_BACKENDS = {"sdpa": "native", "eager": "_native_math"}
"""``model.attention`` → the diffusers attention backend set on each dispatching processor."""
TRANSFORMERS_ATTENTION = {"sdpa": "sdpa", "eager": "eager"}
"""``model.attention`` → transformers' ``attn_implementation``."""
COMPILE_OPTIONS: dict[str, Any] = {"mode": "default", "dynamic": None, "fullgraph": False}
"""``torch.compile`` options of ``model.compile`` (module docstring: why)."""


class MathKernel:
    """An attention processor run with only PyTorch's math kernel enabled: every
    ``scaled_dot_product_attention`` call inside it — its own, or diffusers' dispatch with no backend named
    (Qwen-Image 2's prefill segments use the process-wide one) — takes the explicit softmax(QKᵀ/√d)·V.

    It replaces the processor inside the attention module, so the backward recompute of gradient
    checkpointing runs it the same way. Attention modules pass only the keyword arguments the processor's
    ``__call__`` declares (``inspect.signature``), so the instance's ``__call__`` attribute carries the
    wrapped processor's signature; calls go through the class's ``__call__``.
    """

    def __init__(self, processor: Any) -> None:
        self.processor = processor

        def call(*args: Any, **kwargs: Any) -> Any:
            return type(self).__call__(self, *args, **kwargs)

        self.__call__ = functools.wraps(processor.__call__)(call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return self.processor(*args, **kwargs)


def _attention_modules(module: nn.Module) -> list[nn.Module]:
    """The diffusers attention modules of ``module`` (the ones ``set_attention_backend`` visits)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m for m in module.modules() if isinstance(m, Attention | AttentionModuleMixin)]


def set_attention(module: nn.Module, attention: str, family: str) -> None:
    """Give every diffusers attention module of ``module`` the kernel ``attention`` (sdpa | eager).

    Raises:
        UserError: ``eager`` on a network without diffusers attention modules (no eager alternative).
    """
    from diffusers.models.attention_dispatch import AttentionBackendName

    layers = _attention_modules(module)
    if not layers:
        if attention == "sdpa":
            return  # its own attention calls scaled_dot_product_attention
        raise UserError(
            f"model.attention={attention}: model.family={family} has no diffusers attention processors to "
            "switch (its attention calls scaled_dot_product_attention directly); use model.attention=sdpa"
        )
    backend = AttentionBackendName(DIFFUSERS_BACKENDS[attention])
    for layer in layers:
        inner = layer.processor.processor if isinstance(layer.processor, MathKernel) else layer.processor
        if hasattr(inner, "_attention_backend"):
            # On the processor, as set_attention_backend does, without its process-wide active backend
            inner._attention_backend = backend
        layer.processor = MathKernel(inner) if attention == "eager" else inner


def enable_checkpointing(module: nn.Module, family: str) -> None:
    """diffusers' gradient checkpointing (non-reentrant ``torch.utils.checkpoint`` per block).

    Raises:
        UserError: When the network has no checkpointed blocks.
    """
    if not getattr(module, "_supports_gradient_checkpointing", False):
        raise UserError(
            f"model.gradient_checkpointing=true: model.family={family} ({type(module).__name__}) has no "
            "gradient checkpointing; set model.gradient_checkpointing=false"
        )
    module.enable_gradient_checkpointing()


def prepare_transformer(module: nn.Module, cfg: ModelConfig) -> None:
    """Attention kernel and gradient checkpointing of a flow transformer, before any copy of it is taken
    (the full-FT reference copy inherits both)."""
    set_attention(module, cfg.attention, cfg.family)
    if cfg.gradient_checkpointing:
        enable_checkpointing(module, cfg.family)


def compile_module(module: nn.Module) -> None:
    """``torch.compile`` the module's forward in place (:data:`COMPILE_OPTIONS`).

    In place, the compiled call is a closure over this module: a ``deepcopy`` taken afterwards would call
    the original, so copies are taken first and compiled on their own.
    """
    module.compile(**COMPILE_OPTIONS)


def prepare_frozen_transformer(module: nn.Module, cfg: ModelConfig) -> None:
    """A transformer the policy calls but never trains (a frozen Wan2.2 expert): the same attention kernel
    and compilation as the trained one; checkpointing has nothing to save without gradients."""
    set_attention(module, cfg.attention, cfg.family)
    if cfg.compile:
        compile_module(module)


# -- VLMs -------------------------------------------------------------------------------------------------
def prepare_vlm(model: Any, cfg: ModelConfig) -> None:
    """Attention implementation, gradient checkpointing and train/eval mode of a (LoRA-wrapped or full)
    Qwen-VL model.

    transformers checkpoints a layer only in training mode, so the model is put in training mode exactly
    when checkpointing is on (the Qwen-VL configs have no dropout: values are the same in either mode).
    ``enable_input_require_grads`` makes the embeddings' output require grad, which a reentrant checkpoint
    of a frozen base under LoRA would need; harmless with the non-reentrant one used here.
    """
    model.set_attn_implementation(TRANSFORMERS_ATTENTION[cfg.attention])
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train(cfg.gradient_checkpointing)


def compiled(module: nn.Module) -> nn.Module:
    """A compiled wrapper of ``module`` for training forwards (the module itself is left uncompiled, so
    ``generate``, the reference and copies of it run eagerly)."""
    return torch.compile(module, **COMPILE_OPTIONS)
