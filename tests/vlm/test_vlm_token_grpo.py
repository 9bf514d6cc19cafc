"""Token-level GRPO loss: aggregations, clipping, sequence-level ratios, k3 KL — arithmetic in comments."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos.advantages import combine_rewards
from rlgen_cli.algos.token_grpo import (
    advantage_options,
    aggregate,
    k3_kl,
    log_importance_weights,
    token_grpo_loss,
)
from rlgen_cli.errors import UserError
from tests.vlm.conftest import compose_config

# Two sequences, T = 3: the first has 3 completion tokens, the second 1.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ADV = torch.tensor([2.0, -1.0])


@pytest.mark.parametrize(
    "loss_type,expected,kwargs",
    [
        # on-policy, β = 0: ℓ = −A per token → seq 0: [−2, −2, −2], seq 1: [+1]
        ("grpo", (-2.0 + 1.0) / 2, {}),  # per-sequence means −2 and +1, batch mean −0.5
        ("bnpo", (-6.0 + 1.0) / 4, {}),  # Σ = −5 over 4 tokens = −1.25
        ("dr_grpo", -5.0 / (2 * 4), {"max_completion_length": 4}),  # Σ / (B · L) = −0.625
        ("dapo", -5.0 / 10, {"num_items": 10}),  # Σ / tokens of the whole accumulated batch
        ("dapo", -5.0 / 4, {}),  # default num_items: this micro-batch's tokens
    ],
)
def test_aggregations_on_policy(loss_type, expected, kwargs):
    logp = torch.full((2, 3), -1.0)
    out = token_grpo_loss(logp, logp.clone(), ADV, MASK, loss_type=loss_type, **kwargs)
    assert out.loss.item() == pytest.approx(expected)
    assert out.stats["ratio_min"] == out.stats["ratio_max"] == 1.0
    assert out.stats["clipfrac"] == 0.0


def test_grpo_gradient_is_minus_advantage_over_length_and_batch():
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    token_grpo_loss(logp, logp.detach().clone(), ADV, MASK, loss_type="grpo").loss.backward()
    # d/dlogp of −r·A at r = 1 is −A; seq 0 divides by 3 tokens and 2 sequences, seq 1 by 1 and 2.
    expected = torch.tensor([[-2 / 6, -2 / 6, -2 / 6], [1 / 2, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected)


def test_clipping_with_epsilon_and_epsilon_high():
    old = torch.zeros(2, 1)
    mask = torch.ones(2, 1)
    adv = torch.tensor([1.0, -1.0])
    # r = 1.5 for both: A > 0 → min(1.5, 1.2) = 1.2 → ℓ = −1.2; A < 0 → min(−1.5, −1.2) = −1.5 → ℓ = +1.5
    out = token_grpo_loss(torch.full((2, 1), math.log(1.5)), old, adv, mask, loss_type="bnpo", epsilon=0.2)
    assert out.loss.item() == pytest.approx((-1.2 + 1.5) / 2)
    assert out.stats["clipfrac_high"] == pytest.approx(0.5) and out.stats["clipfrac_low"] == 0.0
    # ε_high = 0.28 and r = 1.25 with A > 0: not clipped → ℓ = −1.25
    out = token_grpo_loss(
        torch.full((1, 1), math.log(1.25)),
        torch.zeros(1, 1),
        torch.tensor([1.0]),
        torch.ones(1, 1),
        epsilon=0.2,
        epsilon_high=0.28,
    )
    assert out.loss.item() == pytest.approx(-1.25) and out.stats["clipfrac"] == 0.0
    # r = 0.5 with A = −1: min(−0.5, −0.8) = −0.8 → ℓ = 0.8, counted as low-clipped
    out = token_grpo_loss(
        torch.full((1, 1), math.log(0.5)), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1)
    )
    assert out.loss.item() == pytest.approx(0.8) and out.stats["clipfrac_low"] == 1.0


def test_sequence_level_ratio_is_the_geometric_mean_of_the_sequence():
    logp = torch.tensor([[math.log(2.0), 0.0, 5.0]])  # the third token is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    log_w = log_importance_weights(logp, torch.zeros(1, 3), mask, "sequence")
    assert log_w.shape == (1, 1) and log_w.item() == pytest.approx(math.log(2.0) / 2)  # r = √2
    out = token_grpo_loss(
        logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, importance_level="sequence", epsilon=1.0
    )
    assert out.loss.item() == pytest.approx(-math.sqrt(2.0))  # every token: −√2·A, token mean −√2
    with pytest.raises(AssertionError, match="word"):
        log_importance_weights(logp, logp, mask, "word")


def test_k3_kl_and_beta():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    # Δ = log 0.25 − log 0.5 = −log 2 → e^Δ − Δ − 1 = 0.5 + 0.6931 − 1 = 0.1931
    assert k3_kl(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)
    assert k3_kl(logp, logp).item() == 0.0
    out = token_grpo_loss(
        logp, logp.clone(), torch.tensor([0.0]), torch.ones(1, 1), kl_weight=0.04, ref_logp=ref
    )
    assert out.loss.item() == pytest.approx(0.04 * (0.5 + math.log(2) - 1))  # A = 0: only β·KL
    assert out.kl.item() == pytest.approx(0.5 + math.log(2) - 1)
    assert out.policy_loss.item() == 0.0
    with pytest.raises(AssertionError, match="ref_logp"):  # a programming error: the recipe passes it
        token_grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), kl_weight=0.1)


def test_padding_never_contributes():
    logp = torch.tensor([[-1.0, 100.0]], requires_grad=True)  # a huge log-ratio on a padded position
    out = token_grpo_loss(logp, torch.tensor([[-1.0, 0.0]]), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0) and logp.grad[0, 1] == 0.0
    assert out.stats["ratio_max"] == 1.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="shapes disagree"):
        token_grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(AssertionError, match="ppo"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "ppo")


# Two groups of G = 4 with the same spread: deviations from the group mean ±0.75 / ∓0.25, Σ dev² = 0.75.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 3.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def _advantages(scale_rewards: str, std_estimator: str) -> torch.Tensor:
    options = advantage_options(scale_rewards, std_estimator)
    adv, _ = combine_rewards({"r": REWARDS}, {"r": 1.0}, GROUPS, clip_max=0.0, **options)
    return adv


@pytest.mark.parametrize(
    "std_estimator,std",
    [("unbiased", math.sqrt(0.75 / 3)), ("population", math.sqrt(0.75 / 4))],  # 0.5 (torch.std) | 0.4330
)
def test_group_advantages_divide_by_the_chosen_std_plus_1e_4(std_estimator, std):
    big, small = 0.75 / (std + 1e-4), -0.25 / (std + 1e-4)  # unbiased: 1.49970, −0.49990
    expected = torch.tensor([big, small, small, small, small, small, small, big])
    assert torch.allclose(_advantages("group", std_estimator), expected, rtol=1e-6)


def test_unbiased_advantages_are_the_population_ones_over_sqrt_g_over_g_minus_1():
    ratio = _advantages("group", "population") / _advantages("group", "unbiased")
    assert torch.allclose(ratio, torch.full((8,), math.sqrt(4 / 3)), rtol=1e-3)  # 1.155 (eps aside)


def test_batch_scaling_uses_the_estimator_over_all_rewards():
    # mean 1.25, Σ (r − 1.25)² = 9.5: unbiased std √(9.5/7) = 1.16496, population √(9.5/8) = 1.08972
    for std_estimator, std in (("unbiased", math.sqrt(9.5 / 7)), ("population", math.sqrt(9.5 / 8))):
        assert _advantages("batch", std_estimator)[0].item() == pytest.approx(0.75 / (std + 1e-4), rel=1e-6)
    assert _advantages("none", "unbiased")[0].item() == pytest.approx(0.75)  # centred only


def test_advantage_options_assert_on_values_the_config_never_passes():
    # algo.token.scale_rewards is a Literal checked at the config boundary (tests/schema/test_choices.py)
    with pytest.raises(AssertionError, match="prompt"):
        advantage_options("prompt", "unbiased")


def test_step_grpo_is_r1vl_per_optimizer_step():
    algo = compose_config("train", ["model=qwen2_vl", "algo=step_grpo"])[0].algo
    micro_batches = algo.prompts_per_epoch * algo.group_size // algo.train_batch_size
    assert algo.train_batch_size * algo.gradient_accumulation_steps == 64  # 16 prompts × G = 4
    assert algo.group_size == 4 and micro_batches // algo.gradient_accumulation_steps == 1
    token = algo.token
    assert (algo.lr, algo.kl_weight, token.loss_type, token.std_estimator) == (1e-6, 0.04, "grpo", "unbiased")
    assert (token.temperature, token.max_completion_tokens, token.lr_schedule) == (1.2, 1024, "linear")


def test_a_bad_std_estimator_names_the_key():
    with pytest.raises(UserError, match="algo.token.std_estimator"):
        compose_config("train", ["model=qwen2_vl", "algo=step_grpo", "algo.token.std_estimator=sample"])
