"""Tiny BAGEL: rlgen's own MoT network and diffusers' ``AutoencoderKL`` at the :data:`TINY_BAGEL` sizes,
random weights deterministic in ``seed``, and the offline byte-level Qwen tokenizer (which has the
prompt and image marker tokens BAGEL uses)."""

from __future__ import annotations

from typing import Any

import torch

from rlgen_cli.models.bagel.config import TINY_BAGEL
from rlgen_cli.models.bagel.loading import MARKER_TOKENS
from rlgen_cli.models.bagel.modeling import Bagel
from rlgen_cli.models.bagel.vae import build_vae
from rlgen_cli.models.tiny.vlm import tiny_qwen_tokenizer


def tiny_bagel(seed: int = 0) -> tuple[Bagel, Any, Any, dict[str, int]]:
    """Network, autoencoder, tokenizer and marker ids of a tiny BAGEL, deterministic in ``seed``.

    Weights are drawn at a scale where a 2-layer network's output depends visibly on every part (the
    default initialisation would leave ``llm2vae`` near zero): normal(0, 0.2) for matrices, norms at 1.
    """
    tokenizer = tiny_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Bagel(TINY_BAGEL)
        for name, param in model.named_parameters():
            if param.dim() == 2 and "pos_embed" not in name:
                torch.nn.init.normal_(param, std=0.2)
        torch.manual_seed(seed + 1)
        vae = build_vae(TINY_BAGEL.vae)
    markers = {token: tokenizer.convert_tokens_to_ids(token) for token in MARKER_TOKENS}
    return model.eval(), vae.eval(), tokenizer, markers
