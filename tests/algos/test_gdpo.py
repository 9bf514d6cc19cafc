"""GDPO multi-reward advantages (``reward.aggregation=gdpo``), checked against hand-computed values.

GDPO normalises each reward within its group, sums them with the mix's weights and normalises the sum
over the whole batch: ``A = (S − mean(S)) / (std(S) + eps)``, ``S = Σ_k w_k·(r_k − mean_g r_k) / (std_g
r_k + eps)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos import combine_rewards
from rlgen_cli.errors import UserError
from rlgen_cli.tasks.common import validated
from tests.schema.test_compose import _compose

IDS_3 = torch.tensor([0, 0, 0, 1, 1, 1])


def _tol(dtype: torch.dtype) -> dict[str, float]:
    """A few ulps of ``dtype`` around values of order one."""
    eps = torch.finfo(dtype).eps
    return {"rtol": 16 * eps, "atol": 16 * eps}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_groups_of_three_unbiased_hand_values(dtype: torch.dtype) -> None:
    # group 0: a = [0, 1, 2] → (unbiased std 1) [−1, 0, 1]; b = [5, 3, 4] → [1, −1, 0]
    # group 1: a = [7, 7, 7] → [0, 0, 0] (constant);      b = [0, 10, 20] → [−1, 0, 1]
    # S = a + 0.5·b = [−0.5, −0.5, 1, −0.5, 0, 0.5]: mean 0, Σ S² = 2, unbiased batch std √(2/5)
    comps = {
        "a": torch.tensor([0, 1, 2, 7, 7, 7], dtype=dtype),
        "b": torch.tensor([5, 3, 4, 0, 10, 20], dtype=dtype),
    }
    adv, stats = combine_rewards(
        comps, {"a": 1.0, "b": 0.5}, IDS_3, mode="gdpo", std_estimator="unbiased", eps=0.0, clip_max=None
    )
    expected = torch.tensor([-0.5, -0.5, 1.0, -0.5, 0.0, 0.5], dtype=torch.float64) * math.sqrt(5 / 2)
    assert adv.dtype == dtype
    torch.testing.assert_close(adv.double(), expected, **_tol(dtype))
    assert stats.zero_std_ratio == 0.0  # group 1 still has b's signal


def test_two_groups_of_four_population_hand_values_with_eps() -> None:
    # population std, eps 1e-4 at both steps (Flow-Factory's choice of estimator, rlgen's eps)
    # group 0: a = [0, 0, 1, 1] → mean ½, std ½ → ±½/(½+ε); b = [2, 2, 2, 2] → 0
    # group 1: a = [3, 3, 3, 3] → 0;                  b = [0, 4, 0, 4] → mean 2, std 2 → ±2/(2+ε)
    eps = 1e-4
    comps = {"a": torch.tensor([0.0, 0, 1, 1, 3, 3, 3, 3]), "b": torch.tensor([2.0, 2, 2, 2, 0, 4, 0, 4])}
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, _ = combine_rewards(comps, {"a": 2.0, "b": 1.0}, ids, mode="gdpo", eps=eps, clip_max=None)
    u = 2.0 * 0.5 / (0.5 + eps)  # a's weighted advantage
    v = 1.0 * 2.0 / (2.0 + eps)  # b's weighted advantage
    pre = torch.tensor([-u, -u, u, u, -v, v, -v, v], dtype=torch.float64)  # batch mean 0
    batch_std = math.sqrt((4 * u * u + 4 * v * v) / 8)  # population
    expected = pre / (batch_std + eps)
    torch.testing.assert_close(adv.double(), expected, **_tol(torch.float32))
    # normalize_then_sum stops at the weighted sum: here a (weight 2) weighs twice b after it too
    summed, _ = combine_rewards(comps, {"a": 2.0, "b": 1.0}, ids, mode="normalize_then_sum", eps=eps)
    torch.testing.assert_close(summed.double(), pre, **_tol(torch.float32))


def test_constant_groups_stay_exactly_zero_and_clip_comes_last() -> None:
    # group 1 has no signal in any reward: exactly 0 after the batch step, whatever its rounding
    comps = {"a": torch.tensor([0.0, 0.0, 0.0, 1.0, 0.1, 0.1]), "b": torch.tensor([1.0, 0, 0, 2, 2, 2])}
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    adv, stats = combine_rewards(comps, {"a": 1.0, "b": 1.0}, ids, mode="gdpo", clip_max=None)
    assert adv[4:].tolist() == [0.0, 0.0]
    assert stats.zero_std_ratio == 0.5
    clipped, _ = combine_rewards(comps, {"a": 1.0, "b": 1.0}, ids, mode="gdpo", clip_max=1.0)
    torch.testing.assert_close(clipped, adv.clamp(-1.0, 1.0), rtol=0, atol=0)
    assert float(adv.abs().max()) > 1.0  # the clip had something to cut


def test_a_reward_of_large_scale_does_not_drown_the_other() -> None:
    # one group of four: the quality reward spans 0..300, the constraint reward 0/1 (sample 2 breaks it).
    # Summed, the constraint barely moves the ranking: sample 2 keeps a positive advantage. GDPO
    # normalises each reward first: sample 2's constraint violation (−1.73 z) outweighs its quality (+0.45 z).
    quality = torch.tensor([0.0, 100.0, 200.0, 300.0])
    constraint = torch.tensor([1.0, 1.0, 0.0, 1.0])
    comps, weights, ids = (
        {"q": quality, "c": constraint},
        {"q": 1.0, "c": 1.0},
        torch.zeros(4, dtype=torch.long),
    )
    summed, _ = combine_rewards(comps, weights, ids, mode="sum_then_normalize", clip_max=None)
    gdpo, _ = combine_rewards(comps, weights, ids, mode="gdpo", clip_max=None)
    assert float(summed[2]) > 0.0
    # hand: q → [−3, −1, 1, 3]/√5, c → [1, 1, −3, 1]/√3 (population, eps negligible); sample 2: 1/√5 − 3/√3 < 0
    assert float(gdpo[2]) < 0.0
    assert int(gdpo.argmax()) == 3 and int(gdpo.argmin()) == 2


def test_gdpo_is_unchanged_by_rescaling_a_reward() -> None:
    # GDPO sees each reward's ranks within the group; multiplying one by 1000 changes nothing (eps 0)
    a = torch.tensor([0.0, 1.0, 3.0, 2.0, 5.0, 4.0], dtype=torch.float64)
    b = torch.tensor([1.0, 0.0, 0.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    opts = {"mode": "gdpo", "eps": 0.0, "clip_max": None}
    base, _ = combine_rewards({"a": a, "b": b}, {"a": 1.0, "b": 1.0}, IDS_3, **opts)
    scaled, _ = combine_rewards({"a": 1000 * a + 7, "b": b}, {"a": 1.0, "b": 1.0}, IDS_3, **opts)
    torch.testing.assert_close(scaled, base, **_tol(torch.float64))
    summed, _ = combine_rewards({"a": 1000 * a, "b": b}, {"a": 1.0, "b": 1.0}, IDS_3, eps=0.0, clip_max=None)
    assert not torch.allclose(summed, base, atol=0.05)  # the summed baseline does depend on the scale


# --------------------------------------------------------------------------- the config option


@pytest.mark.parametrize(
    "overrides",
    [
        ["experiment=shapes_grpo_fast"],  # flow_grpo
        ["experiment=shapes_nft"],  # flow_forward (DiffusionNFT)
        ["experiment=shapes_nft", "algo=awm"],  # flow_forward (AWM)
        ["model=tiny_qwen2_vl", "algo=token_grpo", "reward=length"],  # vlm_rl
    ],
)
def test_every_advantage_recipe_accepts_gdpo(overrides: list[str]) -> None:
    cfg = validated(_compose("train", [*overrides, "reward.aggregation=gdpo"]))
    assert cfg.reward.aggregation == "gdpo"


def test_a_misspelt_aggregation_lists_gdpo() -> None:
    with pytest.raises(UserError, match="sum_then_normalize, normalize_then_sum, gdpo"):
        validated(_compose("train", ["reward.aggregation=gpdo"]))
