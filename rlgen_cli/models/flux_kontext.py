"""FLUX.1-Kontext-dev behind the flow-policy protocol (instruction-based image editing).

Model: Labs et al. 2025, "FLUX.1 Kontext: Flow Matching for In-Context Image Generation and Editing in
Latent Space". The source image is VAE-encoded (distribution mode, then shift and scale as diffusers'
``FluxKontextPipeline._encode_vae_image``), packed into tokens and appended after the noisy target
tokens; its RoPE ids are (1, row, col) where the target's are (0, row, col). The transformer sees the
whole sequence, ``velocity`` returns the target tokens' prediction only, and the dynamic shift μ counts
target tokens only — as the pipeline does. Guidance is embedded (2.5 upstream), with no CFG branch.

The source is encoded at the size it is given (the recipe resizes it to the model's resolution);
diffusers' optional auto-resize to Kontext's preferred ≈ 1 MP resolutions is not applied, so the
sequence is twice the target's length.

Flow-GRPO settings (``counting_flux_kontext``): 6 / 28 steps, 512 px, LoRA r 64 / α 128
on FLUX's attention and feed-forward targets plus the single blocks' ``proj_mlp``
(:data:`KONTEXT_LORA_TARGETS`), noise level 0.9, bf16 (precision notes: ``models/_flux_common.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models._flux_common import FLUX_LORA_TARGETS, LORA_WEIGHTS_NAME, FluxModel
from rlgen_cli.models.base import Capabilities, Cond
from rlgen_cli.models.loading import in_model_dtype, load_pipeline
from rlgen_cli.models.prompt_cache import cache_prompt_embeddings
from rlgen_cli.models.real_size import flow_pipeline
from rlgen_cli.models.tiny import tiny_flux_kontext_pipeline
from rlgen_cli.schema.run import ModelConfig

__all__ = [
    "KONTEXT_LORA_TARGETS",
    "LORA_WEIGHTS_NAME",
    "FluxKontextPolicy",
    "build",
    "load_flux_kontext_pipeline",
]

KONTEXT_LORA_TARGETS = [*FLUX_LORA_TARGETS, "proj_mlp"]
"""Flow-GRPO's FLUX.1-Kontext LoRA targets: FLUX's plus the single-stream blocks' ``proj_mlp``."""

SOURCE_INDEX = 1
"""First RoPE id axis of source-image tokens (target tokens use 0)."""


def load_flux_kontext_pipeline(cfg: ModelConfig) -> Any:
    """Load a real FLUX.1-Kontext pipeline from ``cfg.path`` (hub id or local directory) in ``cfg.dtype``."""
    from diffusers import FluxKontextPipeline

    return load_pipeline(FluxKontextPipeline, cfg, "FLUX.1-Kontext")


class FluxKontextPolicy:
    """FLUX.1-Kontext (see the module docstring); ``encode`` needs the source images."""

    family = "flux_kontext"

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.guidance_scale = cfg.guidance_scale
        self.flux = FluxModel(pipeline, cfg, device, pipeline_class="FluxKontextPipeline")
        self.pipeline = pipeline
        self.trainable = self.flux.trainable
        self.capabilities = Capabilities(takes_source_images=True)

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def encode(self, prompts: Sequence[str], images: Tensor | None = None) -> Cond:
        """Text conditioning plus the packed source latents (B, L', D) and their ids (B, L', 3).

        Args:
            prompts: The edit instructions, one per sample.
            images: Source images (B, 3, H, W) in [0, 1], H and W multiples of 2·vae_scale_factor.

        Raises:
            UserError: If the images are missing or do not match the prompts.
        """
        if images is None:
            raise UserError(
                "FLUX.1-Kontext is an editing model: encode needs source images (B, 3, H, W) in [0, 1]; give "
                'every dataset line an "image" path (jsonl lines like {"prompt": ..., "image": "src/0.png"})'
            )
        if images.dim() != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            raise UserError(
                f"source images must be (B, 3, H, W) with B = {len(prompts)} prompts, got {tuple(images.shape)}"
            )
        tensors = self.flux.encode_text(prompts)
        tokens, ids = self.flux.encode_image(images, index=SOURCE_INDEX)
        tensors["source_latents"] = tokens
        tensors["source_ids"] = ids.expand(len(prompts), -1, -1)
        return Cond(tensors)

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        return self.flux.noise(n, generator)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """The target tokens' schedule: μ counts target tokens only, as the pipeline does."""
        return self.flux.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The target tokens' velocity, with the source tokens appended to the transformer's sequence."""
        source = (cond.tensors["source_latents"], cond.tensors["source_ids"][0])
        return self.flux.velocity(x, sigma, cond, self.guidance_scale, context=source)

    def decode(self, x0: Tensor) -> Tensor:
        return self.flux.decode(x0)


def build(cfg: ModelConfig, device: torch.device) -> FluxKontextPolicy:
    """The registry's entry point: the tiny pipeline when ``cfg.tiny``, the published architecture at random
    init when ``cfg.weights`` is ``random_init`` (``models/real_size.py``), else the loaded one."""
    if cfg.weights == "random_init":
        pipeline = in_model_dtype(flow_pipeline(cfg, device), cfg)
    elif cfg.tiny:
        pipeline = in_model_dtype(tiny_flux_kontext_pipeline(cfg.tiny_seed), cfg)
    else:
        pipeline = load_flux_kontext_pipeline(cfg)
    policy = FluxKontextPolicy(pipeline, cfg, device)
    cache_prompt_embeddings(
        policy, cfg.prompt_cache_mb, (pipeline.text_encoder, pipeline.text_encoder_2)
    )  # a batch seen before is reused
    return policy
