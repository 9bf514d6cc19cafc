"""DGPO (``algos/dgpo.py``): hand-computed group weights, loss, gradient and clip; the surrogate's gradient
is the group-level DPO objective's; the truncated σ draw stays in its range."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos.dgpo import dgpo_loss, group_weights, truncated_timestep_indices
from rlgen_cli.algos.dpo import flow_matching_error
from rlgen_cli.recipes.flow_dgpo import group_stream_keys

EPS = torch.finfo(torch.float32).eps


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_group_weights_by_hand():
    # groups 7 and 3 interleaved; β/G = 10/2 = 5
    # group 7: 5·(1·0.1 + (−1)·0.3) = −1;  group 3: 5·(2·0.05 + (−2)·(−0.05)) = +1
    advantages = torch.tensor([1.0, 2.0, -1.0, -2.0])
    deltas = torch.tensor([0.1, 0.05, 0.3, -0.05])
    ids = torch.tensor([7, 3, 7, 3])
    got = group_weights(advantages, deltas, ids, beta=10.0, group_size=2)
    expected = torch.tensor([_sigmoid(-1), _sigmoid(1), _sigmoid(-1), _sigmoid(1)], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=4 * EPS)


def test_group_weights_per_trained_sigma():
    """A trailing σ dimension: each column is its own group sum (column 1 = column 0 negated)."""
    advantages = torch.tensor([1.0, -1.0])
    deltas = torch.tensor([[0.2, -0.2], [0.0, 0.0]])  # (N, K)
    got = group_weights(advantages, deltas, torch.tensor([0, 0]), beta=5.0, group_size=2)  # 2.5·(±0.2)
    expected = torch.tensor([[_sigmoid(0.5), _sigmoid(-0.5)]] * 2, dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=4 * EPS)


def test_a_partial_group_is_refused():
    with pytest.raises(ValueError, match=r"groups \[1\] have \[1\] samples here, not group_size=2"):
        group_weights(torch.ones(3), torch.ones(3), torch.tensor([0, 0, 1]), beta=1.0, group_size=2)


def _batch():
    x0 = torch.zeros(2, 2)
    noise = torch.ones(2, 2)  # target ε − x₀ = 1
    v = torch.tensor([[1.0, 3.0], [2.0, 2.0]], requires_grad=True)  # e = [(0 + 4)/2, (1 + 1)/2] = [2, 1]
    return v, x0, noise, torch.tensor([1.0, -1.0]), torch.tensor([0.25, 0.75])


def test_loss_and_gradient_by_hand():
    v, x0, noise, adv, w = _batch()
    v_ref = (v - 0.5).detach()  # mean((v − v_ref)²) = 0.25
    out = dgpo_loss(v, x0, noise, adv, w, v_ref=v_ref, kl_weight=0.1)
    # policy: mean(w·A·e) = (0.25·1·2 + 0.75·(−1)·1)/2 = −0.125; + 0.1·0.25
    assert out.policy_loss.item() == pytest.approx(-0.125, abs=4 * EPS)
    assert out.kl_loss.item() == pytest.approx(0.25, abs=4 * EPS)
    assert out.loss.item() == pytest.approx(-0.1, abs=4 * EPS)
    out.loss.backward()
    # policy: ∂/∂v_i = w_i·A_i/B · 2(v_i − 1)/D (B = D = 2); KL: 0.1·2·0.5/4 = 0.025 everywhere
    expected = torch.tensor([[0.0, 0.25], [-0.375, -0.375]]) + 0.025
    torch.testing.assert_close(v.grad, expected, rtol=0, atol=4 * EPS)
    assert out.stats == pytest.approx({"fm_error_mean": 1.5, "group_weight_mean": 0.5, "clip_fraction": 0.0})


@pytest.mark.parametrize(
    "old_errors,clipped",
    [
        ([2.5, 1.0], [True, False]),  # ratio exp(0.5) > 1.1 with A > 0; exp(0) = 1 not < 0.9 with A < 0
        ([2.0, 0.5], [False, True]),  # ratio 1 with A > 0; exp(−0.5) < 0.9 with A < 0
    ],
)
def test_the_clip_detaches_samples_that_moved_far_enough(old_errors, clipped):
    v, x0, noise, adv, w = _batch()
    out = dgpo_loss(v, x0, noise, adv, w, old_errors=torch.tensor(old_errors), clip_range=0.1)
    assert out.policy_loss.item() == pytest.approx(-0.125, abs=4 * EPS)  # the value is unchanged
    out.loss.backward()
    unclipped = torch.tensor([[0.0, 0.25], [-0.375, -0.375]])
    expected = torch.where(torch.tensor(clipped).view(-1, 1), torch.zeros(()), unclipped)
    torch.testing.assert_close(v.grad, expected, rtol=0, atol=4 * EPS)
    assert out.stats["clip_fraction"] == pytest.approx(sum(clipped) / 2)


def test_the_surrogate_has_the_group_dpo_objectives_gradient():
    """∇ Σ_g −log σ(−S_g) = (β·B/G)·∇ mean(σ(S_g)·A·e), S_g = (β/G)·Σ A_i·(e_i − e_ref,i)."""
    g = torch.Generator().manual_seed(0)
    group_size, groups, beta = 3, 2, 4.0
    n = group_size * groups
    x0, noise = torch.randn(n, 2, 3, generator=g), torch.randn(n, 2, 3, generator=g)
    v0 = noise - x0 + 0.5 * torch.randn(n, 2, 3, generator=g)
    v_ref = noise - x0 + 0.5 * torch.randn(n, 2, 3, generator=g)
    adv = torch.tensor([1.0, -0.5, -0.5, 2.0, -1.0, -1.0])
    ids = torch.arange(groups).repeat_interleave(group_size)
    e_ref = flow_matching_error(v_ref, x0, noise)

    v = v0.clone().requires_grad_(True)
    s = (beta / group_size) * (adv * (flow_matching_error(v, x0, noise) - e_ref)).view(groups, -1).sum(1)
    (-torch.nn.functional.logsigmoid(-s)).sum().backward()

    u = v0.clone().requires_grad_(True)
    with torch.no_grad():
        w = group_weights(
            adv, flow_matching_error(u, x0, noise) - e_ref, ids, beta=beta, group_size=group_size
        )
    dgpo_loss(u, x0, noise, adv, w.float()).loss.backward()
    torch.testing.assert_close(v.grad, u.grad * (beta * n / group_size), rtol=1e-5, atol=1e-6)


def test_truncated_indices_stay_in_the_head_of_the_schedule():
    """4 distinct of [0, int(10·0.6)] = [0, 6]; over many draws every one of 0…6 appears, none above."""
    seen = set()
    for seed in range(60):
        drawn = truncated_timestep_indices(10, 4, 0.6, torch.Generator().manual_seed(seed)).tolist()
        assert len(set(drawn)) == 4 and all(0 <= i <= 6 for i in drawn), drawn
        seen.update(drawn)
    assert seen == set(range(7))


def test_group_members_share_one_stream_key():
    """Groups of 4 sit in a row of the global batch: keys are each group's first place."""
    positions = torch.tensor([4, 5, 6, 7, 12, 13])  # one process's share
    assert group_stream_keys(positions, 4) == [4, 4, 4, 4, 12, 12]
