"""Hand-computed checks of group advantages and multi-reward aggregation (rlgen_cli.algos.advantages)."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos import AdvantageStats, combine_rewards, group_advantages, group_moments
from rlgen_cli.errors import UserError
from rlgen_cli.tasks.common import validated
from tests.schema.test_compose import _compose

EPS = 1e-4


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_two_groups_hand_zscores() -> None:
    # group 0: [1, 3]      -> mean 2, population std 1            -> A = ∓1 / (1 + 1e-4)
    # group 1: [10, 20, 30] -> mean 20, var (100+0+100)/3 = 200/3  -> A = [-10, 0, 10] / (sqrt(200/3) + 1e-4)
    adv, stats = group_advantages(_t([1, 3, 10, 20, 30]), _ids([0, 0, 1, 1, 1]))
    s1 = math.sqrt(200 / 3)
    expected = _t([-1 / (1 + EPS), 1 / (1 + EPS), -10 / (s1 + EPS), 0.0, 10 / (s1 + EPS)])
    torch.testing.assert_close(adv, expected)
    # stats: 2 groups of 2 and 3 -> mean size 2.5; reward mean 64/5 = 12.8;
    # var = mean(r²) − 12.8² = (1+9+100+400+900)/5 − 163.84 = 282 − 163.84 = 118.16
    assert stats == AdvantageStats(
        num_groups=2,
        mean_group_size=2.5,
        zero_std_ratio=0.0,
        reward_mean=pytest.approx(12.8),
        reward_std=pytest.approx(math.sqrt(118.16)),
    )


def test_global_std() -> None:
    # rewards [1, 3 | 5, 7]: group means 2 and 6 -> centered [-1, 1, -1, 1]
    # global mean 4, population var (9+1+1+9)/4 = 5 -> A = [-1, 1, -1, 1] / (sqrt(5) + 1e-4)
    adv, _ = group_advantages(_t([1, 3, 5, 7]), _ids([0, 0, 1, 1]), global_std=True)
    torch.testing.assert_close(adv, _t([-1, 1, -1, 1]) / (math.sqrt(5) + EPS))


def test_clip_extreme_value() -> None:
    # 49 zeros and one 1 in one group: mean 0.02, population std sqrt(0.02·0.98) = 0.14
    # outlier: 0.98 / 0.1401 ≈ 6.995 > 5 -> clipped to 5; the zeros: −0.02 / 0.1401 ≈ −0.1428 (untouched)
    rewards = torch.zeros(50, dtype=torch.float64)
    rewards[17] = 1.0
    ids = torch.zeros(50, dtype=torch.int64)
    adv, _ = group_advantages(rewards, ids)
    assert adv[17].item() == 5.0
    torch.testing.assert_close(adv[0], torch.tensor(-0.02 / (0.14 + EPS), dtype=torch.float64))
    # clip disabled by None or a non-positive bound
    for off in (None, 0.0, -1.0):
        raw, _ = group_advantages(rewards, ids, clip_max=off)
        torch.testing.assert_close(raw[17], torch.tensor(0.98 / (0.14 + EPS), dtype=torch.float64))


def test_shuffled_noncontiguous_ids_match_sorted() -> None:
    rewards = _t([1, 3, 10, 20, 30, 4, 8])
    ids = _ids([7, 7, 42, 42, 42, 3, 3])
    ref, ref_stats = group_advantages(rewards, ids)
    perm = torch.tensor([4, 0, 6, 2, 5, 1, 3])
    adv, stats = group_advantages(rewards[perm], ids[perm])
    torch.testing.assert_close(adv, ref[perm])
    assert stats.num_groups == ref_stats.num_groups == 3


def test_zero_variance_group_gives_exact_zeros() -> None:
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004 so a naive mean differs from 0.1; the result must still be 0.
    # group 9: [1, 3] -> ∓1/(1+1e-4). One of two groups is constant -> zero_std_ratio 0.5.
    adv, stats = group_advantages(_t([0.1, 0.1, 0.1, 1, 3]), _ids([5, 5, 5, 9, 9]))
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(adv[3:], _t([-1, 1]) / (1 + EPS))
    assert stats.zero_std_ratio == 0.5
    # also exact zeros with the global std and with tiny eps
    adv_g, _ = group_advantages(_t([0.1, 0.1, 0.1, 1, 3]), _ids([5, 5, 5, 9, 9]), global_std=True, eps=0.0)
    assert adv_g[:3].tolist() == [0.0, 0.0, 0.0]


def test_singleton_group() -> None:
    # group 0 = [4] alone -> advantage 0, counts as zero-variance; group 1 = [1, 3] -> ∓1/(1+1e-4)
    adv, stats = group_advantages(_t([4, 1, 3]), _ids([0, 1, 1]))
    torch.testing.assert_close(adv, _t([0, -1 / (1 + EPS), 1 / (1 + EPS)]))
    assert stats.num_groups == 2
    assert stats.mean_group_size == 1.5
    assert stats.zero_std_ratio == 0.5


def test_scale_none_is_mean_centering() -> None:
    # group means 2 and 20 -> A = r − mean = [-1, 1, -10, 0, 10]; the default clip 5 then bounds ±10
    rewards, ids = _t([1, 3, 10, 20, 30]), _ids([0, 0, 1, 1, 1])
    adv, _ = group_advantages(rewards, ids, scale="none", clip_max=None)
    torch.testing.assert_close(adv, _t([-1, 1, -10, 0, 10]))
    clipped, _ = group_advantages(rewards, ids, scale="none")
    torch.testing.assert_close(clipped, _t([-1, 1, -5, 0, 5]))


def test_float32_in_float32_out() -> None:
    adv, _ = group_advantages(torch.tensor([1.0, 3.0]), _ids([0, 0]))
    assert adv.dtype == torch.float32


def test_group_moments_per_sample() -> None:
    mean, std, size = group_moments(_t([1, 3, 10, 20, 30]), _ids([1, 1, 0, 0, 0]))
    torch.testing.assert_close(mean, _t([2, 2, 20, 20, 20]))
    torch.testing.assert_close(std, _t([1, 1] + [math.sqrt(200 / 3)] * 3))
    assert size.tolist() == [2, 2, 3, 3, 3]


def test_nan_reward_raises_with_count_and_index() -> None:
    with pytest.raises(ValueError, match=r"2 NaN .*\[1, 3\]"):
        group_advantages(_t([1, float("nan"), 3, float("nan")]), _ids([0, 0, 1, 1]))


@pytest.mark.parametrize(
    ("rewards", "ids", "kwargs", "match"),
    [
        (_t([1, 2]), _ids([0]), {}, "one group id"),
        (_t([1, 2]), torch.tensor([0.0, 0.0]), {}, "integer"),
        (_t([]), _ids([]), {}, "empty"),
    ],
)
def test_bad_inputs_raise(rewards: torch.Tensor, ids: torch.Tensor, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, ids, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scale": "rank"},
        {"eps": -1.0},
        {"global_std": True, "scale": "none"},
        {"std_estimator": "sample"},
    ],
)
def test_bad_options_are_programming_errors(kwargs: dict) -> None:
    # the config boundary checks them (test_bad_advantage_options_name_the_key); here they fail an assert
    with pytest.raises(AssertionError):
        group_advantages(_t([1, 2]), _ids([0, 0]), **kwargs)


def test_combine_sum_then_normalize() -> None:
    # r = 1·a + 0.5·b = [1+0, 3+0, 0+1, 0+3] = [1, 3, 1, 3] -> each group mean 2, std 1 -> ∓1/(1+1e-4)
    comps = {"a": _t([1, 3, 0, 0]), "b": _t([0, 0, 2, 6])}
    adv, stats = combine_rewards(comps, {"a": 1.0, "b": 0.5}, _ids([0, 0, 1, 1]))
    torch.testing.assert_close(adv, _t([-1, 1, -1, 1]) / (1 + EPS))
    assert stats.reward_mean == pytest.approx(2.0)


def test_combine_normalize_then_sum() -> None:
    # a = [1, 3 | 0, 0] -> A_a = [∓1/(1+1e-4) | 0, 0]
    # b = [0, 0 | 2, 6] -> A_b = [0, 0 | ∓2/(2+1e-4)]   (group 1: mean 4, std 2)
    # A = 2·A_a + 0.5·A_b = [∓2/(1+1e-4) | ∓1/(2+1e-4)]
    comps = {"a": _t([1, 3, 0, 0]), "b": _t([0, 0, 2, 6])}
    weights = {"a": 2.0, "b": 0.5}
    ids = _ids([0, 0, 1, 1])
    adv, stats = combine_rewards(comps, weights, ids, mode="normalize_then_sum")
    torch.testing.assert_close(adv, _t([-2 / (1 + EPS), 2 / (1 + EPS), -1 / (2 + EPS), 1 / (2 + EPS)]))
    # the same inputs summed first: r = [2, 6 | 1, 3] -> [∓2/(2+1e-4) | ∓1/(1+1e-4)] — a different answer
    summed, _ = combine_rewards(comps, weights, ids)
    torch.testing.assert_close(summed, _t([-2 / (2 + EPS), 2 / (2 + EPS), -1 / (1 + EPS), 1 / (1 + EPS)]))
    assert stats.zero_std_ratio == 0.0  # every group has signal from some component


def test_normalize_then_sum_clips_after_the_sum() -> None:
    # A_a = A_b = ∓0.9999 (mean 2, std 1); sum = ∓1.9998, then clip 0.5 -> ∓0.5.
    # (clipping each component first would give ∓0.5 + ∓0.5 = ∓1.0)
    comps = {"a": _t([1, 3]), "b": _t([1, 3])}
    adv, _ = combine_rewards(
        comps, {"a": 1.0, "b": 1.0}, _ids([0, 0]), mode="normalize_then_sum", clip_max=0.5
    )
    torch.testing.assert_close(adv, _t([-0.5, 0.5]))


def test_normalize_then_sum_zero_std_needs_all_components_constant() -> None:
    # group 0: both constant -> zero; group 1: a varies -> has signal. ratio = 1/2
    comps = {"a": _t([1, 1, 0, 2]), "b": _t([5, 5, 3, 3])}
    adv, stats = combine_rewards(comps, {"a": 1.0, "b": 1.0}, _ids([0, 0, 1, 1]), mode="normalize_then_sum")
    assert adv[:2].tolist() == [0.0, 0.0]
    assert stats.zero_std_ratio == 0.5


def test_combine_key_mismatch_raises() -> None:
    comps = {"a": _t([1, 3]), "b": _t([0, 1])}
    with pytest.raises(ValueError, match=r"no weight for \['b'\].*without a component for \['c'\]"):
        combine_rewards(comps, {"a": 1.0, "c": 1.0}, _ids([0, 0]))


def test_combine_unknown_mode_is_a_programming_error() -> None:
    with pytest.raises(AssertionError, match="average"):
        combine_rewards({"a": _t([1, 3])}, {"a": 1.0}, _ids([0, 0]), mode="average")


def test_combine_nan_names_component() -> None:
    with pytest.raises(ValueError, match=r"component 'b'.*1 NaN"):
        combine_rewards({"a": _t([1, 3]), "b": _t([0, float("nan")])}, {"a": 1.0, "b": 1.0}, _ids([0, 0]))


# ------------------------------------------------------------------------- std estimator and eps (MixGRPO)

TINY = 1e-8


def test_unbiased_std_hand_values() -> None:
    # group 0: [1, 3]      -> mean 2, unbiased var (1 + 1)/1 = 2        -> A = ∓1/(√2 + 1e-8)
    # group 1: [10, 20, 30] -> mean 20, unbiased var (100 + 0 + 100)/2 = 100 -> A = [-10, 0, 10]/(10 + 1e-8)
    rewards, ids = _t([1, 3, 10, 20, 30]), _ids([0, 0, 1, 1, 1])
    adv, _ = group_advantages(rewards, ids, std_estimator="unbiased", eps=TINY)
    r2 = math.sqrt(2)
    expected = _t([-1 / (r2 + TINY), 1 / (r2 + TINY), -10 / (10 + TINY), 0.0, 10 / (10 + TINY)])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    # population on the same rewards: std 1 and √(200/3) -> larger by √(n/(n − 1)) = √2 and √1.5
    pop, _ = group_advantages(rewards, ids, std_estimator="population", eps=TINY)
    s1 = math.sqrt(200 / 3)
    torch.testing.assert_close(
        pop,
        _t([-1 / (1 + TINY), 1 / (1 + TINY), -10 / (s1 + TINY), 0.0, 10 / (s1 + TINY)]),
        rtol=0,
        atol=1e-12,
    )
    torch.testing.assert_close(pop[:2] / adv[:2], _t([r2, r2]), rtol=1e-7, atol=0)
    torch.testing.assert_close(
        pop[2] / adv[2], torch.tensor(math.sqrt(1.5), dtype=torch.float64), rtol=1e-7, atol=0
    )


def test_unbiased_global_std() -> None:
    # [1, 3 | 5, 7]: group-centered [-1, 1, -1, 1]; all four around 4: unbiased var (9+1+1+9)/3 = 20/3
    adv, _ = group_advantages(_t([1, 3, 5, 7]), _ids([0, 0, 1, 1]), global_std=True, std_estimator="unbiased")
    torch.testing.assert_close(adv, _t([-1, 1, -1, 1]) / (math.sqrt(20 / 3) + EPS))


def test_eps_matters_for_tiny_reward_spreads() -> None:
    # [0, 1e-6]: population std 5e-7. eps 1e-4 -> ±5e-7/(1.005e-4) = ±0.004975; eps 1e-8 -> ±5e-7/5.1e-7 = ±0.98039
    rewards, ids = _t([0.0, 1e-6]), _ids([0, 0])
    flow, _ = group_advantages(rewards, ids, eps=1e-4)
    mix, _ = group_advantages(rewards, ids, eps=1e-8)
    torch.testing.assert_close(flow, _t([-5e-7 / 1.005e-4, 5e-7 / 1.005e-4]))
    torch.testing.assert_close(mix, _t([-5e-7 / 5.1e-7, 5e-7 / 5.1e-7]))


def test_matches_the_mixgrpo_and_dancegrpo_rule() -> None:
    # MixGRPO / DanceGRPO: per group of 12, (r − r.mean()) / (r.std() + 1e-8), torch's unbiased std, float32
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(48, generator=gen)  # 4 groups of 12, in rollout order
    ids = torch.arange(4).repeat_interleave(12)
    expected = torch.cat([(g - g.mean()) / (g.std() + 1e-8) for g in rewards.view(4, 12)])
    adv, _ = group_advantages(rewards, ids, std_estimator="unbiased", eps=1e-8, clip_max=None)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)
    pop, _ = group_advantages(rewards, ids, eps=1e-8, clip_max=None)  # population: √(12/11) = 1.044 larger
    torch.testing.assert_close(pop, expected * math.sqrt(12 / 11), rtol=0, atol=1e-6)


def test_group_moments_unbiased_and_singletons() -> None:
    mean, std, size = group_moments(
        _t([1, 3, 10, 20, 30, 7]), _ids([1, 1, 0, 0, 0, 2]), std_estimator="unbiased"
    )
    torch.testing.assert_close(mean, _t([2, 2, 20, 20, 20, 7]))
    torch.testing.assert_close(std, _t([math.sqrt(2)] * 2 + [10.0] * 3 + [0.0]))  # a group of one: 0
    assert size.tolist() == [2, 2, 3, 3, 3, 1]


def test_normalize_then_sum_unbiased() -> None:
    # a = [1, 3 | 0, 0]: unbiased std √2 in group 0 -> A_a = [∓1/(√2 + ε) | 0, 0]
    # b = [0, 0 | 2, 6]: mean 4, unbiased var (4 + 4)/1 = 8 -> A_b = [0, 0 | ∓2/(√8 + ε)]
    # A = 2·A_a + 0.5·A_b
    comps = {"a": _t([1, 3, 0, 0]), "b": _t([0, 0, 2, 6])}
    adv, _ = combine_rewards(
        comps,
        {"a": 2.0, "b": 0.5},
        _ids([0, 0, 1, 1]),
        mode="normalize_then_sum",
        std_estimator="unbiased",
        eps=TINY,
    )
    a, b = 2 / (math.sqrt(2) + TINY), 1 / (math.sqrt(8) + TINY)
    torch.testing.assert_close(adv, _t([-a, a, -b, b]))


def test_unknown_std_estimator_is_a_programming_error() -> None:
    with pytest.raises(AssertionError, match="ddof1"):
        group_moments(_t([1, 2]), _ids([0, 0]), std_estimator="ddof1")


# --------------------------------------------------------------------------- what the algo configs select


def _algo(*overrides: str):
    """The validated algo section of ``rlgen train OVERRIDES``."""
    return validated(_compose("train", list(overrides))).algo


@pytest.mark.parametrize(
    ("algo", "scope", "estimator", "eps"),
    [
        ("grpo", True, "population", 1e-4),  # Flow-GRPO SD3/FLUX: batch-wide np.std + 1e-4
        ("grpo_fast_shapes", True, "population", 1e-4),  # the ShapesEval default keeps rlgen's numbers
        ("mix_grpo", False, "unbiased", 1e-8),
        ("mix_grpo_flash", False, "unbiased", 1e-8),
        ("dance", False, "unbiased", 1e-8),
        ("grpo_guard", False, "population", 1e-4),  # Flow-GRPO's per-prompt stat tracker
    ],
)
def test_algo_configs_pick_their_upstream_advantages(algo, scope, estimator, eps) -> None:
    cfg = _algo(f"algo={algo}")
    assert (cfg.global_std, cfg.std_estimator, cfg.adv_eps) == (scope, estimator, pytest.approx(eps))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (
            "algo.std_estimator=sample",
            "algo.std_estimator='sample' is not valid; choose one of population, unbiased",
        ),
        ("algo.adv_eps=-1e-3", "algo.adv_eps must be ≥ 0"),
    ],
)
def test_bad_advantage_options_name_the_key(override, match) -> None:
    with pytest.raises(UserError, match=match):
        _algo(override)
