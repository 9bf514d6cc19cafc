"""Tests for rlgen_cli.sde.schedule: SD3 static shift and FLUX dynamic shift, checked by hand and
against diffusers' FlowMatchEulerDiscreteScheduler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlgen_cli.sde import calculate_mu, dynamic_shift_sigmas, sd3_sigmas, shift_sigmas


def test_shift_sigmas_hand_values() -> None:
    # s = 3: σ=0 -> 0; σ=0.5 -> 1.5 / (1 + 2·0.5) = 0.75; σ=0.25 -> 0.75 / 1.5 = 0.5; σ=1 -> 3/3 = 1
    out = shift_sigmas(torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64), 3.0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.0, 0.5, 0.75, 1.0]))


def test_shift_one_is_identity() -> None:
    sigmas = torch.linspace(0, 1, 11)
    torch.testing.assert_close(shift_sigmas(sigmas, 1.0), sigmas)


def test_sd3_sigmas_shape_ends_and_monotone() -> None:
    sigmas = sd3_sigmas(10)
    assert sigmas.shape == (11,) and sigmas.dtype == torch.float32
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert bool((sigmas[1:] < sigmas[:-1]).all())


def test_sd3_sigmas_single_step() -> None:
    # linspace(1, ·, 1) = [1]; shift(1) = 1; then 0 appended
    assert sd3_sigmas(1).tolist() == [1.0, 0.0]


def test_sd3_sigmas_no_shift_is_linear() -> None:
    # shift 1: grid linspace(1, 0.001, 4) = [1, 0.667, 0.3337, 0.001], unshifted, then 0
    expected = torch.cat(
        [torch.linspace(1, 0.001, 4, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)]
    )
    torch.testing.assert_close(sd3_sigmas(4, shift=1.0), expected.float())


def test_sd3_sigmas_endpoint_is_shifted_twice() -> None:
    # diffusers' grid ends at shift(0.001) = 0.003/1.002 = 0.0029940, then the grid is shifted again:
    # T=2 -> [1, shift(0.0029940) = 0.0089820/1.0059880 = 0.0089286, 0]
    torch.testing.assert_close(
        sd3_sigmas(2, shift=3.0), torch.tensor([1.0, 0.0089286, 0.0]), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("num_steps", [1, 8, 10, 40])
def test_sd3_sigmas_match_diffusers(num_steps: int) -> None:
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    torch.testing.assert_close(sd3_sigmas(num_steps, shift=3.0), scheduler.sigmas.float(), atol=1e-6, rtol=0)


def test_calculate_mu_hand_values() -> None:
    # slope = (1.15 − 0.5) / (4096 − 256) = 0.65 / 3840; at 1024: 0.5 + 0.65·768/3840 = 0.5 + 0.13 = 0.63
    assert calculate_mu(256) == pytest.approx(0.5)
    assert calculate_mu(4096) == pytest.approx(1.15)
    assert calculate_mu(1024) == pytest.approx(0.63)


def test_dynamic_shift_hand_values() -> None:
    # T=2, μ = ln 2: base [1, 0.5]; 1 -> 2 / (2 + 0) = 1; 0.5 -> 2 / (2 + 1) = 2/3; then 0
    torch.testing.assert_close(dynamic_shift_sigmas(2, math.log(2.0)), torch.tensor([1.0, 2 / 3, 0.0]))
    # μ = 0 leaves the base grid linspace(1, 1/T, T): T=4 -> [1, 0.75, 0.5, 0.25, 0]
    torch.testing.assert_close(dynamic_shift_sigmas(4, 0.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


@pytest.mark.parametrize("num_steps", [1, 8, 28])
@pytest.mark.parametrize("seq_len", [1024, 4096])
def test_dynamic_shift_matches_diffusers(num_steps: int, seq_len: int) -> None:
    diffusers = pytest.importorskip("diffusers")
    mu = calculate_mu(seq_len)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu)
    got = dynamic_shift_sigmas(num_steps, mu)
    torch.testing.assert_close(got, scheduler.sigmas.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [0, -3])
def test_num_steps_must_be_positive(bad: int) -> None:
    # model.num_steps is checked at the config boundary; here it is a programming error
    with pytest.raises(AssertionError):
        sd3_sigmas(bad)
    with pytest.raises(AssertionError):
        dynamic_shift_sigmas(bad, 0.5)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_shift_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="shift must be"):
        sd3_sigmas(10, shift=bad)
    with pytest.raises(ValueError, match="shift must be"):
        shift_sigmas(torch.tensor([0.5]), bad)


def test_other_argument_errors() -> None:
    with pytest.raises(AssertionError):
        sd3_sigmas(10, sigma_min=0.0)
    with pytest.raises(AssertionError):
        dynamic_shift_sigmas(10, float("inf"))
    with pytest.raises(AssertionError, match="μ is interpolated"):
        calculate_mu(512, base_seq_len=256, max_seq_len=256)
