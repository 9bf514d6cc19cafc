"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL policies: load (hub id, local path) or build tiny; LoRA or full fine-tuning.

One small object, :class:`VLMPolicy`, holds the model and its processor and answers what the token
recipes need: the trainable parameters, a frozen reference (LoRA disabled, or a frozen copy for full
fine-tuning) for the k3 KL of GRPO (Shao et al. 2024) / StepGRPO (R1-VL, Zhang et al. 2025), the token
ids that must never be sampled (vision tokens), the stop ids, and checkpoint I/O in Hugging Face / peft
formats (``save_trainable`` / ``load_trainable``; :func:`export_merged` writes a merged model directory
that VLMEvalKit or lmms-eval load as-is).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlgen_cli.errors import UserError
from rlgen_cli.models.acceleration import TRANSFORMERS_ATTENTION, compiled, prepare_vlm
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.schema.vlm import VLM_FAMILIES
from rlgen_cli.vlm.assets import model_source

log = logging.getLogger(__name__)

__all__ = ["VLMPolicy", "build_vlm", "export_merged", "load_vlm"]

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
LANGUAGE_LORA_TARGETS = r"^(?!.*visual).*\.({names})$"  # LoRA on the language model only
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ADAPTER_FILE = "adapter_model.safetensors"


@dataclass
class VLMPolicy:
    """A Qwen-VL model, its processor and the bits the token recipes need.

    Attributes:
        model: The (possibly peft-wrapped) ``Qwen2VLForConditionalGeneration`` / Qwen2.5-VL model.
        processor: Its ``Qwen2VLProcessor`` (pixel bounds from ``model.vlm``).
        cfg: The model config it was built from.
        device: Where it runs.
    """

    model: Any
    processor: Any
    cfg: ModelConfig
    device: torch.device
    _frozen_copy: Any = field(default=None, repr=False)
    _weights_loaded: bool = field(
        default=False, repr=False
    )  # load_trainable ran: the weights are not the initial ones
    _train_model: Any = field(default=None, repr=False)
    _compiled: Any = field(default=None, repr=False)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def is_lora(self) -> bool:
        return self.cfg.lora.enabled

    def token_ids(self, names: tuple[str, ...]) -> list[int]:
        """Ids of the tokens in ``names`` that this vocabulary has."""
        vocab = self.tokenizer.get_vocab()
        return [vocab[name] for name in names if name in vocab]

    @property
    def suppressed_ids(self) -> list[int]:
        """Vision tokens: never sampled, and masked the same way when log-probs are recomputed."""
        return self.token_ids(VISION_TOKENS)

    @property
    def stop_ids(self) -> list[int]:
        return self.token_ids(STOP_TOKENS)

    @property
    def max_positions(self) -> int:
        config = self.model.config
        text = getattr(config, "text_config", config)
        return int(getattr(text, "max_position_embeddings", 1 << 30))

    @property
    def train_model(self) -> Any:
        """What the log-prob and loss forwards call: :attr:`model`, or its DDP / DeepSpeed wrapper after
        :meth:`distribute`. ``generate``, the reference and checkpoints use the bare :attr:`model`
        (HF ``generate`` is not a method of the wrappers). With ``model.compile``, a compiled wrapper of it."""
        model = self.model if self._train_model is None else self._train_model
        if not self.cfg.compile:
            return model
        if self._compiled is None or self._compiled._orig_mod is not model:
            self._compiled = compiled(model)
        return self._compiled

    def distribute(self, wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
        """Route the training forwards through ``wrap(model)`` (``Dist.prepare``: DDP averages the gradients,
        a DeepSpeed engine reduces them); the wrapper shares the model's parameters."""
        self._train_model = wrap(self.model)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def named_trainable(self) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def autocast(self) -> Any:
        """Mixed precision in ``model.dtype`` around every forward (trainable weights are fp32)."""
        dtype = _DTYPES[self.cfg.dtype]
        if dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    @contextmanager
    def reference(self) -> Iterator[Any]:
        """The frozen reference model: the base with the adapter disabled, or a frozen copy (in
        ``model.dtype``) of the initial weights for full fine-tuning (:meth:`keep_reference`; made on
        first use in a run that loaded no weights).

        Raises:
            RuntimeError: Full fine-tuning whose weights were loaded (a resume) before the copy was kept:
                a copy made now would hold the checkpoint's weights, not the initial ones.
        """
        if self.is_lora:
            with self.model.disable_adapter():
                yield self.model
            return
        if self._frozen_copy is None:
            if self._weights_loaded:
                raise RuntimeError(
                    "the full fine-tuning reference must be kept (VLMPolicy.keep_reference) before a "
                    "checkpoint's weights are loaded: a copy made now would be the checkpoint, not the start"
                )
            self.keep_reference()
        yield self._frozen_copy

    def keep_reference(self) -> None:
        """Copy the weights as they are now into the frozen reference of full fine-tuning; a recipe with a KL
        term calls it before a resume loads a checkpoint's weights (LoRA: nothing to copy, the reference
        is the base under the adapter)."""
        if not self.is_lora and self._frozen_copy is None:
            frozen = copy.deepcopy(self.model).requires_grad_(False).eval()
            self._frozen_copy = frozen.to(_DTYPES[self.cfg.dtype])

    def save_trainable(self, path: Path) -> None:
        """LoRA: the peft adapter (``adapter_model.safetensors`` + config); full: a HF model directory."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    def load_trainable(self, path: Path) -> None:
        """Load what :meth:`save_trainable` wrote into the trainable parameters (strict on their names)."""
        path = Path(path)
        self._weights_loaded = True
        if not (path / ("adapter_config.json" if self.is_lora else "config.json")).is_file():
            raise UserError(
                f"{path} holds no {'LoRA adapter' if self.is_lora else 'model'}; pass a checkpoint's weights/ "
                "directory written with the same model.lora.enabled"
            )
        if self.is_lora:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            state = load_file(str(path / _ADAPTER_FILE))
            unexpected = list(getattr(set_peft_model_state_dict(self.model, state), "unexpected_keys", []))
            if unexpected:
                raise UserError(
                    f"adapter keys {unexpected[:3]} do not fit this model (LoRA rank/targets differ)"
                )
            return
        saved = type(self.model).from_pretrained(path, dtype=torch.float32)  # transformers maps the key names
        state = dict(saved.named_parameters())
        trainable = self.named_trainable()
        absent = sorted(set(trainable) - set(state))
        if absent:
            raise UserError(
                f"{path} lacks trained tensors {absent[:3]}; it was saved by another model config"
            )
        with torch.no_grad():
            for name, param in trainable.items():
                param.copy_(state[name].to(param.dtype))


def _processor(cfg: ModelConfig) -> Any:
    vlm = cfg.vlm
    if cfg.tiny and cfg.family == "qwen3_vl":  # Qwen3-VL's processor and chat template, same tiny BPE
        from rlgen_cli.models.tiny import tiny_qwen3_vl_processor
        from rlgen_cli.vlm.tokenizer import tiny_tokenizer

        return tiny_qwen3_vl_processor(tiny_tokenizer(), min_pixels=vlm.min_pixels, max_pixels=vlm.max_pixels)
    if cfg.tiny:
        from rlgen_cli.vlm.tokenizer import tiny_processor

        return tiny_processor(min_pixels=vlm.min_pixels, max_pixels=vlm.max_pixels)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(
        model_source(cfg.path),
        min_pixels=vlm.min_pixels,
        max_pixels=vlm.max_pixels,
        local_files_only=cfg.local_files_only,
        revision=cfg.revision,
    )


def _base_model(cfg: ModelConfig, processor: Any) -> Any:
    if cfg.tiny:
        from rlgen_cli.models.tiny import tiny_qwen3_vl, tiny_vlm

        if cfg.family == "qwen3_vl":
            return tiny_qwen3_vl(processor, seed=cfg.tiny_seed).to(_DTYPES[cfg.dtype])
        return tiny_vlm(processor, kind=cfg.family, seed=cfg.tiny_seed).to(_DTYPES[cfg.dtype])
    import transformers

    cls = {
        "qwen2_vl": "Qwen2VLForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
    }
    return getattr(transformers, cls[cfg.family]).from_pretrained(
        model_source(cfg.path),
        dtype=_DTYPES[cfg.dtype],
        local_files_only=cfg.local_files_only,
        revision=cfg.revision,
        attn_implementation=TRANSFORMERS_ATTENTION[cfg.attention],
    )


def _make_trainable(model: Any, cfg: ModelConfig) -> Any:
    """Wrap in LoRA (language-model projections only) or unfreeze for full fine-tuning."""
    model.requires_grad_(False)
    if cfg.lora.enabled:
        from peft import LoraConfig, get_peft_model

        names = "|".join(sorted({t.split(".")[-1] for t in cfg.lora.target_modules}))
        lora = LoraConfig(
            r=cfg.lora.rank,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=0.0,
            target_modules=LANGUAGE_LORA_TARGETS.format(names=names),
            init_lora_weights=cfg.lora.init if cfg.lora.init == "gaussian" else True,
        )
        model = get_peft_model(model, lora)
        for param in model.parameters():  # trainable weights stay fp32 whatever the base dtype
            if param.requires_grad:
                param.data = param.data.float()
        return model
    model.float().requires_grad_(True)  # fp32 master weights; forwards run under autocast(model.dtype)
    if cfg.vlm.freeze_vision:
        visual = getattr(model, "visual", None) or model.model.visual
        visual.requires_grad_(False)
    return model


def _real_size(cfg: ModelConfig, device: torch.device) -> tuple[Any, Any]:
    """``model.weights=random_init``: the published architecture of ``model.variant`` at random init on
    ``device`` (``models/real_size.py``), read through the tiny tokenizer with the published processor
    geometry (14-px patches), the pixel bounds of ``model.vlm``."""
    from rlgen_cli.models.real_size import build_vlm_model, vl_processor
    from rlgen_cli.vlm.tokenizer import CHAT_TEMPLATE, tiny_tokenizer

    processor = vl_processor(tiny_tokenizer(), CHAT_TEMPLATE, cfg.vlm.min_pixels, cfg.vlm.max_pixels)
    return processor, build_vlm_model(cfg, processor.tokenizer, device)


def build_vlm(cfg: ModelConfig, device: torch.device) -> VLMPolicy:
    """The policy of ``cfg`` (``family`` qwen2_vl | qwen2_5_vl | qwen3_vl; tiny, random-init real size or
    loaded) on ``device``.

    Raises:
        UserError: On an unknown family or a path that cannot be loaded.
    """
    if cfg.family not in VLM_FAMILIES:
        raise UserError(
            f"model.family={cfg.family!r} is not a VLM family; choose one of {', '.join(VLM_FAMILIES)}"
        )
    try:
        if cfg.weights == "random_init":
            processor, model = _real_size(cfg, device)
        else:
            processor = _processor(cfg)
            model = _base_model(cfg, processor)
    except OSError as err:
        raise UserError(
            f"cannot load {cfg.family} from model.path={cfg.path!r} ({err}); give a hub id or a local "
            "directory with config.json and weights (model.local_files_only=true for offline use)"
        ) from err
    model = _make_trainable(model, cfg).to(device)
    prepare_vlm(model, cfg)  # attention kernel, gradient checkpointing, train/eval mode
    policy = VLMPolicy(model=model, processor=processor, cfg=cfg, device=device)
    log.info(
        "%s%s: %d parameters, %d trainable (%s)",
        cfg.family,
        " (tiny)" if cfg.tiny else " (random init)" if cfg.weights == "random_init" else "",
        sum(p.numel() for p in model.parameters()),
        sum(p.numel() for p in policy.trainable_parameters()),
        "LoRA" if cfg.lora.enabled else "full fine-tuning",
    )
    return policy


def load_vlm(cfg: ModelConfig | None, checkpoint: str | None, device: torch.device) -> VLMPolicy:
    """The policy of ``cfg`` with ``checkpoint``'s trained weights loaded (when given). With a checkpoint,
    ``cfg`` is the model section its weights fit (its saved one with the run's decoding / dtype overrides:
    ``tasks/loading.py: checkpoint_model``), or None for the saved section as it is."""
    if checkpoint is None:
        if cfg is None:
            raise UserError("nothing to load: give a model config or a checkpoint directory")
        return build_vlm(cfg, device)
    from omegaconf import OmegaConf

    from rlgen_cli.schema.model import typed_model_section
    from rlgen_cli.training.checkpoints.checkpoint import open_checkpoint

    ckpt = open_checkpoint(checkpoint)
    if cfg is None:
        cfg = OmegaConf.to_object(typed_model_section(ckpt.config().model))
    policy = build_vlm(cfg, device)
    policy.load_trainable(ckpt.weights)
    log.info("loaded trained weights from %s", ckpt.path)
    return policy


def export_merged(policy: VLMPolicy, out_dir: str | Path) -> Path:
    """Write a plain Hugging Face model directory (LoRA merged into the base) plus the processor.

    The LoRA policy is merged on a copy, so ``policy`` keeps training. VLMEvalKit / lmms-eval / vLLM load
    the result with ``from_pretrained(out_dir)``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(policy.model).merge_and_unload() if policy.is_lora else policy.model
    model.save_pretrained(out)
    policy.processor.save_pretrained(out)
    log.info("exported merged %s to %s", policy.cfg.family, out)
    return out
