"""BAGEL as a native unified policy: R3's text and image tracks on ONE Mixture-of-Transformers network.

:class:`BagelUnifiedPolicy` implements :class:`~rlgen_cli.r3.policy.UnifiedPolicy` (``model.family:
r3_bagel``) with a :class:`~rlgen_cli.models.bagel.policy.BagelPolicy` for everything image-side (noise,
schedule, the velocity with BAGEL's CFG, the VAE) and ``models/bagel/text.py`` for everything text-side.
Contexts follow the reference's interleaved inference (``models/bagel/text.py`` lays them out):

* **think** (reason, text) — [system prompt asking for a plan in ``<think>…</think>``] [prompt]
  ``<|im_start|>`` → the plan, sampled with the KV cache through the understanding expert.
* **encode_generate** (reason, image) — with ``r3.policy.think`` on, the image is drawn from the same
  context: system prompt, prompt, then the plan as a text piece (the reference's ``think=True`` path
  appends its generated text; here the extracted plan, without its ``<think>`` tags), and the text-CFG branch is the system prompt alone (the reference's
  ``cfg_text_precontext``). With it off, no plan is sampled (``think`` returns empty completions: the
  reason stage trains its image alone, as the reference's ``think_mode=False``) and the image is drawn from
  the prompt alone against the empty context.
* **reflect** — [system prompt] [the image as ViT tokens] [the reflection question] ``<|im_start|>`` → the
  critique and instruction. The image goes through the same 8-bit quantisation the composite's text policy
  sees (``to_pil``), in sampling and in scoring alike.
* **encode_edit** — ``BagelPolicy.encode(instructions, images)``: BAGEL's editing conditioning.

The wording of the system prompts and questions is rlgen's R3 wording (``r3/prompts.py``), shared with the
composite.

**Two tracks on one network.** The trained tensors split by name (:func:`is_image_tensor`): the image
track owns the generation expert (``*_moe_gen``: its projections, q/k norms, layer norms, MLP and final
norm) and the generation head around it (``time_embedder``, ``vae2llm``, ``llm2vae``); the text track owns
everything else that trains. Two ways to train (``r3.policy.bagel.lora.enabled``):

* **Full fine-tuning** (``false``, upstream R3's ``train_rl.sh``: every weight but the ViT's, one optimizer):
  the text track is the understanding expert (q/k/v/o, q/k norms, layer norms, MLP, final ``norm``), the
  token embeddings, the LM head (untied in BAGEL) and the ViT→LLM ``connector``; the ViT and the VAE are
  frozen, the sin-cos position tables are buffers. The reference is a frozen copy of the starting network
  (``TrainableTransformer``'s, as the composite's full fine-tuning has it): ``token_logprobs(reference=True)``
  runs on the copy (contexts embedded by the copy's embeddings and connector too) and
  :meth:`BagelUnifiedPolicy.image_reference` trades the image track's tensors with the copy's (a swap of
  storage, no copy) — the prompt still runs through the trained understanding expert. Checkpoints are the
  whole network in the release layout (``ema.safetensors`` + configs + VAE + tokenizer,
  ``models/bagel/loading.py``): a trained checkpoint is a ``r3.policy.bagel.path``.
* **LoRA** (``true``): one adapter covers both experts, its tensors split the same way (the understanding
  expert's ``q_proj``, …, ``mlp.down_proj`` / the ``*_moe_gen`` ones); the reference is every adapter off
  (text) or the generation expert's adapters off (image); checkpoints hold the adapter alone.

Both tracks' forwards are one network: under DDP they go through one wrapper around its MoT stack
(:class:`_Distributed`), whose output carries 0·Σθ over every trainable tensor of the network (the heads and
embeddings outside the stack included) so each backward reduces every parameter (a text pass leaves the
generation expert unused, an image pass the last layer's understanding projections). One process takes the
same route without the wrapper, so an unused tensor gets a zero gradient there too and AdamW's step count
(its bias correction) is the same on one process as on many.

    policy = build_bagel_unified(cfg.r3.policy, device)   # tiny BAGEL on a CPU, or model.path's checkpoint
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models import Cond, build_policy
from rlgen_cli.models.bagel import text as bagel_text
from rlgen_cli.models.bagel.loading import read_weights, save_checkpoint, weight_source
from rlgen_cli.models.bagel.modeling import Bagel
from rlgen_cli.models.bagel.policy import BagelPolicy
from rlgen_cli.models.trainable import autocast
from rlgen_cli.r3.policy import EDIT, GENERATE, IMAGE, STAGE_KEY, TEXT, Thoughts, stage_of
from rlgen_cli.r3.prompts import REASON_SYSTEM, REFLECT_SYSTEM, reason_user, reflect_user
from rlgen_cli.schema.r3 import R3BagelPolicy
from rlgen_cli.sde.noise import Stream, stream_seed
from rlgen_cli.training.reporting.images import to_pil
from rlgen_cli.vlm.rollout import SamplingOptions, TokenBatch, pad_stack

log = logging.getLogger(__name__)

__all__ = ["BagelTokenBatch", "BagelUnifiedPolicy", "build_bagel_unified", "is_image_tensor"]

GENERATION_EXPERT = "_moe_gen"
"""Module names of the generation expert carry this suffix (``q_proj_moe_gen``, ``mlp_moe_gen.…``)."""
GENERATION_HEAD = ("time_embedder.", "vae2llm.", "llm2vae.")
"""The modules around the MoT stack only the image pass uses: latent patches in, velocity out, time."""
FROZEN = ("vit_model.",)
"""Never trained (upstream R3's ``freeze_vit``); the VAE lives outside the network."""


def is_image_tensor(name: str) -> bool:
    """Whether a trained tensor of the network (a weight, or a LoRA tensor) belongs to the image track:
    the generation expert or the generation head."""
    return GENERATION_EXPERT in name or name.startswith(GENERATION_HEAD)


@dataclass
class BagelTokenBatch(TokenBatch):
    """The training layout of B completions: each row's prompt and image (``None``: a reason row), from
    which the scoring network embeds the context (under full fine-tuning the embeddings and the connector
    train, and the reference embeds with its own), and the completion grid."""

    prompts: list[str] = None  # type: ignore[assignment]
    images: list[Any] = None  # type: ignore[assignment]


class _Route(nn.Module):
    """What DDP wraps: the MoT stack (``language_model.model``), whose output carries 0·Σθ over the trainable
    tensors of the whole network (under full fine-tuning also the LM head, embeddings, connector and
    generation head, which run outside the stack) so that every backward reduces every parameter."""

    def __init__(self, network: Bagel) -> None:
        super().__init__()
        self.network = network

    def forward(self, x: Tensor, gen: Tensor, position_ids: Tensor, mask: Tensor) -> Tensor:
        out = self.network.language_model.model(x, gen, position_ids, mask)
        anchor = sum(p.sum() for p in self.network.parameters() if p.requires_grad)
        return out + 0.0 * anchor


class _View:
    """A stand-in for a module: its call runs ``call``, every attribute is the module's own."""

    def __init__(self, module: nn.Module, call: Callable[..., Tensor], **overrides: Any) -> None:
        self._module, self._call = module, call
        self.__dict__.update(overrides)

    def __call__(self, *args: Any) -> Tensor:
        return self._call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _Distributed:
    """The network as the training forwards see it under DDP: every attribute is the bare network's, except
    ``language_model.model``, whose call runs through the wrapper (the module DDP registered every trained
    tensor of the network with, :class:`_Route`). Passes run on this object (called with the pass,
    as :meth:`Bagel.forward` is, or given it as their network: the text paths) therefore reduce their
    gradients. ``module`` is the bare network, which ``TrainableTransformer.forward_module`` checks."""

    def __init__(self, wrapped: nn.Module, network: Bagel) -> None:
        self.wrapped, self.module = wrapped, network
        language_model = network.language_model
        self.language_model = _View(
            language_model, language_model, model=_View(language_model.model, wrapped)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def __call__(self, method: Callable[..., Tensor], *args: Any) -> Tensor:
        """As :meth:`Bagel.forward`: ``method`` runs on this view, so its MoT stack goes through DDP."""
        return method(self, *args)


class BagelUnifiedPolicy:
    """R3's unified policy on one BAGEL network (see the module docstring)."""

    def __init__(self, image: BagelPolicy, think: bool) -> None:
        self.image = image
        self.think_mode = think
        self.device = image.device
        self.dtype = image.dtype
        self.lora = image.trainable.lora
        named = [(n, p) for n, p in self.network.named_parameters() if p.requires_grad]
        self.tracks = {
            TEXT: [p for n, p in named if not is_image_tensor(n)],
            IMAGE: [p for n, p in named if is_image_tensor(n)],
        }
        self._image_pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        if not self.lora:  # each image-track weight with its frozen starting value
            with image.trainable.reference():
                frozen = dict(self.network.named_parameters())
            self._image_pairs = [(p, frozen[n]) for n, p in named if is_image_tensor(n)]
        # One process routes its training forwards as DDP does (without the wrapper): every trained tensor
        # gets a gradient each step, zero where a stage leaves it unused (the connector in a reason step),
        # so AdamW counts the same steps for it on one process as on many.
        self.distribute(lambda module: module)

    @property
    def network(self) -> Bagel:
        return self.image.transformer

    # -- text track ---------------------------------------------------------------------------------
    def think(self, prompts: Sequence[str], options: SamplingOptions, seed: int) -> Thoughts:
        """A plan per prompt (thinking on); with thinking off no text: empty completions."""
        n = len(prompts)
        if not self.think_mode:
            empty = [torch.zeros(0, dtype=torch.long) for _ in range(n)]
            return Thoughts(list(prompts), [None] * n, empty, [""] * n, [False] * n, [torch.zeros(0)] * n)
        return self._sample(list(prompts), [None] * n, options, seed)

    def reflect(
        self, images: Tensor, prompts: Sequence[str], options: SamplingOptions, seed: int
    ) -> Thoughts:
        """A critique and an instruction per (image (B, 3, H, W) in [0, 1], prompt)."""
        return self._sample(list(prompts), [to_pil(image) for image in images], options, seed)

    def _pieces(self, prompt: str, image: Any) -> list[bagel_text.Piece]:
        start = [self.image.markers["<|im_start|>"]]
        if image is None:
            return [REASON_SYSTEM, reason_user(prompt), start]
        return [REFLECT_SYSTEM, _to_tensor(image), reflect_user(prompt), start]

    def _contexts(self, prompts: Sequence[str], images: Sequence[Any]) -> list[bagel_text.Context]:
        with autocast(self.device, self.dtype):
            return [
                bagel_text.build_context(
                    self.network, self._pieces(p, im), self.image.tokenizer, self.image.markers
                )
                for p, im in zip(prompts, images, strict=True)
            ]

    def _sample(self, prompts: list[str], images: list, options: SamplingOptions, seed: int) -> Thoughts:
        contexts = self._contexts(prompts, images)
        generators = [
            torch.Generator().manual_seed(stream_seed(seed, 0, row, salt=Stream.R3_TEXT))
            for row in range(len(prompts))
        ]
        with autocast(self.device, self.dtype):
            out = bagel_text.sample(
                self.network,
                contexts,
                temperature=options.temperature,
                top_p=options.top_p,
                top_k=options.top_k,
                max_new_tokens=options.max_new_tokens,
                stop_id=self.image.markers["<|im_end|>"],
                generators=generators,
            )
        texts = self.image.tokenizer.batch_decode(out.ids, skip_special_tokens=True)
        return Thoughts(prompts, images, out.ids, texts, out.truncated, out.logprobs)

    def token_batch(self, thoughts: Thoughts, rows: slice) -> BagelTokenBatch:
        """The prompts and images of ``thoughts[rows]`` and their completions, right-padded."""
        completions = [c.long() for c in thoughts.completions[rows]]
        ids = pad_stack(completions, value=0).to(self.device)
        mask = pad_stack([torch.ones(c.numel(), dtype=torch.long) for c in completions]).to(self.device)
        return BagelTokenBatch(
            inputs={},
            completion_ids=ids,
            completion_mask=mask,
            prompts=list(thoughts.prompts[rows]),
            images=list(thoughts.images[rows]),
        )

    def token_logprobs(self, batch: TokenBatch, reference: bool = False) -> Tensor:
        """(B, L) completion log-probs at temperature 1, one full forward: π_θ (gradients if enabled), or
        π_ref (every adapter off, or the frozen copy: the context embedded by it too)."""
        if not isinstance(batch, BagelTokenBatch):
            raise TypeError("token_logprobs takes the BagelTokenBatch of token_batch")
        completions = [
            row[: int(n)] for row, n in zip(batch.completion_ids, batch.completion_mask.sum(1), strict=True)
        ]
        if not reference:
            network = self.image.trainable.forward_module()  # the DDP route when gradients flow
            # full FT: the graph reaches the embeddings and the connector through the context
            contexts = self._contexts(batch.prompts, batch.images)
            with autocast(self.device, self.dtype):
                return bagel_text.completion_logprobs(network, contexts, completions)
        with torch.no_grad(), self.image.trainable.reference():
            contexts = self._contexts(batch.prompts, batch.images)  # self.network: the reference now
            with autocast(self.device, self.dtype):
                return bagel_text.completion_logprobs(self.network, contexts, completions)

    # -- image track --------------------------------------------------------------------------------
    def encode_generate(self, prompts: Sequence[str], plans: Sequence[str]) -> Cond:
        """Prompt (+ system prompt and plan when thinking) as the generation context; the text-CFG branch
        is the system prompt (thinking) or the empty / ``negative_prompt`` context."""
        tokenizer, markers = self.image.tokenizer, self.image.markers
        rows, negatives = [], []
        for prompt, plan in zip(prompts, plans, strict=True):
            pieces = [REASON_SYSTEM, reason_user(prompt), plan.strip()] if self.think_mode else [prompt]
            rows.append([i for p in pieces if p for i in bagel_text.text_piece(tokenizer, markers, p)])
            negative = REASON_SYSTEM if self.think_mode else self.image.cfg.negative_prompt
            negatives.append(bagel_text.text_piece(tokenizer, markers, negative) if negative else [])
        cond = self.image.encode_token_rows(rows, negatives)
        return Cond(cond.tensors, {**cond.extras, STAGE_KEY: GENERATE})

    def encode_edit(self, images: Tensor, instructions: Sequence[str]) -> Cond:
        """BAGEL's editing conditioning on (source image resized to the image size, instruction)."""
        size = self.image_size(EDIT)
        if tuple(images.shape[-2:]) != size:
            images = F.interpolate(images.float(), size=size, mode="bilinear", antialias=True).clamp(0, 1)
        cond = self.image.encode(list(instructions), images.to(self.device))
        cond.extras[STAGE_KEY] = EDIT
        return cond

    def noise(self, n: int, generators: Sequence[torch.Generator], stage: str) -> Tensor:
        return self.image.noise(n, generators)

    def schedule(self, num_steps: int, x: Tensor, stage: str) -> Tensor:
        return self.image.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """BAGEL's velocity (CFG folded in) for a generation or an editing conditioning."""
        stage_of(cond)
        return self.image.velocity(x, sigma, cond)

    def decode(self, x0: Tensor, stage: str) -> Tensor:
        return self.image.decode(x0)

    def image_size(self, stage: str) -> tuple[int, int]:
        """(H, W) in pixels: both stages draw at ``r3.policy.bagel``'s resolution."""
        cfg = self.image.cfg
        return cfg.height or cfg.resolution, cfg.width or cfg.resolution

    # -- training -----------------------------------------------------------------------------------
    def trainable_parameters(self, track: str) -> list[nn.Parameter]:
        """The text track's tensors (understanding expert; with full FT also embeddings, LM head, connector)
        or the image track's (generation expert; with full FT also the generation head): module docstring."""
        if track not in self.tracks:
            raise ValueError(f"unknown track {track!r}; tracks: {TEXT}, {IMAGE}")
        return self.tracks[track]

    def keep_reference(self) -> None:
        """Nothing to do: the reference (a frozen copy of the starting network, or the adapters off) is
        made when the policy is built, before any weights load."""

    @contextlib.contextmanager
    def image_reference(self) -> Iterator[None]:
        """Within: the image track is its reference — the generation expert's adapters off (LoRA) or its
        starting weights (full FT) — while the understanding expert stays trained."""
        if not self.lora:
            with self._image_weights_swapped():
                yield
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [
            m for n, m in self.network.named_modules() if isinstance(m, BaseTunerLayer) and is_image_tensor(n)
        ]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    @contextlib.contextmanager
    def _image_weights_swapped(self) -> Iterator[None]:
        """The image track's live tensors trade storage with the frozen copy's (O(1), no copy made); the
        copy's storage returns on exit, so nothing the optimizer holds changes."""

        def swap() -> None:
            with torch.no_grad():
                for live, frozen in self._image_pairs:
                    live.data, frozen.data = frozen.data, live.data

        swap()
        try:
            yield
        finally:
            swap()

    def distribute(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """One wrapper (DDP: averaged gradients) for both tracks' training forwards on the one network."""
        self.image.trainable.distribute(lambda network: _Distributed(wrap(_Route(network)), network))

    def save_trainable(self, directory: Path) -> None:
        """Both tracks at once: the adapter of both experts (LoRA, ``models/bagel/policy.py``'s format), or
        the whole network as a BAGEL checkpoint in the release layout (full FT: ``r3.policy.bagel.path``
        can load it)."""
        if self.lora:
            self.image.trainable.save(Path(directory))
            return
        save_checkpoint(self.network, self.image.vae, self.image.tokenizer, Path(directory))

    def load_trainable(self, directory: Path) -> None:
        """Load what :meth:`save_trainable` wrote (full FT: every tensor of the network, strictly)."""
        if self.lora:
            self.image.trainable.load(Path(directory))
            return
        state = read_weights(weight_source(Path(directory)), torch.float32)  # trained weights are fp32
        try:
            self.network.load_state_dict(state)
        except RuntimeError as error:
            raise UserError(
                f"the BAGEL weights in {directory} do not fit this network ({error}); was the checkpoint "
                "made with another r3.policy.bagel model?"
            ) from error


def _to_tensor(image: Any) -> Tensor:
    """A PIL image → (3, H, W) float in [0, 1]."""
    import numpy as np

    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)


def build_bagel_unified(cfg: R3BagelPolicy, device: torch.device) -> BagelUnifiedPolicy:
    """The unified policy of ``r3.policy.bagel`` (tiny, or the checkpoint at its ``path``) on ``device``.

    Raises:
        UserError: When the section is not a BAGEL, or its LoRA targets leave a track without tensors.
    """
    bagel = cfg.bagel
    if bagel.family != "bagel":
        raise UserError(f"model.family=r3_bagel needs r3.policy.bagel.family=bagel, got {bagel.family!r}")
    image = build_policy(bagel, device)
    if not bagel.lora.enabled:  # full fine-tuning: everything but the ViT (upstream's freeze_vit)
        for name, param in image.transformer.named_parameters():
            if name.startswith(FROZEN):
                param.requires_grad_(False)
        _share_frozen_vit(image)
    policy = BagelUnifiedPolicy(image, cfg.think)
    for track, expert in (
        (TEXT, "understanding (q_proj, …, mlp.down_proj)"),
        (IMAGE, "generation (*_moe_gen)"),
    ):
        if not policy.trainable_parameters(track):
            raise UserError(
                f"r3.policy.bagel.lora.target_modules={list(bagel.lora.target_modules)} adapts no module of the "
                f"{expert} expert: the {track} track would have nothing to train; add its projections"
            )
    log.info(
        "R3 on BAGEL (%s): one network, thinking %s; %s: %d text parameters (understanding), %d image "
        "(generation)",
        "tiny" if bagel.tiny else bagel.path,
        "on" if cfg.think else "off",
        "LoRA" if bagel.lora.enabled else "full fine-tuning",
        _numel(policy.tracks[TEXT]),
        _numel(policy.tracks[IMAGE]),
    )
    return policy


def _numel(params: Sequence[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def _share_frozen_vit(image: BagelPolicy) -> None:
    """The reference copy uses the live ViT: frozen in both, one copy of its weights serves both."""
    vit = image.transformer.vit_model
    with image.trainable.reference():
        image.transformer.vit_model = vit
