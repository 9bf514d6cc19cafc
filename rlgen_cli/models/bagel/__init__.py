"""BAGEL (ByteDance-Seed): one Mixture-of-Transformers model that reads, writes and draws.

``config`` (sizes of BAGEL-7B-MoT and the tiny model), ``modeling`` (the MoT language model and the
generation / understanding glue), ``vit`` (SigLIP over flattened patches), ``vae`` (the FLUX autoencoder
as diffusers' ``AutoencoderKL``), ``loading`` (the release's checkpoint layout) and ``policy`` (the
flow-policy adapter; ``build`` is the registry's entry point). docs/bagel.md says what runs.
"""

from __future__ import annotations

from rlgen_cli.models.bagel.policy import build

__all__ = ["build"]
