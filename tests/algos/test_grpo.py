"""Hand-computed checks of the Flow-GRPO clipped objective (rlgen_cli.algos.grpo)."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos import grpo_loss

E = math.e


def _t(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def test_on_policy_ratio_one() -> None:
    # new == old -> ratio [1, 1, 1]; nothing clipped; loss = −mean(A) = −(1 − 2 + 0.5)/3 = 1/6
    logp = _t([-1.0, -2.0, -3.0])
    out = grpo_loss(logp.clone().requires_grad_(), logp, _t([1.0, -2.0, 0.5]), clip_range=1e-4)
    assert out.loss.item() == pytest.approx(1 / 6)
    assert out.policy_loss.item() == pytest.approx(1 / 6)
    assert out.kl_loss.item() == 0.0
    assert out.stats["approx_kl"] == 0.0
    assert out.stats["clipfrac"] == out.stats["clipfrac_high"] == out.stats["clipfrac_low"] == 0.0
    assert out.stats["ratio_mean"] == out.stats["ratio_min"] == out.stats["ratio_max"] == 1.0
    assert not out.policy_loss.requires_grad and out.loss.requires_grad


def test_positive_advantage_ratio_e_is_clipped() -> None:
    # new − old = 1 -> ratio e ≈ 2.718; A = 2, ε = 0.2
    # unclipped −2·e ≈ −5.437, clipped −2·1.2 = −2.4; max -> −2.4
    out = grpo_loss(_t([0.0], grad=True), _t([-1.0]), _t([2.0]), clip_range=0.2)
    assert out.loss.item() == pytest.approx(-2.4)
    assert out.stats["clipfrac"] == out.stats["clipfrac_high"] == 1.0
    assert out.stats["clipfrac_low"] == 0.0
    assert out.stats["approx_kl"] == pytest.approx(0.5)  # ½·1²


def test_negative_advantage_above_clip_uses_unclipped() -> None:
    # ratio e, A = −1: unclipped −(−1)·e = e ≈ 2.718, clipped −(−1)·1.2 = 1.2; the pessimistic max is e
    out = grpo_loss(_t([0.0], grad=True), _t([-1.0]), _t([-1.0]), clip_range=0.2)
    assert out.loss.item() == pytest.approx(E)


def test_gradient_only_where_not_clipped() -> None:
    # Δlogp = [1, 1, −1, 0] -> ratio [e, e, 1/e, 1]; A = [1, −1, 1, −1]; ε = 0.2; B = 4
    #  i0: A>0, ratio e:   unclipped −e,     clipped −1.2  -> max = −1.2 (clipped, constant) -> grad 0
    #  i1: A<0, ratio e:   unclipped  e,     clipped  1.2  -> max =  e   (term = ratio)      -> grad e/4
    #  i2: A>0, ratio 1/e: unclipped −1/e,   clipped −0.8  -> max = −1/e (term = −ratio)     -> grad −1/(4e)
    #  i3: ratio 1 inside the region: both terms = ratio (term = ratio)                      -> grad 1/4
    new = _t([0.0, 0.0, 0.0, 0.0], grad=True)
    old = _t([-1.0, -1.0, 1.0, 0.0])
    out = grpo_loss(new, old, _t([1.0, -1.0, 1.0, -1.0]), clip_range=0.2)
    out.loss.backward()
    torch.testing.assert_close(new.grad, _t([0.0, E / 4, -1 / (4 * E), 0.25]))
    # loss = (−1.2 + e − 1/e + 1) / 4
    assert out.loss.item() == pytest.approx((-1.2 + E - 1 / E + 1) / 4)
    # |ratio − 1| > 0.2 for i0, i1, i2 -> 3/4; above: i0, i1 -> 1/2; below: i2 -> 1/4
    assert out.stats["clipfrac"] == pytest.approx(0.75)
    assert out.stats["clipfrac_high"] == pytest.approx(0.5)
    assert out.stats["clipfrac_low"] == pytest.approx(0.25)
    assert out.stats["approx_kl"] == pytest.approx(0.5 * 3 / 4)  # ½·mean([1, 1, 1, 0])
    assert out.stats["ratio_min"] == pytest.approx(1 / E)
    assert out.stats["ratio_max"] == pytest.approx(E)
    assert out.stats["ratio_mean"] == pytest.approx((2 * E + 1 / E + 1) / 4)


def test_old_logp_and_advantages_get_no_gradient() -> None:
    old = _t([-1.0, -2.0], grad=True)
    adv = _t([1.0, -1.0], grad=True)
    out = grpo_loss(old.detach().clone().requires_grad_(), old, adv, clip_range=0.2)
    out.loss.backward()
    assert old.grad is None and adv.grad is None


def test_kl_weight_adds_the_kl() -> None:
    # on-policy with A = [1, −1] -> policy loss −mean(A) = 0; mean(kl) = 0.2; loss = 0 + 0.5·0.2 = 0.1
    new = _t([-1.0, -1.0], grad=True)
    kl = _t([0.1, 0.3], grad=True)
    out = grpo_loss(new, new.detach(), _t([1.0, -1.0]), clip_range=1e-4, kl=kl, kl_weight=0.5)
    assert out.loss.item() == pytest.approx(0.1)
    assert out.policy_loss.item() == pytest.approx(0.0)
    assert out.kl_loss.item() == pytest.approx(0.2)
    out.loss.backward()
    torch.testing.assert_close(kl.grad, _t([0.25, 0.25]))  # β / B = 0.5 / 2


def test_kl_weight_zero_logs_kl_without_adding_it() -> None:
    new = _t([-1.0, -1.0], grad=True)
    out = grpo_loss(new, new.detach(), _t([1.0, 3.0]), clip_range=1e-4, kl=_t([0.1, 0.3]), kl_weight=0.0)
    assert out.loss.item() == pytest.approx(-2.0)  # −mean([1, 3])
    assert out.kl_loss.item() == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"new_logp": _t([0.0, 0.0, 0.0])}, "share one shape"),
        ({"kl": _t([0.0])}, "kl"),
    ],
)
def test_bad_inputs_raise(kwargs: dict, match: str) -> None:
    kwargs = dict(kwargs)  # parametrize shares the dict between runs; do not mutate it
    args = {"new_logp": _t([0.0, 0.0]), "old_logp": _t([0.0, 0.0]), "advantages": _t([1.0, -1.0])}
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError, match=match):
        grpo_loss(args["new_logp"], args["old_logp"], args["advantages"], **{"clip_range": 0.2, **kwargs})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clip_range": 0.0},
        {"clip_range": -0.1},
        {"kl_weight": 0.1},
        {"kl_weight": -0.1, "kl": _t([0.0, 0.0])},
    ],
)
def test_bad_options_are_programming_errors(kwargs: dict) -> None:
    # algo.clip_range and algo.kl_weight are checked at the config boundary (tests/schema)
    with pytest.raises(AssertionError):
        grpo_loss(_t([0.0, 0.0]), _t([0.0, 0.0]), _t([1.0, -1.0]), **{"clip_range": 0.2, **kwargs})
