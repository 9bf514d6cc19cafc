"""BAGEL text-to-image and image editing behind the flow-policy protocol.

Conventions reproduced from the reference inference (``generate_image`` / ``_forward_flow``):

* **Latents.** ``x`` is the scaled FLUX latent (B, 16, H/8, W/8) in fp32; ``velocity`` cuts it into 2×2
  patches flattened (p, p, channel) — the generation tokens — and folds the answer back.
* **Text.** Each prompt is ``<|im_start|>`` + its tokens + ``<|im_end|>`` with no chat template (the
  reference's text-to-image context without thinking), right-padded to ``model.max_sequence_length`` with
  a mask so batches join with ``Cond.cat``.
* **Time and sign.** BAGEL's t is rlgen's σ (x_t = (1 − t)·x₀ + t·ε) and it predicts ε − x₀ = dx/dσ, the
  velocity rlgen integrates: no flip. The schedule is ``linspace(1, 0, T + 1)`` through the shift
  s·t / (1 + (s − 1)·t) (``model.shift``; the reference's ``timestep_shift`` 3.0).
* **CFG.** The text-CFG branch is the empty context (the image block alone, at rope position 0; a
  non-empty ``model.negative_prompt`` is used as that context instead). ``model.guidance_scale`` is the
  reference's ``cfg_text_scale`` in the same form u + g·(c − u); as there it acts only for t in
  (0.4, 1] and the guided velocity is rescaled to at most the conditional one's norm (``global``
  renorm with min 0, the norm per sample where the reference takes it over its one packed sample).
* **Editing.** ``encode(prompts, images)`` puts the source images (B, 3, H, W) in [0, 1], of the model's
  size, before the instruction (their clean VAE latents and ViT patches travel in the ``Cond``);
  ``velocity`` then runs the editing context with the reference's three CFG branches
  (``editing.py``: ``model.image_guidance_scale`` is its cfg_img_scale, the interval and ``text_channel``
  renorm its editing defaults). Both families edit on request; ``bagel_edit`` declares that it needs the
  sources, so the recipes hand them over.
* **LoRA.** On the generation expert by default (``*_moe_gen``); targets naming the understanding
  expert's projections adapt both. The ViT is never adapted (excluded from every pattern).

Precision: the network runs in ``model.dtype`` under autocast, the VAE in fp32; latents stay fp32 between
steps and the CFG branches are combined in fp32.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models.bagel import editing
from rlgen_cli.models.bagel import vae as bagel_vae
from rlgen_cli.models.bagel.config import EDITING, GENERATION
from rlgen_cli.models.bagel.loading import load_checkpoint
from rlgen_cli.models.bagel.modeling import Bagel
from rlgen_cli.models.base import TORCH_DTYPES, Capabilities, Cond, cfg_combine, uncond_takes_grad
from rlgen_cli.models.loading import cast_as_loaded, frozen_dtype, vae_dtype
from rlgen_cli.models.trainable import LORA_WEIGHTS_NAME, TrainableTransformer, autocast, load_lora_state
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal
from rlgen_cli.sde.schedule import shift_sigmas

BAGEL_LORA_TARGETS = [
    "q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen", "o_proj_moe_gen",
    "mlp_moe_gen.gate_proj", "mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj",
]  # fmt: skip
"""The generation expert's attention projections and MLP in every layer."""
FULL_WEIGHTS_NAME = "bagel.safetensors"


class BagelCheckpoint:
    """LoRA → ``pytorch_lora_weights.safetensors`` (peft names, adapter config in the metadata); full
    fine-tuning → ``bagel.safetensors``, the network's state dict under the release's names."""

    def save(self, module: nn.Module, directory: Path, lora: bool) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        if not lora:
            save_file(
                {k: v.contiguous() for k, v in module.state_dict().items()}, directory / FULL_WEIGHTS_NAME
            )
            return
        from peft.utils import get_peft_model_state_dict

        state = {k: v.contiguous() for k, v in get_peft_model_state_dict(module).items()}
        config = module.peft_config["default"].to_dict()
        metadata = {"lora_adapter_metadata": json.dumps(config, default=list, sort_keys=True)}
        save_file(state, directory / LORA_WEIGHTS_NAME, metadata=metadata)

    def load(self, module: nn.Module, directory: Path, lora: bool) -> None:
        from safetensors.torch import load_file

        path = directory / (LORA_WEIGHTS_NAME if lora else FULL_WEIGHTS_NAME)
        if not path.is_file():
            raise UserError(
                f"{path} is missing: the checkpoint holds no {'LoRA' if lora else 'full'} weights"
            )
        if lora:
            load_lora_state(module, load_file(path), path)
        else:
            module.load_state_dict(load_file(path))


def patchify_latents(x: Tensor, p: int) -> Tensor:
    """(B, C, h, w) → (B, h/p·w/p, p·p·C): row-major patches, each flattened (p, p, channel)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), -1)


def unpatchify_latents(tokens: Tensor, c: int, h: int, w: int, p: int) -> Tensor:
    """Inverse of :func:`patchify_latents` for a (B, C, h, w) latent."""
    b = tokens.shape[0]
    return tokens.reshape(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)


def renormed_guidance(uncond: Tensor, cond: Tensor, scale: float, floor: float) -> Tensor:
    """u + g·(c − u) (:func:`cfg_combine`), then scaled by clamp(‖c‖ / ‖·‖, floor, 1) per sample."""
    guided = cfg_combine(uncond, cond, scale)
    dims = tuple(range(1, cond.dim()))
    norm = torch.linalg.vector_norm
    ratio = norm(cond, dim=dims, keepdim=True) / (norm(guided, dim=dims, keepdim=True) + 1e-8)
    return guided * ratio.clamp(min=floor, max=1.0)


class _Owner:
    """What :class:`TrainableTransformer` adapts: the network under the name ``transformer``."""

    def __init__(self, network: Bagel) -> None:
        self.transformer = network


class BagelPolicy:
    """BAGEL text-to-image and editing: one MoT network, text (and source-image) context, generation-expert
    velocity, FLUX VAE. ``model.family=bagel_edit`` declares that every prompt comes with a source image."""

    def __init__(
        self,
        network: Bagel,
        vae: Any,
        tokenizer: Any,
        markers: dict[str, int],
        cfg: ModelConfig,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]
        self.family = cfg.family
        self.guidance_scale = cfg.guidance_scale
        self.image_guidance_scale = cfg.image_guidance_scale
        self.capabilities = Capabilities(
            takes_source_images=cfg.family == "bagel_edit", has_cfg=cfg.guidance_scale > 1.0
        )
        self.config = network.config
        self.tokenizer = tokenizer
        self.markers = markers
        self.vae = vae.to(device, vae_dtype(cfg, fp32_by_default=True)).requires_grad_(False).eval()
        self.owner = _Owner(network.to(device))
        height, width = cfg.height or cfg.resolution, cfg.width or cfg.resolution
        self.latent_hw = (self._latent_side(height, "height"), self._latent_side(width, "width"))
        vit_linears = [
            f"vit_model.{n}" for n, m in network.vit_model.named_modules() if isinstance(m, nn.Linear)
        ]
        self.trainable = TrainableTransformer(
            self.owner, cfg, checkpoint=BagelCheckpoint(), exclude=vit_linears
        )

    @property
    def transformer(self) -> Bagel:
        return self.owner.transformer

    def _latent_side(self, pixels: int, name: str) -> int:
        multiple = self.config.latent_downsample
        patches = pixels // multiple
        if pixels % multiple or patches > self.config.max_latent_size:
            raise UserError(
                f"image {name} {pixels} px: BAGEL needs a multiple of {multiple} (VAE {self.config.vae.downsample}× "
                f"down, 2×2 patches) of at most {multiple * self.config.max_latent_size} px; set model.resolution "
                f"(or model.{name}) accordingly"
            )
        return pixels // self.config.vae.downsample

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Token ids (B, S) and mask (B, S) of each prompt's context ``<|im_start|>`` prompt ``<|im_end|>``;
        with CFG the empty (or ``model.negative_prompt``) context as ``neg_text_ids`` / ``neg_text_mask``.
        With ``images`` (B, 3, H, W) in [0, 1] the editing conditioning (:meth:`_with_sources`)."""
        return self.encode_token_rows([self._marked(p) for p in prompts], images=images)

    @torch.no_grad()
    def encode_formatted(self, contexts: Sequence[str], images: Tensor | None = None) -> Cond:
        """:meth:`encode` for contexts already formatted by the caller: each string is tokenized as it is
        (its special tokens recognised, no markers added), e.g. a chat-formatted turn."""
        return self.encode_token_rows(
            [self.tokenizer.encode(c, add_special_tokens=False) for c in contexts], images=images
        )

    @torch.no_grad()
    def encode_token_rows(
        self, rows: list[list[int]], negatives: list[list[int]] | None = None, images: Tensor | None = None
    ) -> Cond:
        """The conditioning of contexts given as token ids (markers included), right-padded to
        ``model.max_sequence_length``; ``negatives``: the text-CFG contexts (default: the marked
        ``model.negative_prompt``, or no text at all when it is empty, as the reference's)."""
        if images is None and self.capabilities.takes_source_images:
            raise UserError(
                "model.family=bagel_edit edits a source image per prompt and got none; give the data set an "
                '"image" path per row (data=tiny_edit for the tiny model), or use model.family=bagel'
            )
        ids, mask = self._padded(rows)
        tensors = {"text_ids": ids, "text_mask": mask}
        if self.guidance_scale > 1.0 and negatives is not None:
            neg_ids, neg_mask = self._padded(negatives)
            tensors |= {"neg_text_ids": neg_ids, "neg_text_mask": neg_mask}
        elif self.guidance_scale > 1.0:
            negative = self.cfg.negative_prompt
            neg_ids, neg_mask = self._padded([self._marked(negative)] * len(rows))
            if not negative:
                neg_mask.zero_()  # the reference's text-CFG context holds no text
            tensors |= {"neg_text_ids": neg_ids, "neg_text_mask": neg_mask}
        if images is None:
            return Cond(tensors)
        return self._with_sources(tensors, images)

    def _with_sources(self, tensors: dict[str, Tensor], images: Tensor) -> Cond:
        """Add the source images' clean latents (B, C, h, w) and ViT patches (B, m, 3·p²) to ``tensors``."""
        expected = tuple(d * self.config.vae.downsample for d in self.latent_hw)
        if images.dim() != 4 or images.shape[0] != len(tensors["text_ids"]) or images.shape[1] != 3:
            raise UserError(
                f"BAGEL edits one source image per prompt: expected ({len(tensors['text_ids'])}, 3, H, W) images, "
                f"got {tuple(images.shape)} (multi-image editing is not supported)"
            )
        if tuple(images.shape[-2:]) != expected:
            raise UserError(
                f"source images of {tuple(images.shape[-2:])} px: BAGEL edits at the model's size {expected} "
                "(model.resolution or model.height/model.width); resize the sources to it"
            )
        images = images.to(self.device, torch.float32)
        patches, vit_grid = editing.vit_patches(images, self.config.vit)
        tensors |= {
            editing.SOURCE_TOKENS_KEY: bagel_vae.encode(self.vae, images),
            editing.VIT_PATCHES_KEY: patches,
        }
        return Cond(tensors, {editing.VIT_GRID_KEY: vit_grid})

    def _marked(self, prompt: str) -> list[int]:
        start, end = self.markers["<|im_start|>"], self.markers["<|im_end|>"]
        return [start, *self.tokenizer.encode(prompt, add_special_tokens=False), end]

    def _padded(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        length = self.cfg.max_sequence_length
        end = self.markers["<|im_end|>"]
        longest = max(len(r) for r in rows)
        if longest > length:
            raise UserError(
                f"a prompt takes {longest} tokens (with its markers), more than model.max_sequence_length="
                f"{length} (r3.policy.bagel.max_sequence_length under R3, where the system prompt and plan count "
                "too); raise it or shorten the prompt"
            )
        ids = torch.full((len(rows), length), end, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = True
        return ids.to(self.device), mask.to(self.device)

    # -- sampling geometry --------------------------------------------------------------------
    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """x_1 ~ N(0, I), fp32 (n, C, h, w); one generator per sample or one for all."""
        return standard_normal(n, (self.config.vae.z_channels, *self.latent_hw), generator, self.device)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """(T+1,) sigmas: ``linspace(1, 0, T + 1)`` through the static shift ``model.shift``."""
        grid = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        return shift_sigmas(grid, self.cfg.shift).to(self.device)

    # -- the one network call -----------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """dx/dσ at (x, σ) for x (B, C, h, w) fp32 and sigma 0-d or (B,), CFG folded in; fp32 (B, C, h, w).
        A ``cond`` with source images (``encode(prompts, images)``) edits them."""
        batch = x.shape[0]
        t = sigma.float().reshape(-1).expand(batch).to(self.device)
        if editing.SOURCE_TOKENS_KEY in cond.tensors:
            return self._edit_velocity(x, t, cond)
        ids, mask = cond.tensors["text_ids"], cond.tensors["text_mask"]
        low, high = GENERATION.cfg_interval
        guided = (t > low) & (t <= high)
        if self.guidance_scale <= 1.0 or not bool(guided.any()):
            return self._forward(x, t, ids, mask)
        neg, neg_mask = cond.tensors["neg_text_ids"], cond.tensors["neg_text_mask"]
        if not uncond_takes_grad():  # a separate no-grad unconditional pass (see SD3Policy.velocity)
            with torch.no_grad():
                uncond = self._forward(x, t, neg, neg_mask)
            cond_v = self._forward(x, t, ids, mask)
        else:
            pair = self._forward(
                torch.cat([x, x]), torch.cat([t, t]), torch.cat([ids, neg]), torch.cat([mask, neg_mask])
            )
            cond_v, uncond = pair.chunk(2)
        out = renormed_guidance(uncond, cond_v, self.guidance_scale, GENERATION.cfg_renorm_min)
        return torch.where(guided[:, None, None, None], out, cond_v)

    def _forward(self, x: Tensor, t: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
        """One network pass in the model dtype; fp32 (B, C, h, w) out."""
        p = self.config.latent_patch_size
        c, h, w = x.shape[1:]
        tokens = patchify_latents(x, p).to(self.dtype)
        markers = (self.markers["<|vision_start|>"], self.markers["<|vision_end|>"])
        with autocast(self.device, self.dtype):
            out = self.trainable.forward_module()(
                Bagel.generation_velocity, ids, mask, markers, tokens, t, (h // p, w // p)
            )
        return unpatchify_latents(out.float(), c, h, w, p)

    def _edit_velocity(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """The editing velocity: the full context, and in the CFG interval the branches without the
        instruction and (image guidance > 1) without the image, combined by :func:`editing.edit_guidance`."""
        p = self.config.latent_patch_size
        c, h, w = x.shape[1:]
        tokens = patchify_latents(x, p)
        low, high = EDITING.cfg_interval
        guided = (t > low) & (t <= high)
        text, mask = cond.tensors["text_ids"], cond.tensors["text_mask"]
        if self.guidance_scale <= 1.0 or not bool(guided.any()):
            return unpatchify_latents(self._edit_tokens(tokens, t, cond, text, mask), c, h, w, p)
        neg, neg_mask = cond.tensors["neg_text_ids"], cond.tensors["neg_text_mask"]
        image_uncond = None
        if not uncond_takes_grad():  # unconditional branches without a graph (see SD3Policy.velocity)
            with torch.no_grad():
                text_uncond = self._edit_tokens(tokens, t, cond, neg, neg_mask)
                if self.image_guidance_scale > 1.0:
                    image_uncond = self._text_only_tokens(tokens, t, text, mask)
            cond_v = self._edit_tokens(tokens, t, cond, text, mask)
        else:
            pair = self._edit_tokens(
                torch.cat([tokens, tokens]),
                torch.cat([t, t]),
                Cond.cat([cond, cond]),
                torch.cat([text, neg]),
                torch.cat([mask, neg_mask]),
            )
            cond_v, text_uncond = pair.chunk(2)
            if self.image_guidance_scale > 1.0:
                image_uncond = self._text_only_tokens(tokens, t, text, mask)
        out = editing.edit_guidance(
            cond_v, text_uncond, image_uncond, self.guidance_scale, self.image_guidance_scale
        )
        out = torch.where(guided[:, None, None], out, cond_v)
        return unpatchify_latents(out, c, h, w, p)

    def _edit_tokens(self, tokens: Tensor, t: Tensor, cond: Cond, ids: Tensor, mask: Tensor) -> Tensor:
        """One pass with the source image and the text ``ids`` / ``mask`` as context; fp32 velocity tokens."""
        p = self.config.latent_patch_size
        source = cond.tensors[editing.SOURCE_TOKENS_KEY]
        source_grid = (source.shape[-2] // p, source.shape[-1] // p)
        with autocast(self.device, self.dtype):
            out = self.trainable.forward_module()(
                editing.edit_velocity,
                self._vision_markers(),
                patchify_latents(source, p).to(self.dtype),
                source_grid,
                cond.tensors[editing.VIT_PATCHES_KEY],
                cond.extras[editing.VIT_GRID_KEY],
                ids,
                mask,
                tokens.to(self.dtype),
                t,
                self._patch_grid(),
            )
        return out.float()

    def _text_only_tokens(self, tokens: Tensor, t: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
        """One pass with the text alone as context (the image-CFG branch); fp32 velocity tokens."""
        with autocast(self.device, self.dtype):
            out = self.trainable.forward_module()(
                Bagel.generation_velocity,
                ids,
                mask,
                self._vision_markers(),
                tokens.to(self.dtype),
                t,
                self._patch_grid(),
            )
        return out.float()

    def _patch_grid(self) -> tuple[int, int]:
        """The generated image's grid of latent patches (h, w)."""
        p = self.config.latent_patch_size
        return self.latent_hw[0] // p, self.latent_hw[1] // p

    def _vision_markers(self) -> tuple[int, int]:
        return self.markers["<|vision_start|>"], self.markers["<|vision_end|>"]

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """Latents (B, C, h, w) → images (B, 3, H, W) in [0, 1], fp32."""
        return bagel_vae.decode(self.vae, x0)


def build(cfg: ModelConfig, device: torch.device) -> BagelPolicy:
    """The registry's entry point: the tiny BAGEL when ``cfg.tiny``, else the checkpoint at ``model.path``."""
    dtype = frozen_dtype(cfg)  # the network holds the text model too: all of it frozen under LoRA
    if cfg.tiny:
        from rlgen_cli.models.bagel.tiny import tiny_bagel

        network, vae, tokenizer, markers = tiny_bagel(cfg.tiny_seed)
        cast_as_loaded(network, dtype)
    else:
        network, vae, tokenizer, markers = load_checkpoint(Path(cfg.path), dtype)
    return BagelPolicy(network, vae, tokenizer, markers, cfg, device)
