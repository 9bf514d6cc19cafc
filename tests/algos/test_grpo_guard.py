"""Hand-computed checks of the GRPO-Guard objective (rlgen_cli.algos.guard)."""

from __future__ import annotations

import math

import pytest
import torch

from rlgen_cli.algos import guard_loss

E = math.e


def _t(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def _means(shifts: list[float], grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """μ_old = 0 of shape (B, 2, 3); μ_θ = μ_old + shift_i in every element of sample i."""
    old = torch.zeros(len(shifts), 2, 3, dtype=torch.float64)
    new = old + _t(shifts).view(-1, 1, 1)
    return new.requires_grad_(grad), old


def test_on_policy_ratio_one_and_loss_weighted_by_inverse_s_squared() -> None:
    # μ_θ = μ_old, logp equal -> bias 0, ratio exp(0·s̄σ̄) = 1 for both samples
    # s̄ = [0.5, 0.25] -> weights 1/s̄² = [4, 16]; A = [1, −2]
    # loss = mean(−A·w) = (−1·4 + 2·16) / 2 = (−4 + 32) / 2 = 14
    mean_new, mean_old = _means([0.0, 0.0], grad=True)
    logp = _t([-1.0, -2.0])
    out = guard_loss(
        logp.clone().requires_grad_(),
        logp,
        mean_new,
        mean_old,
        _t([2.0, 1.0]),
        _t([0.5, 0.25]),
        _t([1.0, -2.0]),
        clip_range=2e-6,
    )
    assert out.loss.item() == pytest.approx(14.0)
    assert out.policy_loss.item() == pytest.approx(14.0)
    assert out.kl_loss.item() == 0.0
    assert out.stats["ratio_mean"] == out.stats["ratio_min"] == out.stats["ratio_max"] == 1.0
    assert out.stats["clipfrac"] == out.stats["approx_kl"] == 0.0
    assert out.stats["guard_bias_mean"] == out.stats["guard_bias_max"] == 0.0
    assert out.stats["guard_scale_mean"] == pytest.approx((1.0 + 0.25) / 2)  # s̄σ̄ = [0.5·2, 0.25·1]
    assert out.stats["guard_weight_mean"] == pytest.approx(10.0)  # mean([4, 16])
    assert not out.policy_loss.requires_grad and out.loss.requires_grad


def test_bias_is_per_sample() -> None:
    # logp equal, so log ratio = bias·s̄σ̄ with bias = mean(Δμ²) / (2(s̄σ̄)²)
    #  i0: shift 1, s̄σ̄ = 0.5·2 = 1    -> bias 1 / (2·1)    = 0.5 -> log ratio 0.5·1   = 0.5
    #  i1: shift 2, s̄σ̄ = 0.25·4 = 1   -> bias 4 / (2·1)    = 2   -> log ratio 2·1     = 2
    #  i2: shift 1, s̄σ̄ = 0.25·2 = 0.5 -> bias 1 / (2·0.25) = 2   -> log ratio 2·0.5   = 1
    # A batch-level bias (upstream's scalar σ̄, s̄) would give i0 and i2 the same bias; per sample they differ.
    mean_new, mean_old = _means([1.0, 2.0, 1.0])
    logp = _t([-1.0, -1.0, -1.0])
    out = guard_loss(
        logp,
        logp,
        mean_new,
        mean_old,
        _t([2.0, 4.0, 2.0]),
        _t([0.5, 0.25, 0.25]),
        _t([0.0, 0.0, 0.0]),
        clip_range=0.1,
    )
    assert out.stats["guard_bias_mean"] == pytest.approx((0.5 + 2.0 + 2.0) / 3)
    assert out.stats["guard_bias_max"] == pytest.approx(2.0)
    assert out.stats["ratio_min"] == pytest.approx(math.exp(0.5))
    assert out.stats["ratio_max"] == pytest.approx(math.exp(2.0))
    assert out.stats["ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(2.0) + E) / 3)
    assert out.stats["approx_kl"] == 0.0  # from the plain Δlogp = 0


def test_bias_averages_over_non_batch_elements() -> None:
    # Δμ of the single sample = [0, 2, 0, 2] -> mean(Δμ²) = (0 + 4 + 0 + 4)/4 = 2
    # s̄σ̄ = 1·1 = 1 -> bias 2/2 = 1 -> ratio e
    mean_old = torch.zeros(1, 2, 2, dtype=torch.float64)
    mean_new = mean_old + _t([0.0, 2.0, 0.0, 2.0]).view(1, 2, 2)
    logp = _t([0.0])
    out = guard_loss(logp, logp, mean_new, mean_old, _t([1.0]), _t([1.0]), _t([0.0]), clip_range=0.1)
    assert out.stats["guard_bias_mean"] == pytest.approx(1.0)
    assert out.stats["ratio_mean"] == pytest.approx(E)


def test_positive_advantage_above_clip_is_clipped() -> None:
    # σ̄ = 2, s̄ = 0.5 -> s̄σ̄ = 1, weight 1/0.25 = 4; shift 1 -> bias 0.5; Δlogp = 0.5
    # log ratio = (0.5 + 0.5)·1 = 1 -> ratio e; A = 2, ε = 0.2
    # unclipped −2e ≈ −5.44, clipped −2·1.2 = −2.4 -> max −2.4 -> ·4 = −9.6
    mean_new, mean_old = _means([1.0])
    out = guard_loss(
        _t([0.0], grad=True), _t([-0.5]), mean_new, mean_old, _t([2.0]), _t([0.5]), _t([2.0]), clip_range=0.2
    )
    assert out.loss.item() == pytest.approx(-9.6)
    assert out.stats["clipfrac"] == out.stats["clipfrac_high"] == 1.0
    assert out.stats["clipfrac_low"] == 0.0
    assert out.stats["approx_kl"] == pytest.approx(0.5 * 0.25)  # ½·Δlogp² of the plain ratio


def test_negative_advantage_above_clip_uses_unclipped() -> None:
    # same ratio e; A = −1: unclipped e, clipped 1.2 -> max e -> ·4 = 4e
    mean_new, mean_old = _means([1.0])
    out = guard_loss(
        _t([0.0], grad=True), _t([-0.5]), mean_new, mean_old, _t([2.0]), _t([0.5]), _t([-1.0]), clip_range=0.2
    )
    assert out.loss.item() == pytest.approx(4 * E)


def test_gradients() -> None:
    # B = 2, on-policy (ratio 1, inside the trust region); s̄σ̄ = [1, 0.5], weights 1/s̄² = [4, 16]; A = [1, −1]
    # d loss / d new_logp_i = −A_i·ratio_i·s̄σ̄_i·w_i / B  -> [−1·1·4/2, 1·0.5·16/2] = [−2, 4]
    # d loss / d μ_θ = 0 on-policy (the bias is quadratic in Δμ)
    mean_new, mean_old = _means([0.0, 0.0], grad=True)
    new = _t([-1.0, -1.0], grad=True)
    old = _t([-1.0, -1.0], grad=True)
    adv = _t([1.0, -1.0], grad=True)
    sigma = _t([2.0, 2.0], grad=True)
    out = guard_loss(new, old, mean_new, mean_old, sigma, _t([0.5, 0.25]), adv, clip_range=0.2)
    out.loss.backward()
    torch.testing.assert_close(new.grad, _t([-2.0, 4.0]))
    torch.testing.assert_close(mean_new.grad, torch.zeros_like(mean_new))
    assert old.grad is None and adv.grad is None and sigma.grad is None


def test_gradient_zero_where_clipped() -> None:
    # ratio e (as in the clip test) with A = 2 > 0: the max picks the constant clipped term -> no gradient
    mean_new, mean_old = _means([1.0], grad=True)
    new = _t([0.0], grad=True)
    out = guard_loss(new, _t([-0.5]), mean_new, mean_old, _t([2.0]), _t([0.5]), _t([2.0]), clip_range=0.2)
    out.loss.backward()
    torch.testing.assert_close(new.grad, _t([0.0]))
    torch.testing.assert_close(mean_new.grad, torch.zeros_like(mean_new))


def test_normalised_log_ratio_is_mean_noise_times_shift() -> None:
    # With x' = μ_old + s·z and the per-element-mean Gaussian log-prob of std s:
    #   Δlogp = mean(z·Δμ)/s − mean(Δμ²)/(2s²);  (Δlogp + bias)·s = mean(z·Δμ)   (the paper's Eq. 8)
    gen = torch.Generator().manual_seed(0)
    shape = (1, 4, 8, 8)
    mean_old = torch.randn(shape, generator=gen, dtype=torch.float64)
    mean_new = mean_old + 0.01 * torch.randn(shape, generator=gen, dtype=torch.float64)
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    sigma, s_bar = 0.7, 0.3
    std = sigma * s_bar
    x_next = mean_old + std * z

    def logp(mu: torch.Tensor) -> torch.Tensor:
        dens = -((x_next - mu) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        return dens.flatten(1).mean(dim=1)

    out = guard_loss(
        logp(mean_new),
        logp(mean_old),
        mean_new,
        mean_old,
        _t([sigma]),
        _t([s_bar]),
        _t([0.0]),
        clip_range=0.1,
    )
    expected = math.exp((z * (mean_new - mean_old)).mean().item())
    assert out.stats["ratio_mean"] == pytest.approx(expected, rel=1e-6)  # stats are float32


def test_kl_weight_adds_the_kl_without_reweighting() -> None:
    # on-policy, A = [1, −1], s̄ = [1, 1] -> policy loss mean([−1, 1]) = 0
    # mean(kl) = 0.2 -> loss = 0 + 0.5·0.2 = 0.1 (the KL is not divided by s̄²)
    mean_new, mean_old = _means([0.0, 0.0])
    logp = _t([-1.0, -1.0], grad=True)
    kl = _t([0.1, 0.3], grad=True)
    out = guard_loss(
        logp,
        logp.detach(),
        mean_new,
        mean_old,
        _t([1.0, 1.0]),
        _t([1.0, 1.0]),
        _t([1.0, -1.0]),
        clip_range=1e-4,
        kl=kl,
        kl_weight=0.5,
    )
    assert out.loss.item() == pytest.approx(0.1)
    assert out.kl_loss.item() == pytest.approx(0.2)
    out.loss.backward()
    torch.testing.assert_close(kl.grad, _t([0.25, 0.25]))  # β / B


def _args() -> dict[str, torch.Tensor]:
    return {
        "new_logp": _t([0.0, 0.0]),
        "old_logp": _t([0.0, 0.0]),
        "mean_new": torch.zeros(2, 3, dtype=torch.float64),
        "mean_old": torch.zeros(2, 3, dtype=torch.float64),
        "sigma_t": _t([1.0, 1.0]),
        "sqrt_neg_dt": _t([0.5, 0.5]),
        "advantages": _t([1.0, -1.0]),
    }


@pytest.mark.parametrize(
    ("override", "kwargs", "match"),
    [
        ({"new_logp": _t([0.0, 0.0, 0.0])}, {}, "share one 1-D shape"),
        ({"sigma_t": _t([1.0])}, {}, "share one 1-D shape"),
        ({"mean_new": torch.zeros(2, 4, dtype=torch.float64)}, {}, "mean_new"),
        ({"mean_new": torch.zeros(3, 3), "mean_old": torch.zeros(3, 3)}, {}, "B=2"),
        ({"sigma_t": _t([1.0, 0.0])}, {}, "sigma_t must be finite and > 0"),
        ({"sqrt_neg_dt": _t([0.5, float("nan")])}, {}, "sqrt_neg_dt"),
        ({}, {"kl": _t([0.0])}, "kl"),
    ],
)
def test_bad_inputs_raise(override: dict, kwargs: dict, match: str) -> None:
    args = {**_args(), **override}
    with pytest.raises(ValueError, match=match):
        guard_loss(*args.values(), **{"clip_range": 0.2, **kwargs})


@pytest.mark.parametrize(
    "kwargs", [{"clip_range": 0.0}, {"kl_weight": 0.1}, {"kl_weight": -0.1, "kl": _t([0.0, 0.0])}]
)
def test_bad_options_are_programming_errors(kwargs: dict) -> None:
    with pytest.raises(AssertionError):
        guard_loss(*_args().values(), **{"clip_range": 0.2, **kwargs})


def test_algo_grpo_guard_defaults_are_its_authors_sd3_configs() -> None:
    # config/grpo_guard.py (general_ocr / geneval / pickscore_hps ..._sd3_rationorm): rationorm on, clip 2e-6
    # (4e-6 for PickScore), per-prompt stat tracking with np.std + 1e-4 (global_std False), β = 0, the first
    # 99 % of steps trained, all-zero-advantage samples dropped before training
    from rlgen_cli.tasks.common import validated
    from tests.schema.test_compose import _compose

    algo = validated(_compose("train", ["algo=grpo_guard"])).algo
    assert algo.objective == "grpo_guard" and algo.clip_range == pytest.approx(2e-6)
    assert (algo.global_std, algo.std_estimator, algo.adv_eps) == (False, "population", pytest.approx(1e-4))
    assert algo.kl_weight == 0.0 and algo.adv_clip_max == 5.0
    assert (algo.window.kind, algo.window.timestep_fraction) == ("all", 0.99)
    assert algo.drop_zero_advantage is True
