"""Hand-computed checks of Flow-DPO (rlgen_cli.algos.dpo) and reward-filtered SFT (rlgen_cli.algos.sft)."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos import (
    NUM_TRAIN_TIMESTEPS,
    dpo_loss,
    flow_matching_error,
    preference_pairs,
    sample_dpo_sigmas,
    select_best,
    sft_loss,
)

E = math.e


def _t(values: list, grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# Shared batch: groups (ids need not be sorted or contiguous)
#   id 5: idx 0..2 rewards [0.1, 0.9, 0.5]      id 2: idx 3..4 [2, 2] (constant)
#   id 9: idx 5    [7] (singleton)              id 0: idx 6..9 [3, 1, 3, 1] (ties)
REWARDS = [0.1, 0.9, 0.5, 2.0, 2.0, 7.0, 3.0, 1.0, 3.0, 1.0]
GROUPS = [5, 5, 5, 2, 2, 9, 0, 0, 0, 0]

# flow-matching fixture: target ε − x₀ = [[1, 1], [0, 0]]; v − target = [[0, 1], [0, 0]]
# -> per-sample error mean over 2 elements: [(0 + 1)/2, 0] = [0.5, 0]
V = [[1.0, 2.0], [0.0, 0.0]]
X0 = [[0.0, 0.0], [1.0, 1.0]]
NOISE = [[1.0, 1.0], [1.0, 1.0]]


# --------------------------------------------------------------------------------------------------
# flow_matching_error / sample_dpo_sigmas
# --------------------------------------------------------------------------------------------------


def test_flow_matching_error_by_hand() -> None:
    torch.testing.assert_close(flow_matching_error(_t(V), _t(X0), _t(NOISE)), _t([0.5, 0.0]))


def test_flow_matching_error_upcasts_bf16_and_checks_shapes() -> None:
    err = flow_matching_error(_t(V).bfloat16(), _t(X0).bfloat16(), _t(NOISE).bfloat16())
    assert err.dtype == torch.float32
    torch.testing.assert_close(err, torch.tensor([0.5, 0.0]))
    with pytest.raises(ValueError, match="share"):
        flow_matching_error(_t(V), _t(X0)[:1], _t(NOISE))


def test_sample_dpo_sigmas_indexes_the_table_with_logit_normal_u() -> None:
    # table[k] = k, so σ = ⌊1000·sigmoid(z)⌋ for the generator's standard normal z
    table = torch.arange(NUM_TRAIN_TIMESTEPS, dtype=torch.float64)
    sig = sample_dpo_sigmas(5, table, torch.Generator().manual_seed(3))
    z = torch.randn(5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close(sig, torch.floor(1000 * torch.sigmoid(z)))
    # logit-normal(0, 1) is symmetric around u = 0.5 -> mean index ≈ 499.5 (std of the mean ≈ 0.7)
    many = sample_dpo_sigmas(20_000, table, torch.Generator().manual_seed(0))
    assert many.min() >= 0 and many.max() <= 999
    assert abs(many.mean().item() - 499.5) < 5


def test_sample_dpo_sigmas_rejects_inference_schedule() -> None:
    with pytest.raises(ValueError, match="training schedule of 1000"):
        sample_dpo_sigmas(4, torch.linspace(1, 0, 41))
    with pytest.raises(ValueError, match="n must be"):
        sample_dpo_sigmas(0, torch.zeros(NUM_TRAIN_TIMESTEPS))


# --------------------------------------------------------------------------------------------------
# preference_pairs / select_best
# --------------------------------------------------------------------------------------------------


def test_preference_pairs_argmax_argmin_skip_constant() -> None:
    # ascending ids: 0 -> max 3 first at idx 6, min 1 first at idx 7; 2 -> constant, skipped;
    # 5 -> max 0.9 at idx 1, min 0.1 at idx 0; 9 -> singleton, skipped
    pairs = preference_pairs(_t(REWARDS), _ids(GROUPS))
    assert pairs.chosen.tolist() == [6, 1]
    assert pairs.rejected.tolist() == [7, 0]
    assert pairs.num_skipped == 2
    chosen, rejected, skipped = pairs
    assert chosen.dtype == rejected.dtype == torch.int64 and skipped == 2


def test_preference_pairs_rejects_nan() -> None:
    with pytest.raises(ValueError, match="NaN"):
        preference_pairs(_t([1.0, float("nan")]), _ids([0, 0]))


def test_select_best_top1_and_top2() -> None:
    # top 1 per group, ids ascending: 0 -> idx 6 (tie 3 vs 3 -> lower index), 2 -> 3 (tie), 5 -> 1, 9 -> 5
    assert select_best(_t(REWARDS), _ids(GROUPS)).tolist() == [6, 3, 1, 5]
    # top 2: 0 -> [6, 8], 2 -> [3, 4], 5 -> [1 (0.9), 2 (0.5)], 9 -> [5] (group smaller than k)
    assert select_best(_t(REWARDS), _ids(GROUPS), top_k=2).tolist() == [6, 8, 3, 4, 1, 2, 5]
    with pytest.raises(ValueError, match="top_k"):
        select_best(_t(REWARDS), _ids(GROUPS), top_k=0)


# --------------------------------------------------------------------------------------------------
# dpo_loss
# --------------------------------------------------------------------------------------------------


def test_dpo_loss_by_hand() -> None:
    # β = 2 -> β/2 = 1
    # pair 0: (e_θʷ − e_refʷ) − (e_θˡ − e_refˡ) = (1 − 2) − (3 − 3) = −1 -> logit 1  -> −log σ(1)  = log(1 + e⁻¹)
    # pair 1: (2 − 1) − (1 − 2) = 2                                      -> logit −2 -> −log σ(−2) = log(1 + e²)
    out = dpo_loss(_t([1.0, 2.0]), _t([3.0, 1.0]), _t([2.0, 1.0]), _t([3.0, 2.0]), beta=2.0)
    assert out.loss.item() == pytest.approx((math.log(1 + 1 / E) + math.log(1 + E**2)) / 2)
    assert out.stats["implicit_acc"] == pytest.approx(0.5)  # only pair 0 has inner < 0
    # implicit rewards −(β/2)(e_θ − e_ref): chosen [1, −1], rejected [0, 1]; margins [1, −2]
    assert out.stats["reward_chosen"] == pytest.approx(0.0)
    assert out.stats["reward_rejected"] == pytest.approx(0.5)
    assert out.stats["reward_margin"] == pytest.approx(-0.5)
    assert out.stats["err_policy_chosen"] == pytest.approx(1.5)
    assert out.stats["err_policy_rejected"] == pytest.approx(2.0)
    assert out.stats["err_ref_chosen"] == pytest.approx(1.5)
    assert out.stats["err_ref_rejected"] == pytest.approx(2.5)


def test_dpo_policy_equal_reference_gives_log2() -> None:
    # inner = 0 -> −log σ(0) = log 2; a tie is not an implicit win
    e = _t([0.3, 0.7])
    out = dpo_loss(e, e.flip(0), e, e.flip(0), beta=100.0)
    assert out.loss.item() == pytest.approx(math.log(2))
    assert out.stats["implicit_acc"] == 0.0


def test_dpo_gradients_and_reference_constant() -> None:
    # L = mean(softplus((β/2)·inner)); dL/d inner_p = (β/2)·σ((β/2)·inner_p) / P
    # pair 0 of the hand test: β/2 = 1, inner −1, P = 1 -> dL/d e_θʷ = σ(−1) = 1/(1 + e), dL/d e_θˡ = −1/(1 + e)
    ew, el = _t([1.0], grad=True), _t([3.0], grad=True)
    rw, rl = _t([2.0], grad=True), _t([3.0], grad=True)
    dpo_loss(ew, el, rw, rl, beta=2.0).loss.backward()
    torch.testing.assert_close(ew.grad, _t([1 / (1 + E)]))
    torch.testing.assert_close(el.grad, _t([-1 / (1 + E)]))
    assert rw.grad is None and rl.grad is None


def test_dpo_large_beta_is_stable() -> None:
    # β = 1e4, inner = 1 -> logit −5000 -> loss softplus(5000) = 5000 (no overflow to inf)
    out = dpo_loss(_t([2.0]), _t([1.0]), _t([1.0]), _t([1.0]), beta=1e4)
    assert out.loss.item() == pytest.approx(5000.0)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((_t([1.0, 2.0]), _t([1.0]), _t([1.0]), _t([1.0])), {}, "share one"),
        ((_t([]), _t([]), _t([]), _t([])), {}, "non-empty"),
    ],
)
def test_dpo_bad_inputs_raise(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dpo_loss(*args, **kwargs)


def test_dpo_beta_zero_is_a_programming_error() -> None:
    # algo.pref.dpo_beta must be > 0 at the config boundary
    with pytest.raises(AssertionError, match="DPO temperature"):
        dpo_loss(_t([1.0]), _t([1.0]), _t([1.0]), _t([1.0]), beta=0.0)


# --------------------------------------------------------------------------------------------------
# sft_loss
# --------------------------------------------------------------------------------------------------


def test_sft_unweighted_and_weighted() -> None:
    # errors [0.5, 0]: unweighted mean 0.25; weights [2, 3] -> mean(2·0.5, 3·0) = 0.5
    plain = sft_loss(_t(V), _t(X0), _t(NOISE))
    assert plain.loss.item() == pytest.approx(0.25)
    assert plain.anchor_loss.item() == 0.0
    assert plain.stats == {"fm_error_mean": pytest.approx(0.25), "weight_mean": 1.0}
    weighted = sft_loss(_t(V), _t(X0), _t(NOISE), weights=_t([2.0, 3.0]))
    assert weighted.loss.item() == pytest.approx(0.5)  # β = 0 and the weights still count (upstream bug)
    assert weighted.stats["weight_mean"] == pytest.approx(2.5)


def test_sft_anchor_term_and_gradients() -> None:
    # v_base = 0 -> anchor mean(v²) = (1 + 4 + 0 + 0)/4 = 1.25; β = 0.1 -> loss 0.5 + 0.125 = 0.625
    # d/dv of the fm term: w_i·2(v − target)/(D·B) = 2·2·[0, 1]/4 = [0, 1] for sample 0, 0 for sample 1
    # d/dv of the anchor: β·2v/4 = 0.05·v -> [[0.05, 0.1], [0, 0]]
    v = _t(V, grad=True)
    base = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    out = sft_loss(v, _t(X0), _t(NOISE), v_base=base, anchor_weight=0.1, weights=_t([2.0, 3.0]))
    assert out.loss.item() == pytest.approx(0.625)
    assert out.fm_loss.item() == pytest.approx(0.5)
    assert out.anchor_loss.item() == pytest.approx(1.25)
    out.loss.backward()
    torch.testing.assert_close(v.grad, _t([[0.05, 1.1], [0.0, 0.0]]))
    assert base.grad is None


def test_sft_anchor_weight_zero_logs_anchor_without_adding_it() -> None:
    out = sft_loss(_t(V), _t(X0), _t(NOISE), v_base=torch.zeros(2, 2, dtype=torch.float64))
    assert out.loss.item() == pytest.approx(0.25)
    assert out.anchor_loss.item() == pytest.approx(1.25)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"v_base": torch.zeros(2, 3)}, "v_base"),
        ({"weights": _t([1.0])}, r"weights must be \(B,\)"),
        ({"weights": _t([1.0, -0.5])}, "clamp"),
        ({"weights": _t([1.0, float("inf")])}, "finite"),
    ],
)
def test_sft_bad_inputs_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sft_loss(_t(V), _t(X0), _t(NOISE), **kwargs)


@pytest.mark.parametrize("anchor_weight", [0.1, -0.1])
def test_sft_anchor_without_base_or_negative_is_a_programming_error(anchor_weight: float) -> None:
    with pytest.raises(AssertionError):
        sft_loss(_t(V), _t(X0), _t(NOISE), anchor_weight=anchor_weight)
