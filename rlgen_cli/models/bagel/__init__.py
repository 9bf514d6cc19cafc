"""BAGEL (ByteDance-Seed): one Mixture-of-Transformers model that reads, writes and draws.

``config`` (sizes of BAGEL-7B-MoT and the tiny model), ``modeling`` (the MoT language model and the
generation / understanding glue), ``vit`` (SigLIP over flattened patches), ``vae`` (the FLUX autoencoder
as diffusers' ``AutoencoderKL``), ``loading`` (the release's checkpoint layout) and ``policy`` (the
flow-policy adapter). :func:`build` is the registry's entry point. docs/bagel.md says what runs.
"""

from __future__ import annotations

from typing import Any

import torch


def build(cfg: Any, device: torch.device) -> Any:
    """The tiny BAGEL (``model.tiny``), BAGEL-7B-MoT's architecture at random init
    (``model.weights=random_init``: ``loading.random_init_checkpoint``) or the checkpoint at ``model.path``."""
    from rlgen_cli.models.bagel import policy

    if cfg.weights == "random_init":
        from rlgen_cli.models.bagel.loading import random_init_checkpoint

        return policy.BagelPolicy(*random_init_checkpoint(cfg, device), cfg, device)
    return policy.build(cfg, device)


__all__ = ["build"]
