"""R3's ``monotonic`` η (``r3.eta_schedule``): upstream's η·sqrt(σ / (1 − min(σ, 0.95))) by hand, the
rollout's stochastic step taking it at its own σ (its std), and the refusal for steps it does not scale."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.errors import UserError
from rlgen_cli.models import Cond
from rlgen_cli.r3.rollout import image_rollout, monotonic_eta
from rlgen_cli.schema.r3 import R3Config
from rlgen_cli.sde.rollout import StepSpec
from rlgen_cli.sde.window import WindowPlan

EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize(
    "sigma,factor",
    [
        (0.5, 1.0),  # sqrt(0.5 / 0.5)
        (0.75, math.sqrt(3.0)),  # sqrt(0.75 / 0.25)
        (0.2, 0.5),  # sqrt(0.2 / 0.8)
        (0.96, math.sqrt(0.96 / 0.05)),  # σ ≥ 0.95: the denominator stays 1 − 0.95
        (1.0, math.sqrt(20.0)),
        (0.0, 0.0),
    ],
)
def test_monotonic_eta_by_hand(sigma: float, factor: float):
    assert monotonic_eta(0.7, sigma) == pytest.approx(0.7 * factor, rel=1e-12, abs=1e-15)


class _StillPolicy:
    """Zero velocity on a linear schedule 1 → 0 (T steps): the stochastic step's std is η_used·sqrt(−dt)."""

    device = torch.device("cpu")

    def noise(self, n, generators, stage):
        return torch.cat([torch.randn(1, 2, 2, generator=g) for g in generators])

    def schedule(self, num_steps, x, stage):
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def velocity(self, x, sigma, cond):
        return torch.zeros_like(x)

    def decode(self, x, stage):
        return x.new_zeros(len(x), 3, 2, 2)


@pytest.mark.parametrize("schedule,eta_used", [("constant", 0.7), ("monotonic", 0.7 * math.sqrt(3.0))])
def test_the_stochastic_step_takes_the_scheduled_eta_at_its_sigma(schedule: str, eta_used: float):
    """4 steps, σ = 1, 0.75, 0.5, 0.25, 0; the SDE step is step 1 (σ 0.75 → 0.5, dt = −0.25)."""
    plan = WindowPlan(4, (1,), (1,))

    def encode(rows):
        return Cond({"c": torch.zeros(rows.stop - rows.start, 1)})

    out = image_rollout(
        _StillPolicy(), encode, "gen", plan, StepSpec("dance", 0.7), [0, 1, 2], [0, 0, 0], 0, 0, 2, schedule
    )
    expected = eta_used * math.sqrt(0.25)
    assert out.spec.noise_level == pytest.approx(eta_used, rel=4 * EPS)  # training reuses this spec
    torch.testing.assert_close(out.traj.stds, torch.full((3, 1), expected), rtol=4 * EPS, atol=0)


def test_monotonic_needs_the_score_form_step():
    with pytest.raises(UserError, match="r3.eta_schedule=monotonic scales η of the score-form step"):
        R3Config(eta_schedule="monotonic", sde_kind="flow_sde")
