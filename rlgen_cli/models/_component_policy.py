"""The adapter half of the families whose model lives in a shared component (``FluxModel``, ``Flux2Model``,
``QwenModel``): the component holds the geometry, the transformer call and the VAE, the adapter adds the
family's conditioning. :class:`ComponentPolicy` is that adapter minus ``encode``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from rlgen_cli.errors import UserError
from rlgen_cli.models.base import Capabilities, Cond
from rlgen_cli.schema.run import ModelConfig


class ComponentPolicy:
    """A flow policy over ``self.model``, a component built as ``component(pipeline, cfg, device,
    pipeline_class=...)``; ``velocity`` hands it the guidance scale and :meth:`context` (extra tokens).

    Class attributes a family sets: ``family``, ``component``, ``pipeline_class`` (the diffusers pipeline
    whose ``load_lora_weights`` reads the checkpoints), ``edits`` (``encode`` needs source images) and
    ``true_cfg`` (a negative branch when guidance > 1; else guidance is embedded or off)."""

    family: ClassVar[str]
    component: ClassVar[type]
    pipeline_class: ClassVar[str]
    edits: ClassVar[bool] = False
    true_cfg: ClassVar[bool] = False

    def __init__(self, pipeline: Any, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.guidance_scale = cfg.guidance_scale
        self.model = self.component(pipeline, cfg, device, pipeline_class=self.pipeline_class)
        self.pipeline = pipeline
        self.trainable = self.model.trainable
        has_cfg = self.true_cfg and cfg.guidance_scale > 1.0
        self.capabilities = Capabilities(takes_source_images=self.edits, has_cfg=has_cfg)

    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    def noise(self, n: int, generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Tensor:
        return self.model.noise(n, generator)

    def schedule(self, num_steps: int, x: Tensor) -> Tensor:
        """The target tokens' schedule (μ counts target tokens only, as the pipelines do)."""
        return self.model.schedule(num_steps, x)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """The target tokens' velocity; the :meth:`context` tokens, if any, are appended to the sequence."""
        return self.model.velocity(x, sigma, cond, self.guidance_scale, context=self.context(cond))

    def context(self, cond: Cond) -> Any:
        """Extra tokens after the target tokens (an editing family's source), None for text-only ones."""
        return None

    def decode(self, x0: Tensor) -> Tensor:
        return self.model.decode(x0)


def check_sources(images: Tensor | None, prompts: int, missing: str) -> Tensor:
    """One (3, H, W) source image per prompt, as a (B, 3, H, W) batch; ``missing`` says what to give when
    there are none."""
    if images is None:
        raise UserError(missing)
    if images.ndim != 4 or images.shape[0] != prompts or images.shape[1] != 3:
        raise UserError(
            f"source images must be (B, 3, H, W) with B = {prompts} prompts, got {tuple(images.shape)}"
        )
    return images
