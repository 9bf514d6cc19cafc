"""Deterministic, distributed group sampler for GRPO-style training.

Each *epoch* (one sampling round, as in Flow-GRPO) draws ``prompts_per_step`` prompts and repeats each
``group_size`` times consecutively, so one group = K samples of one prompt. Prompts are drawn from an
endless stream of per-pass permutations (pass ``p`` is ``randperm(N)`` seeded with ``seed + p``):
consecutive epochs walk the dataset without replacement and wrap to a fresh permutation, so every
prompt is used once per pass. Unlike Flow-GRPO's ``DistributedKRepeatSampler`` (a fresh random subset
every epoch), coverage is guaranteed.

The indices of an epoch are a pure function of ``(seed, epoch)``: there is no iterator state, so resume
is exact. The global batch does not depend on ``num_replicas``. How it is shared: the global batch is cut
into pieces of ``unit`` samples and piece ``b`` goes to rank ``b mod num_replicas`` (:meth:`positions`).
The default unit is a rank's whole share (rank ``r`` gets the ``r``-th contiguous slice); a recipe that
trains piece by piece deals pieces of one micro-batch, so optimizer step ``s`` covers the same global
micro-batches on any number of ranks (flow GRPO: README "process-count invariance"). When a step straddles two passes (``dataset_size`` not
divisible by ``prompts_per_step``), one prompt may appear in two groups of that step: two groups, each
normalised on its own (:meth:`group_keys`).

``prompts_per_draw`` switches to Flow-GRPO's ``DistributedKRepeatSampler``: the epoch's prompts come in
``prompts_per_step / prompts_per_draw`` draws (one per upstream sampling batch), draw ``d`` of epoch ``e``
being the first ``prompts_per_draw`` entries of ``randperm(N)`` seeded with ``seed + e·D + d`` (upstream's
``set_epoch(epoch · num_batches_per_epoch + i)``), so a prompt may come twice in one epoch and some wait.
Still a pure function of ``(seed, epoch)``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import torch

from rlgen_cli.errors import UserError

logger = logging.getLogger(__name__)

__all__ = ["GroupSampler"]

_CONFIG_KEYS = ("dataset_size", "prompts_per_step", "group_size", "seed")


@lru_cache(maxsize=8)
def _permutation(dataset_size: int, seed: int) -> tuple[int, ...]:
    """Return ``randperm(dataset_size)`` drawn from a CPU generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randperm(dataset_size, generator=generator).tolist())


def _check_positive(**values: int) -> None:
    """Raise ``ValueError`` naming the first argument that is not a positive int."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"GroupSampler {name} must be a positive integer, got {value!r}.")


def _check_draw(prompts_per_draw: int, prompts_per_step: int, dataset_size: int) -> None:
    """Raise unless ``prompts_per_draw`` divides the epoch (``ValueError``: the config checked it) and fits
    in the dataset (``UserError``: only the loaded data tells)."""
    _check_positive(prompts_per_draw=prompts_per_draw)
    if prompts_per_step % prompts_per_draw:
        raise ValueError(
            f"prompts_per_draw = {prompts_per_draw} must divide prompts_per_step = {prompts_per_step}."
        )
    if prompts_per_draw > dataset_size:
        raise UserError(
            f"algo.prompts_per_draw={prompts_per_draw} draws that many distinct prompts per sampling batch, but "
            f"data.train has {dataset_size}; set algo.prompts_per_draw to a divisor of algo.prompts_per_epoch "
            f"of at most {dataset_size}, null (passes over the dataset), or train on more prompts"
        )


def _fresh_draws(dataset_size: int, prompts: int, per_draw: int, seed: int, epoch: int) -> list[int]:
    """Flow-GRPO's prompts of ``epoch``: ``prompts / per_draw`` draws, draw d the head of a permutation
    seeded ``seed + epoch·draws + d``, as its sampler draws batch d of the epoch."""
    draws = prompts // per_draw
    out: list[int] = []
    for d in range(draws):
        generator = torch.Generator().manual_seed(seed + epoch * draws + d)
        out += torch.randperm(dataset_size, generator=generator)[:per_draw].tolist()
    return out


class GroupSampler:
    """Yields, per epoch, the dataset indices of ``prompts_per_step`` prompts × ``group_size`` samples.

    Attributes:
        dataset_size: Number of prompts N.
        prompts_per_step: Distinct groups per epoch (global, over all ranks).
        group_size: Samples per prompt K.
        seed: Base seed; pass ``p`` uses ``seed + p``.
        num_replicas: Number of ranks sharing the global batch.
        rank: This rank.
        epoch: Current epoch, set by :meth:`set_epoch` and used by ``iter``.
    """

    def __init__(
        self,
        dataset_size: int,
        prompts_per_step: int,
        group_size: int,
        *,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        prompts_per_draw: int | None = None,
    ) -> None:
        """Create the sampler.

        Args:
            dataset_size: Number of prompts N.
            prompts_per_step: Prompts (groups) per epoch over all ranks.
            group_size: Samples per prompt K.
            seed: Base seed.
            num_replicas: Number of ranks.
            rank: This rank, in ``[0, num_replicas)``.
            prompts_per_draw: None = passes without replacement; an int = Flow-GRPO's fresh draws of that
                many distinct prompts (see the module docstring).

        Raises:
            ValueError: On non-positive sizes, a rank out of range, a global batch
                ``prompts_per_step * group_size`` not divisible by ``num_replicas``, or a
                ``prompts_per_draw`` that does not divide ``prompts_per_step`` or exceeds the dataset.
        """
        _check_positive(
            dataset_size=dataset_size,
            prompts_per_step=prompts_per_step,
            group_size=group_size,
            num_replicas=num_replicas,
        )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"GroupSampler rank must be in [0, {num_replicas}), got {rank}.")
        global_batch = prompts_per_step * group_size
        if global_batch % num_replicas:
            raise ValueError(
                f"global batch prompts_per_step*group_size = {prompts_per_step}*{group_size} = "
                f"{global_batch} is not divisible by num_replicas = {num_replicas}; change "
                "prompts_per_step or group_size so every rank gets the same number of samples."
            )
        if prompts_per_draw is not None:
            _check_draw(prompts_per_draw, prompts_per_step, dataset_size)
        self.prompts_per_draw = prompts_per_draw
        self.dataset_size = dataset_size
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0

    @property
    def global_batch_size(self) -> int:
        """Samples per epoch over all ranks: ``prompts_per_step * group_size``."""
        return self.prompts_per_step * self.group_size

    @property
    def samples_per_rank(self) -> int:
        """Samples per epoch on one rank."""
        return self.global_batch_size // self.num_replicas

    def prompt_indices_for_epoch(self, epoch: int) -> list[int]:
        """Return the ``prompts_per_step`` prompt indices of ``epoch``, one per group (no repeats unless
        the epoch straddles two passes or ``prompts_per_draw`` draws afresh).

        Args:
            epoch: Non-negative epoch number.

        Returns:
            Dataset indices, positions ``epoch*P … epoch*P + P − 1`` of the permutation stream.

        Raises:
            ValueError: If ``epoch`` is negative.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}.")
        if self.prompts_per_draw is not None:
            return _fresh_draws(
                self.dataset_size, self.prompts_per_step, self.prompts_per_draw, self.seed, epoch
            )
        start = epoch * self.prompts_per_step
        out = []
        for position in range(start, start + self.prompts_per_step):
            pass_index, offset = divmod(position, self.dataset_size)
            out.append(_permutation(self.dataset_size, self.seed + pass_index)[offset])
        return out

    def global_indices_for_epoch(self, epoch: int) -> list[int]:
        """Return all ranks' indices for ``epoch``: each prompt repeated ``group_size`` times in a row.

        Args:
            epoch: Non-negative epoch number.

        Returns:
            ``prompts_per_step * group_size`` dataset indices.
        """
        return [i for i in self.prompt_indices_for_epoch(epoch) for _ in range(self.group_size)]

    def group_keys(self, positions: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Each sample's group, from its places in the epoch's global batch and its dataset indices.

        Passes (the default): the draw the sample belongs to, ``position // group_size``, so a prompt
        drawn twice in one epoch (an epoch straddling two passes) makes two groups of K, as every group
        is the K samples of one draw. Flow-GRPO's fresh draws (``prompts_per_draw``): the dataset index,
        as upstream's per-prompt statistics pool a prompt its sampler drew twice in one epoch.
        """
        if self.prompts_per_draw is not None:
            return indices
        return positions // self.group_size

    def positions(self, unit: int | None = None) -> list[int]:
        """This rank's places in an epoch's global batch, ascending: pieces of ``unit`` samples dealt
        round-robin (piece ``b`` to rank ``b mod num_replicas``).

        Args:
            unit: Samples per piece; None = ``samples_per_rank`` (one contiguous slice per rank).

        Returns:
            ``samples_per_rank`` positions in ``[0, global_batch_size)``.

        Raises:
            ValueError: If the global batch does not split into the same number of pieces on every rank.
        """
        unit = self.samples_per_rank if unit is None else unit
        _check_positive(unit=unit)
        if self.global_batch_size % (unit * self.num_replicas):
            raise ValueError(
                f"global batch {self.global_batch_size} does not split into pieces of {unit} samples dealt "
                f"evenly over {self.num_replicas} ranks; choose a unit dividing {self.samples_per_rank}."
            )
        pieces = range(self.rank, self.global_batch_size // unit, self.num_replicas)
        return [p for piece in pieces for p in range(piece * unit, (piece + 1) * unit)]

    def indices_for_epoch(self, epoch: int, unit: int | None = None) -> list[int]:
        """Return this rank's share of :meth:`global_indices_for_epoch`, at :meth:`positions`.

        Args:
            epoch: Non-negative epoch number.
            unit: See :meth:`positions` (None: a contiguous slice).

        Returns:
            ``samples_per_rank`` dataset indices.
        """
        everyone = self.global_indices_for_epoch(epoch)
        return [everyone[p] for p in self.positions(unit)]

    def batch(self, epoch: int) -> list[int]:
        """Alias of :meth:`indices_for_epoch` (this rank's indices for ``epoch``)."""
        return self.indices_for_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch that ``iter(sampler)`` yields.

        Args:
            epoch: Non-negative epoch number.

        Raises:
            ValueError: If ``epoch`` is negative.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}.")
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's indices for the current epoch once (usable as a ``batch_sampler``)."""
        yield self.indices_for_epoch(self.epoch)

    def __len__(self) -> int:
        """Return the number of batches ``iter`` yields per epoch (always 1)."""
        return 1

    def state_dict(self) -> dict[str, Any]:
        """Return the configuration and current epoch, for checkpoints."""
        state = {key: getattr(self, key) for key in _CONFIG_KEYS}
        state["prompts_per_draw"] = self.prompts_per_draw
        state["epoch"] = self.epoch
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch after checking the stored configuration matches this sampler.

        ``num_replicas`` and ``rank`` may differ: the global batch does not depend on them.

        Args:
            state: What :meth:`state_dict` returned.

        Raises:
            ValueError: If a configuration key is missing or differs.
        """
        for key in _CONFIG_KEYS:
            if key not in state:
                raise ValueError(f"sampler state has no {key!r}; it was not written by GroupSampler.")
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler {key} differs from the checkpoint ({getattr(self, key)} now, "
                    f"{state[key]} saved); resume with the same data and sampling config."
                )
        saved = state.get("prompts_per_draw")  # absent from checkpoints written before the option: passes
        if saved != self.prompts_per_draw:
            raise ValueError(
                f"sampler prompts_per_draw differs from the checkpoint ({self.prompts_per_draw} now, {saved} "
                "saved); resume with the same algo.prompts_per_draw."
            )
        self.set_epoch(int(state.get("epoch", 0)))
