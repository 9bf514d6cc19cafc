"""What ``rlgen plan`` reads of a flow recipe: the shape of its training (what a micro-batch counts, how many
a process accumulates per step, which weight copies it keeps, what it refuses before training). Each flow
recipe module offers one as ``PLAN``; the defaults are those of the recipes that train per sample
(Flow-GRPO, DiffusionNFT / AWM / DGPO)."""

from __future__ import annotations

from typing import Any


class PlanShape:
    """A per-sample recipe: ``algo.train_batch_size`` samples per micro-batch, ``algo.gradient_accumulation_steps``
    micro-batches per step over the processes, one trained step per forward, no extra weight copy."""

    tracer: Any = None
    """The recipe's :class:`~rlgen_cli.recipes.plan_trace.EpochTracer` subclass: its sampling and optimizer
    step run on the meta device."""
    accumulation_setting: str | None = "algo.gradient_accumulation_steps"
    """The setting that chooses the micro-batches per step (None when the recipe derives them)."""

    def require_plannable(self, cfg: Any, policy: Any) -> None:
        """What the recipe refuses before it trains, refused before the plan traces it (exit code 2)."""

    def samples_per_epoch(self, cfg: Any) -> int:
        """Samples an epoch rolls out over every process."""
        return cfg.algo.prompts_per_epoch * cfg.algo.group_size

    def weight_copies(self, cfg: Any) -> tuple[str, ...]:
        """Copies of the trained weights the recipe keeps beside them (an old policy, a reference)."""
        return ()

    def micro_batch_unit(self, cfg: Any) -> str:
        """What a micro-batch counts."""
        return "samples"

    def micro_batch(self, cfg: Any) -> tuple[int, str | None]:
        """Units in one gradient-carrying training call on one process, and the setting that chooses it."""
        return cfg.algo.train_batch_size, "algo.train_batch_size"

    def rows_per_unit(self, cfg: Any) -> int:
        """Rows of a unit in the training forwards whose graphs live together."""
        return 1

    def micro_batches_per_process(self, cfg: Any) -> int:
        """Micro-batches one process trains per optimizer step."""
        world = cfg.launcher.world_size
        return cfg.algo.micro_batches_per_step(world) // world

    def folded_steps(self, cfg: Any) -> int:
        """Trained steps one training forward scores per sample."""
        return 1
