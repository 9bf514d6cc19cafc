"""Tests for rlgen_cli.sde.step and step_kl: hand-computed step means/stds, log-probs, modes, errors."""

from __future__ import annotations

import math
from typing import get_args

import pytest
import torch

from rlgen_cli.schema.choices import StepKind
from rlgen_cli.sde import sd3_sigmas, step, step_kl

STOCHASTIC = ("flow_sde", "dance", "cps")


def _full(value: float, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    return torch.full(shape, value)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- η = 0 is the Euler ODE


@pytest.mark.parametrize("kind", get_args(StepKind))
def test_eta_zero_is_euler_ode(kind: str) -> None:
    # the schedule starts at σ = 1, so flow_sde needs sigma_max = sigmas[1]
    sigmas = sd3_sigmas(10)
    x, v = _rand(2, 4, 8, 8, seed=1), _rand(2, 4, 8, 8, seed=2)
    for i in range(10):
        out = step(kind, x, v, sigmas[i], sigmas[i + 1], noise_level=0.0, sigma_max=float(sigmas[1]))
        assert torch.equal(out.prev, x + v * (sigmas[i + 1] - sigmas[i]))
        assert torch.equal(out.mean, out.prev)
        assert torch.equal(out.std, torch.zeros(2)) and torch.equal(out.logprob, torch.zeros(2))
        x = out.prev


def test_ode_ignores_eta_and_keeps_given_prev() -> None:
    x, v = _rand(2, 3, seed=1), _rand(2, 3, seed=2)
    # dt = 0.25 − 0.5 = −0.25
    out = step("ode", x, v, 0.5, 0.25, noise_level=0.7)
    assert torch.equal(out.prev, x + v * -0.25)
    stored = _rand(2, 3, seed=3)
    out = step("ode", x, v, 0.5, 0.25, prev=stored)
    assert torch.equal(out.prev, stored) and torch.equal(out.logprob, torch.zeros(2))


# ---------------------------------------------------------------- hand-computed means and stds


def test_flow_sde_hand_values() -> None:
    # x=1, v=2, σ=0.5, σ'=0.25, a=0.7: dt = −0.25; σ_t = 0.7·sqrt(0.5/0.5) = 0.7, σ_t² = 0.49
    # c_x = 1 + 0.49·(−0.25)/(2·0.5) = 0.8775
    # c_v = (1 + 0.49·0.5/(2·0.5))·(−0.25) = 1.245·(−0.25) = −0.31125
    # μ = 0.8775 + 2·(−0.31125) = 0.255;  s = 0.7·sqrt(0.25) = 0.35
    out = step("flow_sde", _full(1.0), _full(2.0), 0.5, 0.25, noise_level=0.7, noise=torch.zeros(2, 3))
    torch.testing.assert_close(out.mean, _full(0.255))
    torch.testing.assert_close(out.std, torch.full((2,), 0.35))
    torch.testing.assert_close(out.prev, out.mean)


def test_flow_sde_uses_sigma_max_at_sigma_one() -> None:
    # x=1, v=2, σ=1, σ'=0.75, a=0.5, sigma_max=0.75: σ_t = 0.5·sqrt(1/(1−0.75)) = 1, dt = −0.25
    # c_x = 1 + 1·(−0.25)/2 = 0.875;  c_v = (1 + 1·0/2)·(−0.25) = −0.25
    # μ = 0.875 − 0.5 = 0.375;  s = 1·sqrt(0.25) = 0.5
    out = step(
        "flow_sde",
        _full(1.0),
        _full(2.0),
        1.0,
        0.75,
        noise_level=0.5,
        noise=torch.zeros(2, 3),
        sigma_max=0.75,
    )
    torch.testing.assert_close(out.mean, _full(0.375))
    torch.testing.assert_close(out.std, torch.full((2,), 0.5))


def test_dance_hand_values() -> None:
    # x=1, v=2, σ=0.5, σ'=0.25, η=0.3: x̂₀ = 1 − 0.5·2 = 0; score = −(1 − 0.5·0)/0.25 = −4
    # μ = 1 + (2 − 0.5·0.09·(−4))·(−0.25) = 1 + 2.18·(−0.25) = 0.455;  s = 0.3·0.5 = 0.15
    out = step("dance", _full(1.0), _full(2.0), 0.5, 0.25, noise_level=0.3, noise=torch.zeros(2, 3))
    torch.testing.assert_close(out.mean, _full(0.455))
    torch.testing.assert_close(out.std, torch.full((2,), 0.15))


def test_dance_with_flow_grpo_eta_equals_flow_sde() -> None:
    # docs/maths.md §2.4: η(σ) = σ_t = a·sqrt(σ/(1−σ)) makes the score form the Flow-GRPO step
    x, v, noise = _rand(3, 4, 5, seed=1), _rand(3, 4, 5, seed=2), _rand(3, 4, 5, seed=3)
    sigma, sigma_next, a = 0.6, 0.45, 0.7
    sigma_t = a * math.sqrt(sigma / (1 - sigma))
    flow = step("flow_sde", x, v, sigma, sigma_next, noise_level=a, noise=noise)
    dance = step("dance", x, v, sigma, sigma_next, noise_level=sigma_t, noise=noise)
    torch.testing.assert_close(dance.mean, flow.mean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dance.std, flow.std)
    torch.testing.assert_close(dance.logprob, flow.logprob, atol=1e-5, rtol=1e-6)


def test_cps_hand_values() -> None:
    # x=2, v=−1, σ=0.75, σ'=0.5, a = 2·asin(0.6)/π so sin(aπ/2) = 0.6: σ_t = 0.5·0.6 = 0.3
    # x̂₀ = 2 + 0.75 = 2.75;  x̂₁ = 2 − 0.25 = 1.75;  sqrt(0.25 − 0.09) = 0.4
    # μ = (1 − 0.5)·2.75 + 0.4·1.75 = 1.375 + 0.7 = 2.075;  s = 0.3
    a = 2 * math.asin(0.6) / math.pi
    out = step("cps", _full(2.0), _full(-1.0), 0.75, 0.5, noise_level=a, noise=torch.zeros(2, 3))
    torch.testing.assert_close(out.mean, _full(2.075))
    torch.testing.assert_close(out.std, torch.full((2,), 0.3))


@pytest.mark.parametrize("sigma_next", [0.9, 0.5, 0.1])
@pytest.mark.parametrize("a", [0.3, 0.8, 1.0])
def test_cps_preserves_coefficients(sigma_next: float, a: float) -> None:
    # pick x, v so that (x̂₀, x̂₁) = (1, 0) or (0, 1): x = 1 − σ, v = −1 and x = σ, v = 1
    # then μ is the x̂₀ coefficient (1 − σ') resp. the x̂₁ coefficient c = sqrt(σ'² − σ_t²), and
    # c² + σ_t² == σ'²: the noise part of x' keeps the schedule's σ'
    sigma = 0.95
    x0_part = step(
        "cps", _full(1 - sigma), _full(-1.0), sigma, sigma_next, noise_level=a, noise=torch.zeros(2, 3)
    )
    x1_part = step("cps", _full(sigma), _full(1.0), sigma, sigma_next, noise_level=a, noise=torch.zeros(2, 3))
    torch.testing.assert_close(x0_part.mean, _full(1 - sigma_next))
    c, sigma_t = x1_part.mean[0, 0], x1_part.std[0]
    torch.testing.assert_close(c**2 + sigma_t**2, torch.tensor(sigma_next**2))


# ---------------------------------------------------------------- log-probs


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_logprob_is_gaussian_density(kind: str) -> None:
    x, v = _rand(3, 4, 5, 6, seed=1), _rand(3, 4, 5, 6, seed=2)
    gen = torch.Generator().manual_seed(0)
    out = step(kind, x, v, 0.7, 0.6, noise_level=0.7, generator=gen)
    normal = torch.distributions.Normal(out.mean, out.std.view(3, 1, 1, 1))
    expected = normal.log_prob(out.prev).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.logprob, expected, atol=1e-5, rtol=1e-5)


def test_logprob_hand_value() -> None:
    # flow_sde hand case (μ = 0.255, s = 0.35) with z = 1: prev − μ = 0.35, per element
    # −0.35²/(2·0.35²) − log 0.35 − ½·log 2π = −0.5 + 1.0498221 − 0.9189385 = −0.3691164
    out = step("flow_sde", _full(1.0), _full(2.0), 0.5, 0.25, noise_level=0.7, noise=torch.ones(2, 3))
    torch.testing.assert_close(out.logprob, torch.full((2,), -0.3691164))


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_sum_is_mean_times_numel(kind: str) -> None:
    x, v, noise = _rand(2, 3, 4, seed=1), _rand(2, 3, 4, seed=2), _rand(2, 3, 4, seed=3)
    mean = step(kind, x, v, 0.8, 0.7, noise_level=0.5, noise=noise).logprob
    total = step(kind, x, v, 0.8, 0.7, noise_level=0.5, noise=noise, reduce="sum").logprob
    torch.testing.assert_close(total, mean * 12, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", STOCHASTIC)
@pytest.mark.parametrize("shape", [(2, 4, 8, 8), (2, 4, 3, 8, 8), (2, 16, 8)])
def test_recompute_with_prev_gives_sampled_logprob(kind: str, shape: tuple[int, ...]) -> None:
    # images (B,C,H,W), videos (B,C,F,H,W), packed tokens (B,L,D)
    x, v = _rand(*shape, seed=1), _rand(*shape, seed=2)
    sampled = step(kind, x, v, 0.9, 0.8, noise_level=0.7, generator=torch.Generator().manual_seed(5))
    again = step(kind, x, v, 0.9, 0.8, noise_level=0.7, prev=sampled.prev)
    assert sampled.logprob.shape == (2,)
    torch.testing.assert_close(again.logprob, sampled.logprob, atol=1e-6, rtol=0)
    assert torch.equal(again.prev, sampled.prev)


def test_cps_upstream_logprob_form() -> None:
    # cps hand case (s = 0.3) with z = 1: upstream log p = −mean((0.3·1)²) = −0.09; sum over 3: −0.27
    a = 2 * math.asin(0.6) / math.pi
    args = ("cps", _full(2.0), _full(-1.0), 0.75, 0.5)
    mean_form = step(*args, noise_level=a, noise=torch.ones(2, 3), logprob_form="upstream")
    sum_form = step(*args, noise_level=a, noise=torch.ones(2, 3), logprob_form="upstream", reduce="sum")
    torch.testing.assert_close(mean_form.logprob, torch.full((2,), -0.09))
    torch.testing.assert_close(sum_form.logprob, torch.full((2,), -0.27))


def test_zero_std_step_has_zero_logprob() -> None:
    # cps to σ' = 0 has σ_t = 0: deterministic, log p = 0 (never trained) instead of NaN
    out = step(
        "cps", _rand(2, 3), _rand(2, 3, seed=1), 0.1, 0.0, noise_level=0.8, generator=torch.Generator()
    )
    assert torch.equal(out.std, torch.zeros(2)) and torch.equal(out.logprob, torch.zeros(2))


def test_logprob_gradient_flows_through_mean_only() -> None:
    x = _rand(2, 3)
    v = _rand(2, 3, seed=1).requires_grad_()
    stored = step("flow_sde", x, v.detach(), 0.5, 0.4, noise_level=0.7, generator=torch.Generator()).prev
    out = step("flow_sde", x, v, 0.5, 0.4, noise_level=0.7, prev=stored)
    out.logprob.sum().backward()
    assert v.grad is not None and bool(v.grad.abs().sum() > 0)


# ---------------------------------------------------------------- sampling modes, batching, dtypes


def test_generator_sampling_is_deterministic() -> None:
    x, v = _rand(2, 3, 4), _rand(2, 3, 4, seed=1)
    first = step("flow_sde", x, v, 0.8, 0.7, noise_level=0.7, generator=torch.Generator().manual_seed(3))
    second = step("flow_sde", x, v, 0.8, 0.7, noise_level=0.7, generator=torch.Generator().manual_seed(3))
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    given = step("flow_sde", x, v, 0.8, 0.7, noise_level=0.7, noise=z)
    assert torch.equal(first.prev, second.prev) and torch.equal(first.prev, given.prev)


@pytest.mark.parametrize("kind", get_args(StepKind))
def test_per_sample_sigma_equals_loop(kind: str) -> None:
    # sample 0 starts at σ = 1, so flow_sde uses sigma_max
    x, v, noise = _rand(3, 2, 4, seed=1), _rand(3, 2, 4, seed=2), _rand(3, 2, 4, seed=3)
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.9, 0.5, 0.1])
    kw = {"noise_level": 0.7, "sigma_max": 0.9}
    batched = step(kind, x, v, sigma, sigma_next, noise=noise, **kw)
    for i in range(3):
        one = step(
            kind,
            x[i : i + 1],
            v[i : i + 1],
            float(sigma[i]),
            float(sigma_next[i]),
            noise=noise[i : i + 1],
            **kw,
        )
        # a tensor σ against a Python float σ: float32 rounding apart at most (values ≤ 2.6: 8 eps ≥ 4 ulp)
        rounding = 8 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(batched.prev[i : i + 1], one.prev, atol=rounding, rtol=0)
        torch.testing.assert_close(batched.std[i : i + 1], one.std, atol=rounding, rtol=0)
        torch.testing.assert_close(batched.logprob[i : i + 1], one.logprob, atol=rounding, rtol=0)


def test_low_precision_inputs_give_fp32_outputs() -> None:
    x, v = _rand(2, 3).bfloat16(), _rand(2, 3, seed=1).bfloat16()
    out = step(
        "flow_sde",
        x,
        v,
        torch.tensor(0.5, dtype=torch.bfloat16),
        0.4,
        noise_level=0.7,
        generator=torch.Generator(),
    )
    assert {out.prev.dtype, out.mean.dtype, out.std.dtype, out.logprob.dtype} == {torch.float32}


def test_flow_sde_empirical_mean_and_std() -> None:
    # hand case: μ = 0.255, s = 0.35; 20000 draws: standard error of the mean 0.35/141 = 0.0025
    n = 20000
    out = step(
        "flow_sde",
        torch.ones(n, 1),
        torch.full((n, 1), 2.0),
        0.5,
        0.25,
        noise_level=0.7,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.prev.mean().item() == pytest.approx(0.255, abs=0.01)
    assert out.prev.std().item() == pytest.approx(0.35, abs=0.01)


def test_cps_keeps_marginal_noise_level_empirically() -> None:
    # data at x₀ = 0: x_σ = σ·ε and the exact velocity is v = ε − x₀ = x/σ; a CPS step gives
    # x' = c·ε + σ_t·z with c² + σ_t² = σ'², so std(x') = σ' = 0.5 exactly (up to sampling error)
    n, sigma, sigma_next = 20000, 0.8, 0.5
    x = sigma * torch.randn(n, 1, generator=torch.Generator().manual_seed(1))
    out = step(
        "cps", x, x / sigma, sigma, sigma_next, noise_level=0.8, generator=torch.Generator().manual_seed(2)
    )
    assert out.prev.std().item() == pytest.approx(sigma_next, abs=0.01)


# ---------------------------------------------------------------- errors


def test_errors() -> None:
    x, v = _rand(2, 3), _rand(2, 3, seed=1)
    with pytest.raises(ValueError, match="both noise and prev"):
        step("flow_sde", x, v, 0.5, 0.4, noise_level=0.7, noise=x, prev=x)
    with pytest.raises(ValueError, match="sigma_max=sigmas\\[1\\]"):
        step("flow_sde", x, v, 1.0, 0.9, noise_level=0.7)
    with pytest.raises(ValueError, match="sigma_next > sigma"):
        step("dance", x, v, 0.4, 0.5, noise_level=0.3)
    with pytest.raises(ValueError, match=r"\(2,\) tensor"):
        step("dance", x, v, torch.tensor([0.5, 0.5, 0.5]), 0.4, noise_level=0.3)
    with pytest.raises(ValueError, match="v has shape"):
        step("dance", x, v[:, :2], 0.5, 0.4, noise_level=0.3)


@pytest.mark.parametrize(
    "kind,options",
    [
        ("euler", {"noise_level": 0.7}),
        ("flow_sde", {"noise_level": 0.7, "reduce": "max"}),
        ("flow_sde", {"noise_level": 0.7, "logprob_form": "upstream"}),
        ("dance", {"noise_level": -0.1}),
        ("cps", {"noise_level": 1.5}),
    ],
)
def test_unchecked_options_are_programming_errors(kind: str, options: dict) -> None:
    # the config boundary checks these (tests/schema); inside sde/ they fail an assert
    with pytest.raises(AssertionError):
        step(kind, _rand(2, 3), _rand(2, 3, seed=1), 0.5, 0.4, generator=torch.Generator(), **options)


# ---------------------------------------------------------------- step_kl


def test_step_kl_hand_values() -> None:
    # μ − μ_ref = 0.5 everywhere, s = 0.35, dt = −0.25
    # gaussian: 0.25 / (2·0.1225) = 1.0204082
    # upstream: σ_t = 0.35/sqrt(0.25) = 0.7 -> 0.25 / (2·0.49) = 0.2551020 (= gaussian·|dt|)
    # upstream with cps: σ_t is the full std 0.35 -> the gaussian value
    mean, ref = _full(0.5), torch.zeros(2, 3)
    std = torch.full((2,), 0.35)
    torch.testing.assert_close(step_kl(mean, ref, std, -0.25), torch.full((2,), 1.0204082))
    torch.testing.assert_close(step_kl(mean, ref, std, -0.25, form="upstream"), torch.full((2,), 0.2551020))
    cps = step_kl(mean, ref, std, -0.25, form="upstream", kind="cps")
    torch.testing.assert_close(cps, torch.full((2,), 1.0204082))
    torch.testing.assert_close(step_kl(mean, ref, std, -0.25, reduce="sum"), torch.full((2,), 3.0612245))


def test_step_kl_zero_std_and_errors() -> None:
    kl = step_kl(_full(0.5), torch.zeros(2, 3), torch.tensor([0.0, 0.35]), torch.tensor([0.0, -0.25]))
    torch.testing.assert_close(kl, torch.tensor([0.0, 1.0204082]))
    with pytest.raises(AssertionError):
        step_kl(_full(0.5), torch.zeros(2, 3), 0.35, -0.25, form="exact")
    with pytest.raises(ValueError, match="ref_mean has"):
        step_kl(_full(0.5), torch.zeros(2, 4), 0.35, -0.25)


@pytest.mark.parametrize("kind", STOCHASTIC)
def test_mean_is_continuous_at_eta_zero(kind: str) -> None:
    # the η = 0 shortcut hides no jump: a tiny η gives a mean within O(η²) of the Euler step
    x, v = _rand(2, 3, 4, seed=1), _rand(2, 3, 4, seed=2)
    out = step(kind, x, v, 0.7, 0.6, noise_level=1e-3, noise=torch.zeros(2, 3, 4))
    torch.testing.assert_close(out.mean, x + v * -0.1, atol=1e-5, rtol=0)
