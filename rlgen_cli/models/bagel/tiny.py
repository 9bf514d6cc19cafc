"""The tiny BAGEL, built in-process: rlgen's network and diffusers' ``AutoencoderKL`` at the
:data:`~rlgen_cli.models.bagel.config.TINY_BAGEL` sizes, random weights deterministic in ``seed``, the
offline tokenizer of ``models/tiny/bagel.py``."""

from __future__ import annotations

from typing import Any

import torch

from rlgen_cli.models.bagel.config import TINY_BAGEL
from rlgen_cli.models.bagel.loading import MARKER_TOKENS
from rlgen_cli.models.bagel.modeling import Bagel
from rlgen_cli.models.bagel.vae import build_vae
from rlgen_cli.models.tiny.bagel import randomize_tiny_bagel, tiny_bagel_tokenizer


def tiny_bagel(seed: int = 0) -> tuple[Bagel, Any, Any, dict[str, int]]:
    """Network, autoencoder, tokenizer and marker ids of a tiny BAGEL, deterministic in ``seed``."""
    tokenizer = tiny_bagel_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = Bagel(TINY_BAGEL)
        torch.manual_seed(seed + 1)
        vae = build_vae(TINY_BAGEL.vae)
    randomize_tiny_bagel(network, seed)
    markers = {token: tokenizer.convert_tokens_to_ids(token) for token in MARKER_TOKENS}
    return network.eval(), vae.eval(), tokenizer, markers
