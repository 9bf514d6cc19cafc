"""The reward-hacking guard on pure noise: how often a run that is not hacked at all gets flagged.

Each simulated run has 40 evaluations of 288 prompts (ShapesEval's test split) with nothing changing but
chance: every evaluation draws each prompt's score afresh from the same distribution, the trained reward
and the held-out metric independently. Any flag is a false one. The defaults (``guard.noise_k`` = 3
standard errors for the held-out drop, ``guard.rise_k`` = 1 for the trained reward's rise) keep the
share of runs flagged at least once at or under 5 % even with no margin; the bare rule (k = 0: any rise
of the trained reward, any drop past δ) flags most runs even with δ at twice the held-out metric's own
standard error. The generator is seeded, so the shares are the same on every machine.

And on a real hacked run: the recorded evaluations of docs/guard.md's ShapesEval lenient-accuracy run
(data/guard_shapes_lenient.json), replayed through the rule, are rolled back where that run was.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlgen_cli.schema.hacking_guard import GuardConfig
from rlgen_cli.training.control.hacking_guard import HackingGuard

EVALUATIONS, PROMPTS, WINDOW, RUNS = 40, 288, 3, 200
ACCURACY = 0.25  # strict accuracy of the ShapesEval base
ACCURACY_SE = math.sqrt(ACCURACY * (1 - ACCURACY) / PROMPTS)  # σ of one evaluation's accuracy: 0.0255
DEFAULT = GuardConfig()
Draw = Callable[[torch.Generator], torch.Tensor]


def _accuracy_scores(generator: torch.Generator) -> torch.Tensor:
    """(evaluations, prompts) of 0/1 outcomes: an accuracy-type monitor."""
    return (torch.rand(EVALUATIONS, PROMPTS, generator=generator, dtype=torch.float64) < ACCURACY).double()


def _continuous_scores(generator: torch.Generator) -> torch.Tensor:
    """(evaluations, prompts) of normal scores, σ 1 per prompt: a preference-model-like monitor."""
    return torch.randn(EVALUATIONS, PROMPTS, generator=generator, dtype=torch.float64)


def _share_flagged(draw: Draw, margin: float, noise_k: float, rise_k: float, seed: int = 0) -> float:
    """Share of ``RUNS`` pure-noise runs flagged at least once."""
    generator = torch.Generator().manual_seed(seed)
    flagged = 0
    for _ in range(RUNS):
        trained, heldout = draw(generator), draw(generator)
        guard = HackingGuard(window=WINDOW, margin=margin, noise_k=noise_k, rise_k=rise_k)
        verdicts = [guard.observe(n - 1, trained[n], heldout[n]) for n in range(EVALUATIONS)]
        flagged += any(v.event is not None for v in verdicts)
    return flagged / RUNS


@pytest.mark.parametrize("draw", [_accuracy_scores, _continuous_scores], ids=["accuracy", "continuous"])
def test_the_defaults_flag_at_most_5_percent_of_pure_noise_runs_without_a_margin(draw: Draw):
    """Margin 0: the standard errors alone stand between noise and a flag (measured: 3 % accuracy,
    0.5 % continuous; noise_k = 2.5 flags 14 % and 8.5 %, rise_k = 0 — any rise — 6 % and 9.5 %)."""
    assert _share_flagged(draw, margin=0.0, noise_k=DEFAULT.noise_k, rise_k=DEFAULT.rise_k) <= 0.05


@pytest.mark.parametrize("sigmas, at_least", [(2, 0.8), (3, 0.35)])
def test_the_bare_rule_flags_most_pure_noise_runs(sigmas: int, at_least: float):
    """The rule without noise estimates (both k = 0) at δ = 2σ and 3σ of the held-out accuracy's own
    noise (measured: 96.5 % and 48 % of runs). The defaults at these margins flag no more than at
    margin 0 (a larger δ only removes flags)."""
    assert _share_flagged(_accuracy_scores, margin=sigmas * ACCURACY_SE, noise_k=0.0, rise_k=0.0) >= at_least


def test_a_held_out_metric_that_falls_beyond_its_noise_is_still_flagged():
    """Not a guard deaf to everything: the trained reward climbing 0.1 and strict accuracy falling 0.1
    over the window's 3 evaluations (on fresh draws, the noisiest case) is flagged in nearly every run."""
    generator = torch.Generator().manual_seed(1)
    flagged = 0
    for _ in range(100):
        guard = HackingGuard(window=WINDOW, margin=0.05, noise_k=DEFAULT.noise_k, rise_k=DEFAULT.rise_k)
        events = []
        for n in range(8):
            trained = torch.rand(PROMPTS, generator=generator, dtype=torch.float64) < 0.3 + 0.1 * n / 3
            heldout = torch.rand(PROMPTS, generator=generator, dtype=torch.float64) < 0.3 - 0.1 * n / 3
            events.append(guard.observe(n - 1, trained.double(), heldout.double()).event)
        flagged += any(event is not None for event in events)
    assert flagged >= 95


def test_the_recorded_shapes_lenient_run_is_rolled_back_after_epochs_40_and_160():
    """docs/guard.md's run, as its guard saw it (288 prompts, 0/1 scores; after each rollback the run
    went on from the restored weights, so the evaluations that follow are the rolled-back run's). With the
    defaults: rollbacks after epochs 40 (lenient +1.6 se, strict −8.3 se) and 160 (+1.4 se, −5.3 se); at 140
    strict fell 4.2 se but lenient rose only 0.75 se, where the bare rule would already have acted."""
    recorded = json.loads((Path(__file__).parent / "data" / "guard_shapes_lenient.json").read_text())
    evaluations = [
        (e["epoch"], [float(c) for c in e["trained"]], [float(c) for c in e["heldout"]])
        for e in recorded["evaluations"]
    ]

    def rollbacks(noise_k: float, rise_k: float) -> list[int]:
        guard = HackingGuard(window=3, margin=0.05, action="rollback", noise_k=noise_k, rise_k=rise_k)
        verdicts = [guard.observe(*evaluation) for evaluation in evaluations]
        # epochs completed, as every output counts (the guard itself takes the 0-based epoch index)
        return [v.event.epoch + 1 for v in verdicts if v.event is not None and v.event.action == "rollback"]

    assert rollbacks(DEFAULT.noise_k, DEFAULT.rise_k) == [40, 160]
    assert rollbacks(0.0, 0.0)[:2] == [40, 140]  # where the bare rule would have rolled back instead
