"""The fidelity record of an experiment named after an upstream recipe.

An experiment that reproduces a published recipe says, in its own file, which upstream source it follows
and how close it is: every semantics knob of the recipe is either in ``matches`` (the upstream value, which
the composed config equals) or in ``differs`` (the upstream value and why this experiment departs from
it: a reward model that cannot ship, memory, a missing kernel). ``tests/schema/test_fidelity.py``
composes each such experiment and checks the record against the composed config, so a default that moves
under an experiment breaks a test instead of silently changing the recipe.

Keys are dotted paths into the composed config (``algo.kl_weight``, ``sampler.kind``), plus a few derived
values that no single key holds (``geometry.samples_per_optimizer_step``,
``geometry.optimizer_steps_per_epoch``; see the test for their definitions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlgen_cli.errors import UserError

DIFFERS_FIELDS = ("upstream", "why")


@dataclass
class FidelityConfig:
    source: str = ""
    """The upstream recipe: repository, commit, config function and training script."""
    matches: dict[str, Any] = field(default_factory=dict)
    """{dotted.key: upstream value} for every knob this experiment reproduces."""
    differs: dict[str, Any] = field(default_factory=dict)
    """{dotted.key: {upstream: value, why: reason}} for every knob it does not."""
    notes: list[str] = field(default_factory=list)
    """Upstream behaviours no config key expresses (e.g. a shuffle before batching), and their effect."""

    def __post_init__(self) -> None:
        if not self.source:
            raise UserError("fidelity.source is empty: name the upstream repository, commit and config")
        for key, entry in self.differs.items():
            if not isinstance(entry, dict) or sorted(entry) != sorted(DIFFERS_FIELDS):
                raise UserError(
                    f"fidelity.differs.{key} must be {{upstream: VALUE, why: REASON}}, got {entry!r}"
                )
        both = sorted(set(self.matches) & set(self.differs))
        if both:
            raise UserError(f"fidelity lists {both} in both matches and differs; keep each knob in one")
