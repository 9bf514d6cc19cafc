"""masked_log_softmax_gather: the sampled tokens' log-probs under a vocabulary mask, however the rows are
chunked (a real vocabulary takes one row at a time, a tiny one the whole batch)."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.vlm import rollout

B, L, V = 5, 3, 7
SUPPRESSED = [2, 5]


def _by_hand(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log(exp(x_id) / Σ_{v not suppressed} exp(x_v)), one token at a time in float64."""
    out = torch.empty(B, L, dtype=torch.float64)
    for b in range(B):
        for t in range(L):
            kept = [float(logits[b, t, v]) for v in range(V) if v not in SUPPRESSED]
            out[b, t] = float(logits[b, t, ids[b, t]]) - math.log(sum(math.exp(x) for x in kept))
    return out


@pytest.mark.parametrize("rows_per_chunk", [1, 2, B])  # 2: an uneven last chunk
def test_each_chunking_gives_the_log_probs_computed_by_hand(monkeypatch, rows_per_chunk: int):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(B, L, V, generator=generator, dtype=torch.float16)  # converted to float32 inside
    ids = torch.tensor([[0, 1, 3], [4, 6, 0], [1, 1, 1], [3, 4, 6], [6, 0, 3]])
    monkeypatch.setattr(rollout, "CHUNK_BYTES", rows_per_chunk * L * V * 4)
    got = rollout.masked_log_softmax_gather(logits, ids, SUPPRESSED)
    assert got.shape == (B, L) and got.dtype == torch.float32
    # float32 log-softmax of |x| ≲ 4 over 5 terms: a few float32 steps of the result's size
    tolerance = 16 * torch.finfo(torch.float32).eps * float(got.abs().max())
    assert torch.allclose(got.double(), _by_hand(logits, ids), rtol=0, atol=tolerance)


def test_a_suppressed_token_has_no_probability():
    logits = torch.zeros(1, 1, V)
    assert rollout.masked_log_softmax_gather(logits, torch.tensor([[5]]), SUPPRESSED).item() == float("-inf")
    assert rollout.masked_log_softmax_gather(logits, torch.tensor([[0]]), SUPPRESSED).item() == pytest.approx(
        -math.log(V - len(SUPPRESSED))
    )
