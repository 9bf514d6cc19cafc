"""A unified policy composed of three models: a VLM that writes, a generator and an editor that draw.

:class:`CompositePolicy` implements :class:`~rlgen_cli.r3.policy.UnifiedPolicy` with rlgen's adapters:
the text policy is a :class:`~rlgen_cli.vlm.policy.VLMPolicy` (Qwen2-VL / Qwen2.5-VL), the generator and
the editor are flow policies of any family (``models/registry.py``) — Qwen-Image and Qwen-Image-Edit by
default. Each keeps its own LoRA adapter (or full fine-tuning), reference and checkpoint format; the
composite routes the image calls by the stage the conditioning carries.

``share_text_encoder``: Qwen-Image conditions on the last hidden state of a Qwen2.5-VL, the same
architecture as the text policy. With the option on, the text policy *is* the generator's text encoder
plus a LoRA adapter, and every prompt the generator encodes runs with that adapter disabled — the image
model keeps seeing its pretrained encoder while the text track trains (one copy of the weights instead of
two). It needs a LoRA text policy (full fine-tuning would change the encoder under the image model) of
the same dtype. The editor keeps its own encoder.

    policy = build_composite(cfg.r3.policy, device)        # tiny parts on a CPU, real ones from paths
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models import Cond, FlowPolicy, build_policy
from rlgen_cli.models.acceleration import prepare_vlm
from rlgen_cli.models.qwen_image import QwenImagePolicy
from rlgen_cli.r3.policy import EDIT, GENERATE, IMAGE, STAGE_KEY, TEXT, Thoughts, stage_of
from rlgen_cli.r3.prompts import REASON_SYSTEM, REFLECT_SYSTEM, generation_prompt, reason_user, reflect_user
from rlgen_cli.schema.r3 import R3CompositePolicy
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.schema.vlm import VLM_FAMILIES
from rlgen_cli.training.reporting.images import to_pil
from rlgen_cli.vlm.policy import VLMPolicy, build_vlm
from rlgen_cli.vlm.rollout import (
    SamplingOptions,
    TokenBatch,
    check_context,
    collate,
    completion_logprobs,
    encode_prompts,
    generate,
)

log = logging.getLogger(__name__)

__all__ = ["CompositePolicy", "build_composite", "shared_text_policy"]

PART_DIRS = {TEXT: "text", GENERATE: "generator", EDIT: "editor"}
"""Sub-directories of a checkpoint's ``weights/``, one per part, each in that part's own format."""


class CompositePolicy:
    """Text policy + generator + editor behind the unified-policy protocol."""

    def __init__(
        self, text: VLMPolicy, generator: FlowPolicy, editor: FlowPolicy, share_text_encoder: bool = False
    ) -> None:
        self.text = text
        self.parts: dict[str, FlowPolicy] = {GENERATE: generator, EDIT: editor}
        self.share_text_encoder = share_text_encoder
        self.device = text.device

    # -- text track ---------------------------------------------------------------------------------
    def think(self, prompts: Sequence[str], options: SamplingOptions, seed: int) -> Thoughts:
        """Sample a plan per prompt (``<think>plan</think>`` expected)."""
        chats = [self._chat(REASON_SYSTEM, reason_user(p), image=False) for p in prompts]
        return self._sample(chats, [None] * len(chats), options, seed)

    def reflect(
        self, images: Tensor, prompts: Sequence[str], options: SamplingOptions, seed: int
    ) -> Thoughts:
        """Sample a critique and an instruction per (image (B, 3, H, W) in [0, 1], prompt)."""
        chats = [self._chat(REFLECT_SYSTEM, reflect_user(p), image=True) for p in prompts]
        return self._sample(chats, [to_pil(image) for image in images], options, seed)

    def _chat(self, system: str, user: str, image: bool) -> str:
        content = [{"type": "image"}] * image + [{"type": "text", "text": user}]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
        return self.text.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _sample(self, chats: list[str], images: list, options: SamplingOptions, seed: int) -> Thoughts:
        encoded = encode_prompts(self.text, chats, images)
        check_context(self.text, encoded, options.max_new_tokens, [f"#{i}" for i in range(len(chats))])
        done = generate(self.text, encoded, options, seed)
        texts = self.text.tokenizer.batch_decode(done.ids, skip_special_tokens=True)
        return Thoughts(chats, images, done.ids, texts, done.truncated, done.logprobs or [])

    def token_batch(self, thoughts: Thoughts, rows: slice) -> TokenBatch:
        """The training layout of ``thoughts[rows]`` (left-padded prompt, then the completion)."""
        return collate(self.text, thoughts.prompts[rows], thoughts.images[rows], thoughts.completions[rows])

    def token_logprobs(self, batch: TokenBatch, reference: bool = False) -> Tensor:
        """(B, L) completion log-probs at temperature 1: π_θ (gradients if enabled) or π_ref."""
        if not reference:
            return completion_logprobs(self.text, batch)
        with torch.no_grad(), self.text.reference() as frozen:
            return completion_logprobs(self.text, batch, frozen)

    # -- image track --------------------------------------------------------------------------------
    def encode_generate(self, prompts: Sequence[str], plans: Sequence[str]) -> Cond:
        """Generator conditioning on prompt + plan (the shared encoder with the text adapter off)."""
        texts = [generation_prompt(p, plan) for p, plan in zip(prompts, plans, strict=True)]
        with self._encoder_frozen():
            cond = self.parts[GENERATE].encode(texts)
        cond.extras[STAGE_KEY] = GENERATE
        return cond

    def encode_edit(self, images: Tensor, instructions: Sequence[str]) -> Cond:
        """Editor conditioning on (source image, instruction); sources are resized to the editor's size."""
        cond = self.parts[EDIT].encode(list(instructions), self._resized(images, EDIT).to(self.device))
        cond.extras[STAGE_KEY] = EDIT
        return cond

    def noise(self, n: int, generators: Sequence[torch.Generator], stage: str) -> Tensor:
        return self.parts[stage].noise(n, generators)

    def schedule(self, num_steps: int, x: Tensor, stage: str) -> Tensor:
        return self.parts[stage].schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The velocity of the stage ``cond`` was encoded for (CFG folded in by that part)."""
        return self.parts[stage_of(cond)].velocity(x, sigma, cond)

    def decode(self, x0: Tensor, stage: str) -> Tensor:
        return self.parts[stage].decode(x0)

    def image_size(self, stage: str) -> tuple[int, int]:
        """(H, W) in pixels of the stage's images."""
        cfg = self.parts[stage].cfg
        return cfg.height or cfg.resolution, cfg.width or cfg.resolution

    def _resized(self, images: Tensor, stage: str) -> Tensor:
        size = self.image_size(stage)
        if tuple(images.shape[-2:]) == size:
            return images
        return F.interpolate(images.float(), size=size, mode="bilinear", antialias=True).clamp(0, 1)

    @contextlib.contextmanager
    def _encoder_frozen(self) -> Iterator[None]:
        """With a shared encoder, the text adapter is off while the generator encodes."""
        if not self.share_text_encoder:
            yield
            return
        with self.text.model.disable_adapter():
            yield

    # -- training -----------------------------------------------------------------------------------
    def trainable_parameters(self, track: str) -> list[nn.Parameter]:
        """The text policy's, or the generator's and the editor's, trainable parameters."""
        if track == TEXT:
            return self.text.trainable_parameters()
        if track == IMAGE:
            return [p for part in self.parts.values() for p in part.trainable.parameters()]
        raise ValueError(f"unknown track {track!r}; tracks: {TEXT}, {IMAGE}")

    def keep_reference(self) -> None:
        """Fix the text track's reference at the weights as they are now (full fine-tuning copies them),
        before a resume loads a checkpoint's; the image parts' references are copied when built."""
        self.text.keep_reference()

    @contextlib.contextmanager
    def image_reference(self) -> Iterator[None]:
        """Within: the generator and the editor are their frozen references (adapters off)."""
        with self.parts[GENERATE].trainable.reference(), self.parts[EDIT].trainable.reference():
            yield

    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Route every part's gradient-carrying forwards through ``wrap`` (DDP: averaged gradients)."""
        self.text.distribute(wrap)
        for part in self.parts.values():
            part.trainable.distribute(wrap)

    def save_trainable(self, directory: Path) -> None:
        """Each part in its own format under ``text/``, ``generator/``, ``editor/``."""
        self.text.save_trainable(Path(directory) / PART_DIRS[TEXT])
        for stage, part in self.parts.items():
            part.trainable.save(Path(directory) / PART_DIRS[stage])

    def load_trainable(self, directory: Path) -> None:
        self.text.load_trainable(Path(directory) / PART_DIRS[TEXT])
        for stage, part in self.parts.items():
            part.trainable.load(Path(directory) / PART_DIRS[stage])


def _check_roles(generator: FlowPolicy, editor: FlowPolicy) -> None:
    if generator.capabilities.takes_source_images:
        raise UserError(
            f"r3.policy.generator.family={generator.family} edits images; the generator draws from text "
            "(e.g. qwen_image, sd3, flux)"
        )
    if not editor.capabilities.takes_source_images:
        raise UserError(
            f"r3.policy.editor.family={editor.family} takes no source image; the editor must edit "
            "(e.g. qwen_image_edit, flux_kontext)"
        )


def shared_text_policy(generator: FlowPolicy, cfg: ModelConfig, device: torch.device) -> VLMPolicy:
    """The text policy made of the generator's own Qwen2.5-VL text encoder plus a LoRA adapter.

    The processor's image side comes from ``cfg`` (tiny, or ``cfg.path``); its tokenizer is the
    generator's, so token ids mean the same to the policy and the encoder.

    Raises:
        UserError: When the encoder is not a Qwen2.5-VL, the text policy is not LoRA, or dtypes differ.
    """
    if not isinstance(generator, QwenImagePolicy) or cfg.family != "qwen2_5_vl":
        raise UserError(
            f"r3.policy.share_text_encoder needs a Qwen2.5-VL text policy and a generator whose text encoder is "
            f"a Qwen2.5-VL (qwen_image); got text family {cfg.family} and generator {generator.family}"
        )
    encoder = generator.pipeline.text_encoder
    if not cfg.lora.enabled:
        raise UserError(
            "r3.policy.share_text_encoder needs r3.policy.text.lora.enabled=true: full fine-tuning would change "
            "the generator's text encoder under it"
        )
    if cfg.dtype != generator.cfg.dtype:
        raise UserError(
            f"r3.policy.share_text_encoder: r3.policy.text.dtype ({cfg.dtype}) must equal "
            f"r3.policy.generator.dtype ({generator.cfg.dtype}), the dtype the shared weights are in"
        )
    from rlgen_cli.vlm.policy import _make_trainable  # the one LoRA set-up of every VLM policy

    processor = _shared_processor(cfg, generator.pipeline.tokenizer)
    model = _make_trainable(encoder, cfg).to(device)
    prepare_vlm(model, cfg)  # the text policy's settings, on the encoder the generator shares
    return VLMPolicy(model=model, processor=processor, cfg=cfg, device=device)


def _shared_processor(cfg: ModelConfig, tokenizer: Any) -> Any:
    vlm = cfg.vlm
    if cfg.tiny:
        from rlgen_cli.models.tiny import tiny_vlm_processor

        processor = tiny_vlm_processor(max_pixels=vlm.max_pixels)
    else:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(
            cfg.path,
            min_pixels=vlm.min_pixels,
            max_pixels=vlm.max_pixels,
            local_files_only=cfg.local_files_only,
            revision=cfg.revision,
        )
    processor.tokenizer = tokenizer
    return processor


def build_composite(cfg: R3CompositePolicy, device: torch.device) -> CompositePolicy:
    """The composite policy of ``r3.policy`` on ``device`` (each part tiny or loaded from its path).

    Raises:
        UserError: When a part has the wrong kind of family or the encoder cannot be shared.
    """
    if cfg.text.family not in VLM_FAMILIES:
        raise UserError(
            f"r3.policy.text.family={cfg.text.family!r} is not a VLM family; choose one of {', '.join(VLM_FAMILIES)}"
        )
    generator = build_policy(cfg.generator, device)
    editor = build_policy(cfg.editor, device)
    _check_roles(generator, editor)
    text = (
        shared_text_policy(generator, cfg.text, device)
        if cfg.share_text_encoder
        else build_vlm(cfg.text, device)
    )
    log.info(
        "R3 composite: text %s, generator %s, editor %s%s",
        cfg.text.family,
        generator.family,
        editor.family,
        " (text policy shares the generator's encoder)" if cfg.share_text_encoder else "",
    )
    return CompositePolicy(text, generator, editor, cfg.share_text_encoder)
