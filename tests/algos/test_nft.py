"""DiffusionNFT's objective (``algos/nft.py``): hand-computed values, its relation to the advantage-weighted
flow-matching loss (AWM) and to SFT, the β → 0 limit, and the direction one step moves each sample."""

from __future__ import annotations

import pytest
import torch

from rlgen_cli.algos.awm import awm_loss
from rlgen_cli.algos.nft import nft_loss, old_policy_decay, optimality_probability, subset_timestep_indices
from rlgen_cli.algos.sft import sft_loss

# two samples of two elements; targets ε − x₀ are [1, 1] and [0, 2]
X0 = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
NOISE = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
SIGMA = torch.tensor([0.5, 1.0])
V_THETA = torch.tensor([[3.0, 1.0], [2.0, 2.0]])
V_OLD = torch.tensor([[1.0, 1.0], [1.0, 2.0]])
R = torch.tensor([1.0, 0.25])  # A = +5 and −2.5 with A_max = 5
# β = 0.5: v⁺ = ½·v_θ + ½·v_old = [[2, 1], [1.5, 2]], v⁻ = 1.5·v_old − ½·v_θ = [[0, 1], [0.5, 2]]
# errors v − (ε − x₀): v⁺ → [[1, 0], [1.5, 0]], v⁻ → [[−1, 0], [0.5, 0]]; times σ: [[.5, 0], [1.5, 0]],
# [[−.5, 0], [.5, 0]]


def test_optimality_probability_maps_the_clipped_advantage_onto_zero_one():
    advantages = torch.tensor([-7.0, -5.0, -2.5, 0.0, 2.5, 5.0, 7.0])
    # r = clamp(A, ±5)/10 + ½
    expected = torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
    assert torch.equal(optimality_probability(advantages, 5.0), expected)


def test_plain_loss_matches_hand_computation():
    out = nft_loss(V_THETA, V_OLD, X0, NOISE, SIGMA, R, beta=0.5, adaptive=False, scale=5.0)
    # ℓ = mean((σ·err)²): ℓ⁺ = [0.125, 1.125], ℓ⁻ = [0.125, 0.125]
    # r·ℓ⁺ + (1 − r)·ℓ⁻ = [0.125, 0.25·1.125 + 0.75·0.125 = 0.375]; mean 0.25; × scale/β = 10 → 2.5
    assert out.loss.item() == pytest.approx(2.5)
    assert out.policy_loss.item() == pytest.approx(2.5)
    assert out.stats["positive_loss"] == pytest.approx(0.625)
    assert out.stats["negative_loss"] == pytest.approx(0.125)
    # (v_θ − v_old)² = [[4, 0], [1, 0]] → 1.25; mean r = 0.625
    assert out.stats["old_deviation"] == pytest.approx(1.25)
    assert out.stats["optimality_mean"] == pytest.approx(0.625)


def test_adaptive_weight_divides_each_error_by_its_mean_absolute_value():
    out = nft_loss(V_THETA, V_OLD, X0, NOISE, SIGMA, R, beta=0.5, adaptive=True, scale=5.0)
    # mean |σ·err|: v⁺ → [0.25, 0.75], v⁻ → [0.25, 0.25]; ℓ⁺ = [0.5, 1.5], ℓ⁻ = [0.5, 0.5]
    # r-mix = [0.5, 0.25·1.5 + 0.75·0.5 = 0.75]; mean 0.625; × 10 → 6.25
    assert out.loss.item() == pytest.approx(6.25)


def test_kl_term_is_weighted_into_the_loss():
    out = nft_loss(
        V_THETA,
        V_OLD,
        X0,
        NOISE,
        SIGMA,
        R,
        beta=0.5,
        adaptive=False,
        scale=5.0,
        v_ref=torch.zeros_like(V_THETA),
        kl_weight=0.1,
    )
    # mean(v_θ²) = mean(9, 1, 4, 4) = 4.5; loss = 2.5 + 0.1·4.5
    assert out.kl_loss.item() == pytest.approx(4.5)
    assert out.loss.item() == pytest.approx(2.95)


def _grad(fn, v: torch.Tensor) -> torch.Tensor:
    v = v.clone().requires_grad_(True)
    fn(v).backward()
    return v.grad


@pytest.mark.parametrize("beta", [0.1, 1.0, 2.0])
def test_on_policy_gradient_is_the_advantage_weighted_matching_gradient(beta: float):
    """At v_θ = v_old, ∂L/∂v_θ = A·∂(σ²·e) whatever β: AWM's gradient with σ² weighting."""
    gen = torch.Generator().manual_seed(0)
    x0, noise, v = (torch.randn(3, 2, 4, generator=gen) for _ in range(3))
    sigma = torch.tensor([0.2, 0.6, 1.0])
    advantages = torch.tensor([4.0, -1.5, 0.5])
    r = optimality_probability(advantages, 5.0)
    nft = _grad(lambda p: nft_loss(p, v, x0, noise, sigma, r, beta=beta, adaptive=False, scale=5.0).loss, v)
    awm = _grad(lambda p: awm_loss(p, x0, noise, sigma, advantages, weighting="t2").loss, v)
    torch.testing.assert_close(nft, awm)


def test_small_beta_gradient_is_the_weighted_matching_gradient_at_the_old_policy():
    """β → 0: v⁺, v⁻ → v_old, so the gradient is AWM's evaluated at v_old (not at v_θ)."""
    gen = torch.Generator().manual_seed(1)
    x0, noise, v_old, v_theta = (torch.randn(3, 5, generator=gen) for _ in range(4))
    sigma = torch.tensor([0.3, 0.7, 0.9])
    advantages = torch.tensor([-3.0, 1.0, 2.0])
    r = optimality_probability(advantages, 5.0)

    def nft(p: torch.Tensor) -> torch.Tensor:
        return nft_loss(p, v_old, x0, noise, sigma, r, beta=1e-4, adaptive=False, scale=5.0).loss

    at_old = _grad(lambda p: awm_loss(p, x0, noise, sigma, advantages, weighting="t2").loss, v_old)
    at_theta = _grad(lambda p: awm_loss(p, x0, noise, sigma, advantages, weighting="t2").loss, v_theta)
    torch.testing.assert_close(_grad(nft, v_theta), at_old, atol=1e-3, rtol=1e-3)
    assert not torch.allclose(at_old, at_theta, atol=1e-2)  # the point of evaluation matters


def test_all_good_samples_with_beta_one_reduce_to_sft():
    """r ≡ 1, β = 1: v⁺ = v_θ, so at σ = 1 without the adaptive weight the loss is SFT's flow matching."""
    gen = torch.Generator().manual_seed(2)
    x0, noise, v_theta, v_old = (torch.randn(4, 3, 2, generator=gen) for _ in range(4))
    ones = torch.ones(4)
    nft = nft_loss(v_theta, v_old, x0, noise, ones, ones, beta=1.0, adaptive=False)
    torch.testing.assert_close(nft.loss, sft_loss(v_theta, x0, noise).loss)


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_step_pulls_good_samples_to_the_target_and_pushes_bad_ones_away(adaptive: bool):
    """From v_θ = v_old, one gradient step lowers the flow-matching error of the sample with r = 1 and
    raises that of the sample with r = 0 (fails if v⁺ and v⁻ or the sign of r are swapped)."""
    target = NOISE - X0
    v_old = target + torch.tensor([[0.5, -0.5], [0.5, -0.5]])
    v = v_old.clone().requires_grad_(True)
    r = torch.tensor([1.0, 0.0])
    nft_loss(v, v_old, X0, NOISE, SIGMA, r, beta=1.0, adaptive=adaptive).loss.backward()
    stepped = v.detach() - 0.1 * v.grad
    before = (v_old - target).pow(2).mean(dim=1)
    after = (stepped - target).pow(2).mean(dim=1)
    assert after[0] < before[0] and after[1] > before[1]


def test_old_policy_decay_follows_upstreams_schedules():
    type1 = {"flat_steps": 0, "rate": 1e-3, "max_decay": 0.5}
    assert old_policy_decay(0, **type1) == 0.0
    assert old_policy_decay(100, **type1) == pytest.approx(0.1)
    assert old_policy_decay(600, **type1) == 0.5  # 0.6 capped
    type2 = {"flat_steps": 75, "rate": 7.5e-3, "max_decay": 0.999}
    assert old_policy_decay(74, **type2) == 0.0
    assert old_policy_decay(175, **type2) == pytest.approx(0.75)  # 100 · 7.5e-3
    assert old_policy_decay(300, **type2) == 0.999  # 1.6875 capped


def test_subset_indices_are_distinct_schedule_positions():
    gen = torch.Generator().manual_seed(3)
    seen = set()
    for _ in range(50):
        idx = subset_timestep_indices(10, 9, gen)
        assert idx.dtype == torch.int64 and len(set(idx.tolist())) == 9
        assert idx.min() >= 0 and idx.max() <= 9
        seen |= set(range(10)) - set(idx.tolist())  # the one left out
    assert seen == set(range(10))  # every position is sometimes left out
