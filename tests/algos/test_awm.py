"""Advantage Weighted Matching (``algos/awm.py``): hand-computed losses per weighting, the reduction to
SFT when every advantage is equal, the regularisers, the direction of one step, and AWM's σ strata."""

from __future__ import annotations

import pytest
import torch

from rlgen_cli.algos.awm import awm_loss, stratified_timestep_indices
from rlgen_cli.algos.sft import sft_loss

# targets ε − x₀ = [[1, 1], [0, 2]]; v − target = [[2, 0], [1, 0]] → e = [2, 0.5]
X0 = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
NOISE = torch.ones(2, 2)
V = torch.tensor([[3.0, 1.0], [1.0, 2.0]])
SIGMA = torch.tensor([0.5, 1.0])
ADV = torch.tensor([1.0, -0.5])


@pytest.mark.parametrize(
    "weighting,expected",
    [
        ("uniform", 0.875),  # mean(1·2, −0.5·0.5)
        ("t", 0.375),  # ρ = σ·e = [1, 0.5]: mean(1, −0.25)
        ("t2", 0.125),  # ρ = σ²·e = [0.5, 0.5]: mean(0.5, −0.25)
        # ρ = σ·((e + 1e-10)^¼ − 1e-10^¼)·4: 2^¼ = 1.189207115, 0.5^¼ = 0.840896415, 1e-10^¼ = 0.003162278
        # → [0.5·4·1.186044837, 1·4·0.837734137] = [2.372089674, 3.350936548]; mean(2.372…, −1.675…)
        ("ghuber", 0.348310700),
    ],
)
def test_policy_loss_per_weighting_matches_hand_computation(weighting: str, expected: float):
    out = awm_loss(V, X0, NOISE, SIGMA, ADV, weighting=weighting, power=0.25)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.stats["fm_error_mean"] == pytest.approx(1.25)
    assert out.stats["advantage_abs_mean"] == pytest.approx(0.75)


def test_regularisers_pull_towards_the_reference_and_the_old_policy():
    target = NOISE - X0
    out = awm_loss(
        V, X0, NOISE, SIGMA, ADV, v_ref=target, kl_weight=0.1, v_old=torch.zeros_like(V), old_weight=0.2
    )
    # kl = mean((v − target)²) = mean(4, 0, 1, 0) = 1.25; old = mean(v²) = mean(9, 1, 1, 4) = 3.75
    assert out.kl_loss.item() == pytest.approx(1.25)
    assert out.old_loss.item() == pytest.approx(3.75)
    assert out.loss.item() == pytest.approx(0.875 + 0.1 * 1.25 + 0.2 * 3.75)


def test_equal_advantages_reduce_to_the_sft_flow_matching_loss():
    gen = torch.Generator().manual_seed(0)
    x0, noise, v, v_ref = (torch.randn(4, 3, 2, generator=gen) for _ in range(4))
    sigma = torch.rand(4, generator=gen)
    ones = torch.ones(4)
    awm = awm_loss(v, x0, noise, sigma, ones, v_ref=v_ref, kl_weight=0.3)
    torch.testing.assert_close(awm.loss, sft_loss(v, x0, noise, v_base=v_ref, anchor_weight=0.3).loss)
    # a constant advantage c scales the matching term by c
    scaled = awm_loss(v, x0, noise, sigma, 2.5 * ones)
    torch.testing.assert_close(scaled.loss, 2.5 * sft_loss(v, x0, noise).loss)


@pytest.mark.parametrize("weighting", ["uniform", "ghuber"])
def test_a_step_imitates_good_samples_and_unlearns_bad_ones(weighting: str):
    v = V.clone().requires_grad_(True)
    awm_loss(v, X0, NOISE, SIGMA, ADV, weighting=weighting).loss.backward()
    stepped = v.detach() - 0.05 * v.grad
    target = NOISE - X0
    before, after = ((w - target).pow(2).mean(dim=1) for w in (V, stepped))
    assert after[0] < before[0] and after[1] > before[1]  # A = +1 imitated, A = −0.5 pushed away


def test_stratified_indices_take_one_per_stratum_and_skip_pure_noise():
    # T = 14, fraction 0.9: int(12.6) = 12; linspace(1, 12, 7) floored = [1, 2, 4, 6, 8, 10, 12]
    strata = [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    gen = torch.Generator().manual_seed(4)
    draws = torch.stack([stratified_timestep_indices(14, 6, 0.9, gen) for _ in range(200)])  # (200, 6)
    for k, (lo, hi) in enumerate(strata):
        assert set(draws[:, k].tolist()) == set(range(lo, hi))
