"""Tiny BAGEL's in-process pieces: the offline byte-level Qwen tokenizer (it has the prompt and image marker
tokens BAGEL uses) and the random initialisation of the tiny network. The network itself is rlgen's own
(``models/bagel``), assembled by ``rlgen_cli.models.bagel.tiny.tiny_bagel`` (tiny/ sits below the
families and imports none of them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlgen_cli.models.tiny.vlm import tiny_qwen_tokenizer

TINY_BAGEL_INIT_STD = 0.2
"""Std of every weight matrix: large enough that a 2-layer network's output depends visibly on every part
(the default initialisation leaves ``llm2vae`` near zero)."""


def tiny_bagel_tokenizer() -> Any:
    """The byte-level ``Qwen2Tokenizer`` (263 ids: 256 byte symbols + the Qwen special tokens)."""
    return tiny_qwen_tokenizer()


def randomize_tiny_bagel(network: nn.Module, seed: int) -> None:
    """Draw every weight matrix of ``network`` from N(0, 0.2²) in a private RNG stream of ``seed``; norms and
    biases (vectors) keep their values, the sin-cos position tables are buffers."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in network.parameters():
            if param.dim() == 2:
                param.normal_(0, TINY_BAGEL_INIT_STD, generator=generator)
