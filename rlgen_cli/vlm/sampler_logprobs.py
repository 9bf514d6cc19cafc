"""The sampled tokens' log-probs under ``generate``'s raw logits, recorded one step at a time.

``generate(output_logits=True)`` keeps a float32 copy of every step's logits until it returns: B × L × V
floats, ~10 GB for R1-VL's 16 completions of 1024 tokens over Qwen's 151 936-token vocabulary, on the
device, during the rollout. :class:`SamplerLogprobs` keeps one step instead. A forward hook on the output
head holds the step's last-position logits (what ``generate`` copies for its logits processors: raw, before
temperature, top-k / top-p and suppression); ``generate`` calls its stopping criteria right after it
appends the step's token to the sequences, and this criterion, which never stops anything, reads that
token's log-prob — at temperature 1 with the vision tokens out of the softmax, the training path's
quantity — and drops the logits.

A step the hook did not see, or fewer steps than tokens, is an error, never a silent shift: both would
mean a model whose forward does not end in its output head (the Qwen-VL families all do; a test compares
every tiny family with ``output_logits``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

__all__ = ["SamplerLogprobs"]


class SamplerLogprobs:
    """A stopping criterion (``generate(stopping_criteria=StoppingCriteriaList([recorder]))``, called as
    ``recorder(input_ids, scores)``) that never stops; run ``generate`` inside ``recorder.hooked(model)``,
    then :meth:`result` gives the (B, L) log-probs of the L generated tokens.

    Args:
        suppressed: Vocabulary columns left out of the softmax (the vision tokens).
    """

    def __init__(self, suppressed: Sequence[int]) -> None:
        self.suppressed = list(suppressed)
        self.pending: Tensor | None = None  # the current step's last-position logits, float32 (B, V)
        self.picked: list[Tensor] = []  # per step, (B,) the sampled tokens' masked logits
        self.normalisers: list[Tensor] = []  # per step, (B,) the masked logits' logsumexp
        self._columns: Tensor | None = None  # the suppressed columns, on the logits' device
        self._never: Tensor | None = None  # the criterion's answer, (B,) False

    @contextmanager
    def hooked(self, model: Any) -> Iterator[None]:
        """Record the output head's logits of ``model`` (a transformers model, or a peft one around it)
        while inside."""
        handle = model.get_output_embeddings().register_forward_hook(self._keep)
        try:
            yield
        finally:
            handle.remove()

    def _keep(self, module: Any, args: Any, output: Tensor) -> None:
        self.pending = output[:, -1].float()  # a view's float32 copy, or the view itself: never written to

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        if self.pending is None:
            raise RuntimeError(
                "generate appended a token without an output-head call: this model's logits do not come from "
                "get_output_embeddings(), so the sampled tokens' log-probs cannot be recorded"
            )
        logits, self.pending = self.pending, None
        if self._columns is None:  # once: a few small ops a step is this recorder's whole cost
            self._columns = torch.tensor(self.suppressed, dtype=torch.long, device=logits.device)
            self._never = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.suppressed:
            logits = logits.index_fill(-1, self._columns, float("-inf"))
        self.picked.append(logits.gather(-1, input_ids[:, -1:].to(logits.device)).squeeze(-1))
        self.normalisers.append(torch.logsumexp(logits, dim=-1))
        assert self._never is not None
        return self._never

    def result(self, length: int) -> Tensor:
        """(B, ``length``) log-probs of the generated tokens. ``generate`` may run steps past the end and
        undo them (deferred stop checks), so later steps are dropped; fewer steps is an error."""
        if len(self.picked) < length:
            raise RuntimeError(f"recorded {len(self.picked)} steps' log-probs for {length} generated tokens")
        return torch.stack(self.picked[:length], dim=1) - torch.stack(self.normalisers[:length], dim=1)
