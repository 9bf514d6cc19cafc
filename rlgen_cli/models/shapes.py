"""The ShapesEval text-to-image model (:class:`~rlgen_cli.models.shapes_unet.ShapesUNet`) behind the
flow-policy protocol.

Pixel space: the "latents" are the RGB image scaled to [-1, 1], so ``decode`` is an affine map and
:meth:`ShapesPolicy.encode_images` (used by flow-matching pretraining) its inverse. Prompts are read by
a closed word-level tokenizer over the ShapesEval vocabulary: no download, no randomness.

* ``model=shapes_base`` loads the pretrained weights shipped in ``rlgen_cli/assets/models/shapes_base``
  (reproduce them with ``scripts/pretrain_shapes.sh``);
* ``model=shapes_unet`` builds the same network with random weights (the start of pretraining).

Full fine-tuning is the default (the model is small); ``model.lora.enabled=true`` attaches a peft LoRA
to the attention projections instead. ``model.dtype`` other than float32 runs the forward under
autocast with fp32 trained weights, as every family does (docs/precision.md); the shipped recipe is fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import (
    TORCH_DTYPES,
    Capabilities,
    Cond,
    cfg_combine,
    uncond_takes_grad,
)
from rlgen_cli.models.prompt_cache import cache_prompt_embeddings
from rlgen_cli.models.shapes_unet import ShapesUNet
from rlgen_cli.models.tiny import tiny_shapes_unet
from rlgen_cli.models.trainable import (
    LORA_WEIGHTS_NAME,
    TRANSFORMER_DIR,
    TrainableTransformer,
    autocast,
    load_lora_state,
)
from rlgen_cli.schema.run import ModelConfig
from rlgen_cli.sde.noise import standard_normal
from rlgen_cli.sde.schedule import sd3_sigmas
from rlgen_cli.shapes.vocab import COLORS, COUNT_WORDS, SHAPES, plural

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
MODEL_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "models"

SPECIAL_TOKENS = ("<pad>", "<bos>", "<unk>")
PAD_ID, BOS_ID, UNK_ID = range(3)
WORDS: tuple[str, ...] = (
    *SPECIAL_TOKENS, "a", "an", "the", "photo", "of", "and", "left", "right", "above", "below", "one",
    *COUNT_WORDS.values(), *COLORS, *SHAPES, *(plural(s) for s in SHAPES),
)  # fmt: skip
"""Token id → word. Append only: the shipped weights index this table."""

MEMORY_FORMAT = torch.channels_last
"""The UNet's weights and inputs are stored channels-last: the layout oneDNN's (and cuDNN's) fastest
convolutions use. Measured on 2 CPU cores, an epoch of the default ShapesEval run is 10 % faster (4.9 →
4.4 s: update 2.2 → 1.9 s, rollout 2.6 → 2.4 s); velocities move by ~1e-6 against the default layout."""


class WordTokenizer:
    """Lower-cased whitespace words → ids, with ``<bos>`` first; the empty prompt is ``<bos>`` alone
    (the unconditional branch), so attention always has a key to attend to."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.ids = {word: i for i, word in enumerate(WORDS)}

    def __call__(self, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """``(input_ids, attention_mask)``, both (B, max_tokens)."""
        ids = torch.full((len(prompts), self.max_tokens), PAD_ID, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = [BOS_ID] + [self.ids.get(w, UNK_ID) for w in prompt.lower().replace(",", " ").split()]
            if len(words) > self.max_tokens:
                raise UserError(
                    f"prompt {prompt!r} has {len(words) - 1} words; the shapes model reads at most "
                    f"{self.max_tokens - 1}"
                )
            ids[row, : len(words)] = torch.tensor(words)
        return ids, ids != PAD_ID


def resolve_model_dir(spec: str) -> Path:
    """``builtin:shapes_base`` → the packaged weights; anything else → that directory (must exist)."""
    if spec.startswith(BUILTIN_PREFIX):
        path = MODEL_ASSETS / spec[len(BUILTIN_PREFIX) :]
    else:
        path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(
            f"model.path={spec!r}: {path} holds no saved ShapesUNet (config.json missing); "
            "pass a directory written by save_pretrained or builtin:shapes_base"
        )
    return path


class ShapesPolicy:
    """The ShapesEval UNet behind the flow-policy protocol (see ``models/base.py``)."""

    family = "shapes"

    def __init__(self, unet: ShapesUNet, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.dtype]  # the forward's autocast dtype; trained weights stay fp32
        self.guidance_scale = cfg.guidance_scale
        self.capabilities = Capabilities(has_cfg=cfg.guidance_scale > 1.0, encodes_images=True)
        self.tokenizer = WordTokenizer(unet.config.max_tokens)
        # TrainableTransformer only needs an owner with a ``transformer`` attribute; the checkpoint
        # format is this module's, not a diffusers pipeline's.
        self._holder = SimpleNamespace(transformer=unet.to(device, memory_format=MEMORY_FORMAT))
        self.trainable = TrainableTransformer(self._holder, cfg, checkpoint=ShapesCheckpoint())

    @property
    def unet(self) -> nn.Module:
        return self._holder.transformer

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Token ids and masks (+ the empty prompt's when guidance > 1)."""
        ids, mask = self.tokenizer(prompts)
        tensors = {"input_ids": ids, "attention_mask": mask}
        if self.guidance_scale > 1.0:
            neg_ids, neg_mask = self.tokenizer([""] * len(prompts))
            tensors |= {"neg_input_ids": neg_ids, "neg_attention_mask": neg_mask}
        return Cond({k: v.to(self.device) for k, v in tensors.items()})

    # -- sampling geometry --------------------------------------------------------------------
    def image_shape(self) -> tuple[int, int, int]:
        height, width = self.cfg.height or self.cfg.resolution, self.cfg.width or self.cfg.resolution
        if height % 4 or width % 4:
            raise UserError(f"the shapes model needs image sides divisible by 4, got {height}×{width}")
        return (3, height, width)

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        """x_1 ~ N(0, I), (n, 3, H, W); one generator per sample or one for all."""
        return standard_normal(n, self.image_shape(), generator, self.device)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """Shifted sigmas (SD3 rule), (T+1,) ending at 0."""
        return sd3_sigmas(num_steps, shift=self.cfg.shift).to(self.device)

    # -- the one network call -----------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """v(x, σ) with CFG folded in; x (B, 3, H, W), sigma scalar or (B,)."""
        batch = x.shape[0]
        timestep = (sigma.float().reshape(-1).expand(batch) * 1000.0).to(self.device)
        ids, mask = cond.tensors["input_ids"], cond.tensors["attention_mask"]
        if self.guidance_scale <= 1.0:
            return self._forward(x, timestep, ids, mask)
        neg_ids, neg_mask = cond.tensors["neg_input_ids"], cond.tensors["neg_attention_mask"]
        if not uncond_takes_grad():  # a separate no-grad unconditional pass (see SD3Policy.velocity)
            with torch.no_grad():
                uncond = self._forward(x, timestep, neg_ids, neg_mask)
            return cfg_combine(uncond, self._forward(x, timestep, ids, mask), self.guidance_scale)
        out = self._forward(
            torch.cat([x, x]),
            torch.cat([timestep, timestep]),
            torch.cat([neg_ids, ids]),
            torch.cat([neg_mask, mask]),
        )
        uncond, cond_v = out.chunk(2)
        return cfg_combine(uncond, cond_v, self.guidance_scale)

    def _forward(self, x: Tensor, timestep: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
        with autocast(self.device, self.dtype):
            x = x.contiguous(memory_format=MEMORY_FORMAT)
            return self.trainable.forward_module()(x, timestep, ids, mask).float()

    @torch.no_grad()
    def decode(self, x0: Tensor) -> Tensor:
        """[-1, 1] pixels → images in [0, 1]."""
        return (x0.float() / 2 + 0.5).clamp(0, 1)

    def encode_images(self, images: Tensor) -> Tensor:
        """Images in [0, 1] → the model's x_0 (the inverse of :meth:`decode`)."""
        return images.to(self.device, torch.float32) * 2 - 1


class ShapesCheckpoint:
    """The shapes model's checkpoint format: full weights → ``transformer/`` (``save_pretrained``), LoRA →
    ``pytorch_lora_weights.safetensors`` (the bare peft state; no diffusers pipeline reads it)."""

    def save(self, module: nn.Module, directory: Path, lora: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        if not lora:
            module.save_pretrained(directory / TRANSFORMER_DIR)
            return
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(module).items()}
        save_file(state, directory / LORA_WEIGHTS_NAME)

    def load(self, module: nn.Module, directory: Path, lora: bool) -> None:
        """Load what :meth:`save` wrote (the architecture must match)."""
        if lora:
            from safetensors.torch import load_file

            path = directory / LORA_WEIGHTS_NAME
            if not path.is_file():
                raise UserError(f"{path} is missing: the checkpoint holds no LoRA weights")
            load_lora_state(module, load_file(path), path)
            return
        source = directory / TRANSFORMER_DIR
        if not (source / "config.json").is_file():
            raise UserError(f"{source} is missing: the checkpoint holds no full shapes-model weights")
        loaded = ShapesUNet.from_pretrained(source)
        try:
            module.load_state_dict(loaded.state_dict())
        except RuntimeError as err:
            raise UserError(f"{source} holds a ShapesUNet of another architecture than model.path's") from err


def build_unet(cfg: ModelConfig) -> ShapesUNet:
    """Random weights seeded by ``model.tiny_seed`` when ``model.tiny``, else the saved model at ``path``."""
    if cfg.tiny:
        return tiny_shapes_unet(cfg.tiny_seed)
    source = resolve_model_dir(str(cfg.path))
    try:
        return ShapesUNet.from_pretrained(source)
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(f"could not load the shapes model from {source}: {err}") from err


def build(cfg: ModelConfig, device: torch.device) -> ShapesPolicy:
    """The registry's entry point."""
    policy = ShapesPolicy(build_unet(cfg), cfg, device)
    cache_prompt_embeddings(policy, cfg.prompt_cache_mb, encoders=())  # encode only tokenizes
    return policy
