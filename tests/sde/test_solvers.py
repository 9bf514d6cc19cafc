"""ODE solvers against the exact flow of Gaussian data, and the compressed (MixGRPO-Flash) schedule.

Data x₀ ~ N(m, s²) per coordinate, x_σ = (1 − σ)·x₀ + σ·ε. Then x_σ ~ N((1 − σ)·m, V(σ)) with
V(σ) = (1 − σ)²·s² + σ², and the marginal velocity E[ε − x₀ | x_σ] is, by the Gaussian posterior means
E[x₀ | x] = m + (1 − σ)s²/V·(x − (1 − σ)m) and E[ε | x] = σ/V·(x − (1 − σ)m),

    v(x, σ) = (σ − (1 − σ)·s²)/V(σ) · (x − (1 − σ)·m) − m.

The probability-flow ODE dx/dσ = v is affine and keeps the Gaussian marginals, so it maps quantiles:
z = (x − (1 − σ_a)m)/√V(σ_a) is invariant and x(σ_b) = (1 − σ_b)·m + √V(σ_b)·z; from σ = 1 (V = 1) to
σ = 0 this is x ↦ m + s·x. (Check: d/dσ of that is −m + V'/(2V)·(x − (1 − σ)m) with V'/2 = σ − (1 − σ)s².)

Order tests: uniform-in-σ steps on [1, 0.25]. Down to σ = 0 the last uniform-in-σ steps have λ-length
log(k/(k − 1)) whatever their number, so DPM-Solver++'s asymptotic rate needs many more steps there
(measured error ratios for 4→8→…→128 steps: 5.0, 6.7, 1.1, 2.6, 3.1); that range is checked for
accuracy against Euler instead.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.sde import compressed_schedule, dpm_solver_2m, euler, sd3_sigmas

M, S = 0.7, 0.4


def _var(sigma: float) -> float:
    return (1 - sigma) ** 2 * S**2 + sigma**2


def _velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    sg = float(sigma)
    return (sg - (1 - sg) * S**2) / _var(sg) * (x - (1 - sg) * M) - M


def _exact(x: torch.Tensor, sigma_a: float, sigma_b: float) -> torch.Tensor:
    z = (x - (1 - sigma_a) * M) / math.sqrt(_var(sigma_a))
    return (1 - sigma_b) * M + math.sqrt(_var(sigma_b)) * z


def _x1() -> torch.Tensor:
    return torch.linspace(-3, 3, 61, dtype=torch.float64).reshape(61, 1)  # (B, 1) noise quantiles


def _errors(solver, start: float, end: float, steps: list[int]) -> list[float]:
    x1 = _x1()
    out = []
    for n in steps:
        sigmas = torch.linspace(start, end, n + 1, dtype=torch.float64)
        out.append(float((solver(_velocity, x1, sigmas) - _exact(x1, start, end)).abs().max()))
    return out


def _ratios(errors: list[float]) -> list[float]:
    return [a / b for a, b in zip(errors, errors[1:])]


def test_exact_flow_is_the_affine_quantile_map():
    x1 = _x1()
    torch.testing.assert_close(_exact(x1, 1.0, 0.0), M + S * x1)
    # the analytic v is the σ-derivative of the analytic flow (central difference)
    h, sg = 1e-5, 0.37
    deriv = (_exact(x1, 1.0, sg + h) - _exact(x1, 1.0, sg - h)) / (2 * h)
    torch.testing.assert_close(_velocity(_exact(x1, 1.0, sg), torch.tensor(sg)), deriv, rtol=1e-7, atol=1e-7)


def test_euler_is_first_order():
    ratios = _ratios(_errors(euler, 1.0, 0.0, [8, 16, 32]))
    assert all(1.6 <= r <= 2.5 for r in ratios), ratios
    ratios = _ratios(_errors(euler, 1.0, 0.25, [8, 16, 32]))
    assert all(1.6 <= r <= 2.5 for r in ratios), ratios


def test_dpm_solver_2m_is_second_order_from_sigma_one():
    # starts at σ = 1 (λ = −∞): the first steps are first order, which must not spoil the rate
    ratios = _ratios(_errors(dpm_solver_2m, 1.0, 0.25, [8, 16, 32]))
    assert all(3.0 <= r <= 5.5 for r in ratios), ratios


def test_dpm_solver_2m_is_second_order_from_below_one():
    ratios = _ratios(_errors(dpm_solver_2m, 0.9, 0.25, [8, 16, 32]))
    assert all(3.0 <= r <= 5.5 for r in ratios), ratios


def test_dpm_solver_2m_beats_euler_down_to_zero():
    for n in (8, 16, 32):
        (dpm,), (eul,) = _errors(dpm_solver_2m, 1.0, 0.0, [n]), _errors(euler, 1.0, 0.0, [n])
        assert dpm < eul / 3, (n, dpm, eul)


def test_dpm_solver_2m_is_exact_for_a_point_mass():
    # s = 0: x̂₀ = x − σ·v ≡ m along every path, which a data-prediction solver integrates exactly
    def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return (x - (1 - sigma) * M) / sigma - M

    x1 = _x1()
    for sigmas in (sd3_sigmas(5).double(), torch.tensor([1.0, 0.6, 0.3, 0.1, 0.0], dtype=torch.float64)):
        torch.testing.assert_close(dpm_solver_2m(velocity, x1, sigmas), torch.full_like(x1, M))


def test_single_steps_first_order_and_final_data_prediction():
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    sg = torch.tensor(0.6)
    v = _velocity(x, sg)
    # one step to σ = 0 returns x̂₀ = x − σ·v; one step to σ' > 0 is the Euler (= DDIM) step
    torch.testing.assert_close(dpm_solver_2m(_velocity, x, torch.tensor([0.6, 0.0])), x - 0.6 * v)
    torch.testing.assert_close(dpm_solver_2m(_velocity, x, torch.tensor([0.6, 0.2])), x + v * (0.2 - 0.6))
    torch.testing.assert_close(euler(_velocity, x, torch.tensor([0.6, 0.2])), x + v * (0.2 - 0.6))


def test_solvers_promote_low_precision_and_keep_float64():
    x = torch.randn(2, 3).bfloat16()
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    assert dpm_solver_2m(_velocity, x, sigmas).dtype == torch.float32
    assert euler(_velocity, x, sigmas).dtype == torch.float32
    assert dpm_solver_2m(_velocity, x.double(), sigmas).dtype == torch.float64


@pytest.mark.parametrize(
    "sigmas,match",
    [
        (torch.tensor([1.0]), "K \\+ 1 >= 2"),
        (torch.ones(2, 2), "1-D"),
        (torch.tensor([1.0, 0.5, 0.5, 0.0]), "decrease strictly"),
        (torch.tensor([0.0, 0.5, 1.0]), "decrease strictly"),
        (torch.tensor([1.5, 0.5, 0.0]), r"within \[0, 1\]"),
    ],
)
def test_solvers_reject_bad_schedules(sigmas, match):
    for solver in (euler, dpm_solver_2m):
        with pytest.raises(ValueError, match=match):
            solver(_velocity, torch.zeros(1, 1), sigmas)


# ----------------------------------------------------------------------------------- compressed_schedule


def test_compressed_schedule_keeps_the_head_and_resamples_the_tail():
    sigmas = sd3_sigmas(25)  # (26,)
    out = compressed_schedule(sigmas, 8, 0.4)  # remaining 17 steps → round(6.8) = 7
    assert out.shape == (8 + 7 + 1,) and out.dtype == torch.float32
    torch.testing.assert_close(out[:9], sigmas[:9], rtol=0, atol=0)  # up to and including index start
    assert out[-1] == 0 and bool((out[1:] < out[:-1]).all())


def test_compressed_schedule_resamples_the_original_curve():
    # a linear schedule stays linear; whole fractional indices hit original levels exactly
    linear = torch.linspace(1, 0, 11)
    torch.testing.assert_close(
        compressed_schedule(linear, 2, 0.5), torch.tensor([1.0, 0.9, 0.8, 0.6, 0.4, 0.2, 0.0])
    )
    sigmas = sd3_sigmas(20)
    out = compressed_schedule(sigmas, 4, 0.5)  # 16 → 8 steps: every other original level
    torch.testing.assert_close(out, torch.cat([sigmas[:4], sigmas[4::2]]))


def test_compressed_schedule_step_count_rounding():
    sigmas = torch.linspace(1, 0, 11)
    assert compressed_schedule(sigmas, 9, 0.1).numel() == 9 + 1 + 1  # max(1, round(0.1)) = 1 step
    assert compressed_schedule(sigmas, 5, 0.5).numel() == 5 + 3 + 1  # round(2.5) = 3 (halves up)
    torch.testing.assert_close(compressed_schedule(sigmas, 3, 1.0), sigmas)  # ratio 1: unchanged


def test_compressed_schedule_then_dpm_matches_the_exact_tail():
    # Flash-style: window ends at step 5 of 25 → DPM-Solver++ on 40 % of the 20 remaining steps
    sigmas = torch.linspace(1, 0, 26, dtype=torch.float64)
    tail = compressed_schedule(sigmas, 6, 0.4)[6:].double()  # from σ = sigmas[6] to 0
    x = _exact(_x1(), 1.0, float(sigmas[6]))
    err_dpm = float((dpm_solver_2m(_velocity, x, tail) - _exact(x, float(sigmas[6]), 0.0)).abs().max())
    err_euler = float((euler(_velocity, x, sigmas[6:]) - _exact(x, float(sigmas[6]), 0.0)).abs().max())
    assert tail.numel() == 9 and err_dpm < err_euler  # 8 DPM steps beat 20 Euler steps


@pytest.mark.parametrize("start,ratio", [(-1, 0.4), (10, 0.4), (2, 0.0), (2, 1.5)])
def test_compressed_schedule_bad_arguments_are_programming_errors(start, ratio):
    # algo.flash.ratio is checked at the config boundary; here an out-of-range value fails an assert
    with pytest.raises(AssertionError):
        compressed_schedule(torch.linspace(1, 0, 11), start, ratio)
