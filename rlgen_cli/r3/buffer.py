"""The stage-1 buffer of Tree-RL: images of the reason stage that the refine stage starts from.

Every reason step adds the images of *all* ranks (gathered), so every rank holds the same buffer and a
policy group draws the same entry on each of its ranks without talking: the draw is a pure function of
(seed, step, group). A draw is perfect with probability ``perfect_ratio`` (docs/maths.md §9.4: 15 % perfect,
85 % imperfect); when the wanted kind is absent the other kind is drawn and the miss is counted, so a
model that never draws a perfect image still trains its refine stage. Images are kept as uint8 (what a
PNG holds) and the newest ``capacity`` entries survive; the whole buffer travels in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlgen_cli.sde.noise import Stream, stream_seed

__all__ = ["Draw", "StageOneBuffer"]


@dataclass(frozen=True)
class Draw:
    """One drawn entry: the dataset index of its prompt, the image (1, 3, H, W) in [0, 1], its reward."""

    index: int
    image: Tensor
    score: float
    perfect: bool
    wanted_perfect: bool

    @property
    def missed(self) -> bool:
        """The wanted kind (perfect or not) was absent from the buffer."""
        return self.perfect != self.wanted_perfect


class StageOneBuffer:
    """Newest-first store of (dataset index, uint8 image, score, perfect) shared by all ranks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.indices = torch.zeros(0, dtype=torch.long)
        self.images = torch.zeros(0, dtype=torch.uint8)  # (M, 3, H, W)
        self.scores = torch.zeros(0)
        self.perfect = torch.zeros(0, dtype=torch.bool)

    def __len__(self) -> int:
        return int(self.indices.numel())

    def add(self, indices: Tensor, images: Tensor, scores: Tensor, perfect: Tensor) -> None:
        """Append (N,) indices, (N, 3, H, W) images in [0, 1], (N,) scores and perfect flags; keep the newest."""
        pixels = (images.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
        keep = slice(-self.capacity, None)
        self.images = (torch.cat([self.images, pixels]) if len(self) else pixels)[keep]
        self.indices = torch.cat([self.indices, indices.long().cpu()])[keep]
        self.scores = torch.cat([self.scores, scores.float().cpu()])[keep]
        self.perfect = torch.cat([self.perfect, perfect.bool().cpu()])[keep]

    def draw(self, seed: int, step: int, group: int, perfect_ratio: float) -> Draw:
        """The entry policy group ``group`` refines at ``step`` (the same on every rank).

        Raises:
            RuntimeError: When the buffer is empty (a refine step ran before any reason step).
        """
        if not len(self):
            raise RuntimeError("the stage-1 buffer is empty: a refine step needs a reason step before it")
        generator = torch.Generator().manual_seed(stream_seed(seed, step, group, salt=Stream.R3_BUFFER))
        wanted = bool(torch.rand((), generator=generator) < perfect_ratio)
        pool = (self.perfect == wanted).nonzero().squeeze(1)
        if not pool.numel():
            pool = torch.arange(len(self))
        pick = int(pool[torch.randint(pool.numel(), (), generator=generator)])
        return Draw(
            index=int(self.indices[pick]),
            image=self.images[pick : pick + 1].float() / 255,
            score=float(self.scores[pick]),
            perfect=bool(self.perfect[pick]),
            wanted_perfect=wanted,
        )

    def state_dict(self) -> dict[str, Tensor]:
        return {
            "indices": self.indices,
            "images": self.images,
            "scores": self.scores,
            "perfect": self.perfect,
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.indices, self.images = state["indices"], state["images"]
        self.scores, self.perfect = state["scores"], state["perfect"]
