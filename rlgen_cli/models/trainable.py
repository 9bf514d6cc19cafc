"""The training surface every flow adapter shares, as a component the adapter holds (no inheritance).

:class:`TrainableTransformer` owns what is identical across families once the pipeline is loaded: the
LoRA (or full fine-tuning) set-up of the pipeline's transformer, the trainable parameter list, the frozen
reference for KL, the distributed (DDP) forward wrapper and the checkpoint format — diffusers-format
LoRA (``pytorch_lora_weights.safetensors`` with the adapter config in its metadata, what the family
pipeline's ``load_lora_weights`` reads) or the full transformer under ``transformer/`` — and the memory /
speed settings of the model section (gradient checkpointing, attention kernel, compile;
``models/acceleration.py``), so every family gets them from here. Each adapter keeps
its family-specific code (encode, noise, schedule, velocity, decode, builders, loaders) and exposes this
component as its ``trainable`` (the :class:`~rlgen_cli.models.base.Trainable` protocol). A model whose
checkpoints follow another format (the ShapesEval UNet) passes its own :class:`CheckpointFormat`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from rlgen_cli.errors import UserError
from rlgen_cli.models.acceleration import compile_module, prepare_transformer
from rlgen_cli.models.base import TORCH_DTYPES, ReferenceSwitch, add_lora, lora_parameters
from rlgen_cli.models.loading import cast_as_loaded, frozen_dtype
from rlgen_cli.schema.run import ModelConfig

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
TRANSFORMER_DIR = "transformer"


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to the model dtype on ``device``; nothing for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _contiguous_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:])


def batch_invariant_linears(module: nn.Module) -> None:
    """Give every biased ``nn.Linear`` of ``module`` a contiguous input, so its output rows do not depend
    on the batch size.

    A strided 3-D input (e.g. the image half that joint attention slices off its output) is contiguous
    at batch 1 and takes the fused ``addmm`` (bias added before the one rounding to the low dtype); at
    batch > 1 it takes ``matmul`` then ``add`` (rounded twice). In bf16 the two differ by an ulp of the
    output (2⁻⁸), enough to move a log-prob recomputed in another micro-batch composition by 1.5e-5
    (tiny SD3; docs/precision.md). In fp32 the gap is at most one fp32 rounding: fp32 runs are left as
    they are.
    """
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and layer.bias is not None:
            layer.register_forward_pre_hook(_contiguous_input)


class CheckpointFormat(Protocol):
    """How a trained module is written to and read from a checkpoint's ``weights/`` directory."""

    def save(self, module: nn.Module, directory: Path, lora: bool) -> None: ...
    def load(self, module: nn.Module, directory: Path, lora: bool) -> None: ...


def load_lora_state(module: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Set the peft LoRA weights of ``module`` from ``state`` (read from ``path``); every LoRA tensor of
    the module must be there and nothing else."""
    from peft.utils import set_peft_model_state_dict

    try:
        result = set_peft_model_state_dict(module, state)
    except RuntimeError as err:  # load_state_dict's shape mismatches: another rank or target
        raise UserError(
            f"LoRA weights in {path} do not fit this model: {_first_mismatch(err)}; the checkpoint was made "
            "with other model.lora settings (its own are in its resolved.yaml)"
        ) from err
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise UserError(
            f"LoRA weights in {path} do not fit this model (missing {len(missing)}, unexpected "
            f"{len(result.unexpected_keys)}); was the checkpoint made with other model.lora settings?"
        )


def _first_mismatch(err: RuntimeError) -> str:
    """The first "size mismatch for KEY: …" line of ``load_state_dict``'s error (else its first line)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return next(
        (line for line in lines if line.startswith("size mismatch")), lines[0] if lines else repr(err)
    )


class DiffusersCheckpoint:
    """The diffusers format: LoRA → ``pytorch_lora_weights.safetensors`` with the adapter config in its
    metadata (what ``pipeline_class.load_lora_weights`` reads); full FT → ``transformer/``
    (``transformer_class.from_pretrained``)."""

    def __init__(self, pipeline_class: str, transformer_class: str) -> None:
        self.pipeline_class = pipeline_class
        self.transformer_class = transformer_class

    def save(self, module: nn.Module, directory: Path, lora: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if not lora:
            module.save_pretrained(directory / TRANSFORMER_DIR)
            return
        import diffusers
        from peft.utils import get_peft_model_state_dict

        # The adapter config (rank, alpha, targets) travels in the safetensors metadata, so
        # load_lora_weights restores the α/r scaling instead of assuming α = r. Its targets are the
        # adapted modules by name, without exclude_modules: diffusers adapts the modules the file has
        # weights for, and peft warns about patterns that match more (an excluded module) or exclusions
        # that exclude nothing.
        state = get_peft_model_state_dict(module)
        metadata = module.peft_config["default"].to_dict()
        metadata["target_modules"] = sorted({key.split(".lora_")[0] for key in state})
        metadata.pop("exclude_modules", None)
        getattr(diffusers, self.pipeline_class).save_lora_weights(
            directory,
            transformer_lora_layers=state,
            weight_name=LORA_WEIGHTS_NAME,
            transformer_lora_adapter_metadata=metadata,
        )

    def load(self, module: nn.Module, directory: Path, lora: bool) -> None:
        if lora:
            from safetensors.torch import load_file

            path = directory / LORA_WEIGHTS_NAME
            if not path.is_file():
                raise UserError(f"{path} is missing: the checkpoint holds no LoRA weights")
            load_lora_state(
                module, {k.removeprefix("transformer."): v for k, v in load_file(path).items()}, path
            )
            return
        import diffusers

        source = directory / TRANSFORMER_DIR
        if not source.is_dir():
            raise UserError(f"{source} is missing: the checkpoint holds no full transformer weights")
        loaded = getattr(diffusers, self.transformer_class).from_pretrained(source)
        module.load_state_dict(loaded.state_dict())


class TrainableTransformer:
    """The trainable transformer ``owner.transformer`` of a flow adapter (``owner``: the pipeline).

    On construction the transformer is put in eval mode (dropout would break ratio == 1) and either
    frozen in ``model.dtype`` with a LoRA adapter attached (``exclude``: modules that can never get a
    gradient) or fully unfrozen in fp32; trainable weights are fp32 either way (docs/precision.md). In
    a low ``model.dtype`` every biased Linear gets contiguous inputs (:func:`batch_invariant_linears`).
    ``model.attention`` and ``model.gradient_checkpointing`` are applied before the full-FT reference
    copy is taken (the copy inherits them); ``model.compile`` compiles the live transformer and, under
    full FT, the frozen copy on its own. ``checkpoint`` defines the files :meth:`save` writes and
    :meth:`load` reads.
    """

    def __init__(
        self,
        owner: Any,
        cfg: ModelConfig,
        *,
        checkpoint: CheckpointFormat,
        exclude: Sequence[str] = (),
    ) -> None:
        self._owner = owner
        self.lora = cfg.lora.enabled
        self.checkpoint = checkpoint
        transformer = owner.transformer.eval()
        dtype = TORCH_DTYPES[cfg.dtype]
        if self.lora:
            cast_as_loaded(transformer, frozen_dtype(cfg))  # frozen weights as a real load has them
            transformer.requires_grad_(False)
            lora = cfg.lora
            add_lora(transformer, lora.rank, lora.alpha, lora.target_modules, lora.init, exclude=exclude)
            params = lora_parameters(transformer)
        else:
            transformer.float().requires_grad_(True)
            params = list(transformer.parameters())
        for param in params:
            param.data = param.data.float()
        self._parameters = params
        if dtype != torch.float32:
            batch_invariant_linears(transformer)
        prepare_transformer(transformer, cfg)
        self._reference = ReferenceSwitch(owner, "transformer", lora=self.lora)
        if cfg.compile:
            self._compile()
        self._distributed: nn.Module | None = None

    def _compile(self) -> None:
        """Compile the live transformer, and the full-FT frozen copy on its own (a copy of a compiled
        module would call the original's forward)."""
        compile_module(self.module)
        if not self.lora:
            with self.reference():
                compile_module(self.module)

    @property
    def module(self) -> nn.Module:
        """The live transformer (the frozen copy while a full-FT ``reference()`` is active)."""
        return self._owner.transformer

    def parameters(self) -> list[nn.Parameter]:
        """The trained parameters (LoRA tensors, or every transformer weight), fp32."""
        return self._parameters

    def named(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every parameter that takes a gradient, in module order."""
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                yield name, param

    def reference(self) -> contextlib.AbstractContextManager[None]:
        """Within this context the transformer is the frozen reference (LoRA disabled or a frozen copy)."""
        return self._reference()

    def refresh_reference(self) -> None:
        """Make the reference the current policy (GARDO's periodic refresh, ``algo.gardo.refresh_every``)."""
        self._reference.refresh()

    # -- distributed forwards -----------------------------------------------------------------
    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Route gradient-carrying forwards through ``wrap(transformer)`` (DDP: averaged gradients).

        With CFG both branches go through the wrapper before one backward; autograd sums each parameter's
        two contributions before its gradient hook fires, so DDP reduces it once.
        """
        self._distributed = wrap(self.module)

    def forward_module(self) -> nn.Module:
        """The DDP wrapper for training forwards; the bare module under no_grad (rollouts, reference,
        eval), where no gradient needs averaging and ranks need not call in lockstep, or while
        ``reference()`` has swapped in a frozen copy."""
        wrapped = self._distributed
        if (
            wrapped is not None
            and torch.is_grad_enabled()
            and getattr(wrapped, "module", None) is self.module
        ):
            return wrapped
        return self.module

    # -- checkpoint format --------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Write the trained weights under ``directory`` in the :attr:`checkpoint` format."""
        self.checkpoint.save(self.module, Path(directory), self.lora)

    def load(self, directory: Path) -> None:
        """Load what :meth:`save` wrote into the live modules (shapes must match)."""
        self.checkpoint.load(self.module, Path(directory), self.lora)
