"""GARDO's pieces (rlgen_cli/algos/gardo.py) on small tensors computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos import gardo

TOL = 64 * torch.finfo(torch.float64).eps  # the functions compute in float64


def test_descending_ranks_put_the_largest_first_and_keep_ties_in_order() -> None:
    assert gardo.descending_ranks(torch.tensor([0.2, 0.9, 0.5])).tolist() == [3.0, 1.0, 2.0]
    assert gardo.descending_ranks(torch.tensor([1.0, 1.0, 0.0])).tolist() == [1.0, 2.0, 3.0]


def test_rank_disagreement_is_the_proxy_rank_minus_the_mean_auxiliary_rank() -> None:
    proxy = torch.tensor([0.9, 0.1, 0.5, 0.3])  # ranks 1 4 2 3
    aux = [torch.tensor([0.1, 0.9, 0.5, 0.3]), torch.tensor([0.2, 0.8, 0.6, 0.4])]  # ranks 4 1 2 3 twice
    assert gardo.rank_disagreement(proxy, aux).tolist() == [-3.0, 3.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="auxiliary"):
        gardo.rank_disagreement(proxy, [])


def test_the_gate_passes_what_lies_above_the_percentile_of_the_non_negative_values() -> None:
    u = torch.tensor([1.0, 2.0, 3.0, 4.0, -1.0])  # non-negative 1 2 3 4
    # 75th percentile: position 0.75·3 = 2.25 → 3.25; 50th: 1.5 → 2.5 (the negative value is left out)
    assert gardo.uncertainty_gate(u, 0.25).tolist() == [False, False, False, True, False]
    assert gardo.uncertainty_gate(u, 0.5).tolist() == [False, False, True, True, False]
    # a threshold equal to a value leaves it out: the median of 0 0 3 is 0
    assert gardo.uncertainty_gate(torch.tensor([0.0, 0.0, 3.0]), 0.5).tolist() == [False, False, True]


def test_the_gate_fraction_rises_above_the_window_falls_below_it_and_is_clamped() -> None:
    f = gardo.GateFraction(base=0.1, rate=0.1, window=2)
    assert f.update(torch.tensor([1.0, 1.0, -5.0])) == pytest.approx(0.1, abs=TOL)  # first: the base
    assert f.update(torch.tensor([2.0])) == pytest.approx(0.11, abs=TOL)  # above every earlier level
    assert f.update(torch.tensor([0.5])) == pytest.approx(0.099, abs=TOL)  # below every one
    assert f.update(torch.tensor([1.5])) == pytest.approx(0.099, abs=TOL)  # between 2 and 0.5: unchanged
    assert f.history == [0.5, 1.5]  # the window keeps the last two
    high = gardo.GateFraction(base=0.19, high=0.2)
    high.update(torch.tensor([1.0]))
    assert high.update(torch.tensor([2.0])) == pytest.approx(0.2, abs=TOL)  # 0.209 clamped
    restored = gardo.GateFraction()
    restored.load_state_dict(f.state_dict())
    assert (restored.fraction, restored.history) == (f.fraction, f.history)


def test_gated_mean_averages_the_gated_samples_only() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert gardo.gated_mean(values, torch.tensor([False, True, False, True])).item() == 3.0
    none = torch.zeros(4, dtype=torch.bool)
    assert gardo.gated_mean(values, none).item() == 0.0
    assert gardo.gated_mean(values, none, when_none="all").item() == 2.5


def test_nearest_neighbour_distance_is_the_smallest_cosine_distance_within_the_group() -> None:
    features = torch.tensor([[1.0, 0.0], [3.0, 3.0], [-1.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    near = 1 - 1 / math.sqrt(2)  # [1, 0] to [3, 3]; [3, 3] to [-1, 0] is 1 + 1/√2, [1, 0] to [-1, 0] is 2
    expected = torch.tensor([near, near, 1 + 1 / math.sqrt(2), 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(gardo.nearest_neighbour_distance(features, groups), expected, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="one member"):
        gardo.nearest_neighbour_distance(features, torch.tensor([0, 0, 0, 1, 2]))


def test_diversity_scale_amplifies_the_diverse_samples_at_or_above_their_group_mean() -> None:
    near, far = 1 - 1 / math.sqrt(2), 1 + 1 / math.sqrt(2)
    distances = torch.tensor([near, near, far, 0.0, 0.0], dtype=torch.float64)
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 1.0])  # group 0 mean 2: the first is below it
    groups = torch.tensor([0, 0, 0, 1, 1])
    mean = (2 * near + far) / 3
    expected = torch.tensor(
        [1.0, near / mean, far / mean, 1.0, 1.0], dtype=torch.float64
    )  # group 1: no spread
    torch.testing.assert_close(gardo.diversity_scale(rewards, distances, groups), expected, atol=TOL, rtol=0)


def test_refresh_is_due_every_k_epochs_after_the_first() -> None:
    assert [e for e in range(10) if gardo.refresh_due(e, 3)] == [3, 6, 9]
    assert not any(gardo.refresh_due(e, 0) for e in range(10))


def test_gated_kl_weights_turn_a_batch_mean_into_the_gated_mean() -> None:
    kl = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    gate = torch.tensor([False, True, False, True])
    assert gardo.gated_kl_weights(gate).tolist() == [0.0, 2.0, 0.0, 2.0]
    assert (gardo.gated_kl_weights(gate) * kl).mean().item() == 3.0  # (2 + 4) / 2
    none = torch.zeros(4, dtype=torch.bool)
    assert gardo.gated_kl_weights(none).tolist() == [0.0] * 4
    assert gardo.gated_kl_weights(none, when_none="all").tolist() == [1.0] * 4


def test_gated_velocity_kl_averages_per_sample_squares_over_the_gated_samples() -> None:
    v = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 4.0]])
    v_ref = torch.zeros(3, 2)  # per-sample means of squares: 5, 4, 8
    assert gardo.gated_velocity_kl(v, v_ref, torch.tensor([True, False, True])).item() == 6.5
    assert gardo.gated_velocity_kl(v, v_ref, torch.zeros(3, dtype=torch.bool)).item() == pytest.approx(17 / 3)


def test_the_hooks_shape_advantages_by_diversity_then_clip_them_again() -> None:
    from rlgen_cli.recipes.gardo import GardoHooks
    from rlgen_cli.schema.gardo import GardoConfig

    hooks = GardoHooks(GardoConfig(diversity=True), "cpu")
    features = torch.tensor([[1.0, 0.0], [3.0, 3.0], [-1.0, 0.0]])  # distances near, near, far (above)
    advantages = torch.tensor([-1.2, 0.5, 0.7])
    shaped, stats = hooks.shape(advantages, torch.tensor([1.0, 2.0, 3.0]), features, torch.zeros(3), 1.5)
    near, far = 1 - 1 / math.sqrt(2), 1 + 1 / math.sqrt(2)
    mean = (2 * near + far) / 3
    expected = torch.tensor([-1.2, 0.5 * near / mean, 1.5])  # 0.7·far/mean = 1.56 clipped to 1.5
    torch.testing.assert_close(shaped, expected, atol=4 * torch.finfo(torch.float32).eps, rtol=0)
    assert stats["gardo/diversity_scale_max"] == pytest.approx(far / mean)
    unshaped, _ = hooks.shape(advantages, torch.tensor([1.0, 2.0, 3.0]), None, torch.zeros(3), 1.5)
    assert unshaped is advantages  # diversity off: no features, no change
