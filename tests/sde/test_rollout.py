"""Window plans and rollouts: only trained steps stored, recompute reproduces the sampled log-prob."""

from __future__ import annotations

import pytest
import torch

from rlgen_cli.sde import sd3_sigmas, step
from rlgen_cli.sde.rollout import StepSpec, Trajectory, recompute_step, rollout
from rlgen_cli.sde.window import WindowPlan, plan_window


def _velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    # a fixed nonlinear field: v = tanh(x)·(1 + σ)
    return torch.tanh(x) * (1 + sigma)


def test_all_window_trains_the_first_fraction():
    # int(10 × 0.99) = 9: every step stochastic, all but the last trained
    plan = plan_window("all", 10, timestep_fraction=0.99)
    assert plan.sde_steps == tuple(range(10)) and plan.train_steps == tuple(range(9))
    assert plan_window("all", 10, timestep_fraction=0.5).train_steps == (0, 1, 2, 3, 4)
    with pytest.raises(AssertionError):  # the config boundary names it (tests/sde/test_windows.py)
        plan_window("all", 1, timestep_fraction=0.5)
    with pytest.raises(KeyError):
        plan_window("sliding_typo", 10)
    with pytest.raises(ValueError, match="must be stochastic"):
        WindowPlan(3, sde_steps=(0,), train_steps=(1,))


@pytest.mark.parametrize("kind,noise_level", [("flow_sde", 0.7), ("dance", 0.3), ("cps", 0.8)])
def test_rollout_stores_trained_steps_and_recompute_matches(kind, noise_level):
    sigmas = sd3_sigmas(6)
    plan = plan_window("all", 6, timestep_fraction=0.5)  # trains steps 0, 1, 2
    spec = StepSpec(kind, noise_level)
    x1 = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    traj = rollout(_velocity, x1, sigmas, plan, spec, torch.Generator().manual_seed(1))
    assert traj.latents.shape == (3, 3, 2, 4, 4) and traj.logprobs.shape == (3, 3)
    assert traj.step_indices.tolist() == [0, 1, 2]
    torch.testing.assert_close(traj.sigmas, sigmas[:3])
    torch.testing.assert_close(traj.latents[:, 0], x1)
    torch.testing.assert_close(traj.latents[:, 1], traj.next_latents[:, 0])  # chained
    for j in range(3):
        out = recompute_step(_velocity, traj, j, spec)
        assert (out.logprob - traj.logprobs[:, j]).abs().max() <= 1e-6


def test_steps_outside_the_window_are_plain_euler():
    sigmas = sd3_sigmas(4)
    plan = WindowPlan(4, sde_steps=(1,), train_steps=(1,))
    x1 = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    traj = rollout(_velocity, x1, sigmas, plan, StepSpec("flow_sde", 0.7), torch.Generator().manual_seed(0))
    # before the window: x after step 0 is exactly Euler
    euler = x1 + _velocity(x1, sigmas[0]) * (sigmas[1] - sigmas[0])
    torch.testing.assert_close(traj.latents[:, 0], euler)
    # after the window: steps 2, 3 are Euler from the sampled x
    x = traj.next_latents[:, 0]
    for i in (2, 3):
        x = step("ode", x, _velocity(x, sigmas[i]), sigmas[i], sigmas[i + 1]).prev
    torch.testing.assert_close(traj.final, x)


def test_same_generator_seed_same_trajectory():
    sigmas, plan, spec = (
        sd3_sigmas(5),
        plan_window("all", 5, timestep_fraction=0.99),
        StepSpec("flow_sde", 0.7),
    )
    x1 = torch.randn(2, 3)
    a = rollout(_velocity, x1, sigmas, plan, spec, torch.Generator().manual_seed(3))
    b = rollout(_velocity, x1, sigmas, plan, spec, torch.Generator().manual_seed(3))
    assert torch.equal(a.final, b.final) and torch.equal(a.logprobs, b.logprobs)


def test_trajectory_index_and_cat_round_trip():
    sigmas, plan, spec = (
        sd3_sigmas(4),
        plan_window("all", 4, timestep_fraction=0.99),
        StepSpec("flow_sde", 0.7),
    )
    traj = rollout(_velocity, torch.randn(4, 3), sigmas, plan, spec, torch.Generator().manual_seed(0))
    joined = Trajectory.cat([traj.index(slice(0, 1)), traj.index(slice(1, 4))])
    for name in ("latents", "next_latents", "logprobs", "final"):
        assert torch.equal(getattr(joined, name), getattr(traj, name))


def test_sigma_count_must_fit_the_plan():
    with pytest.raises(AssertionError, match="4 sigmas for a 4-step plan"):
        rollout(
            _velocity,
            torch.randn(1, 2),
            sd3_sigmas(3),
            plan_window("all", 4, timestep_fraction=0.99),
            StepSpec("flow_sde", 0.7),
        )


def test_per_sample_streams_make_rollouts_independent_of_batching():
    from rlgen_cli.sde.noise import randn_per_sample, sample_generators

    sigmas, plan, spec = (
        sd3_sigmas(4),
        plan_window("all", 4, timestep_fraction=0.99),
        StepSpec("flow_sde", 0.7),
    )

    def run(parts: list[slice]) -> Trajectory:
        init = sample_generators(7, 3, range(4), salt=0)
        noise = sample_generators(7, 3, range(4), salt=1)
        out = []
        for part in parts:
            x = randn_per_sample((2, 3), init[part], "cpu")
            out.append(rollout(_velocity, x, sigmas, plan, spec, noise[part]))
        return Trajectory.cat(out)

    whole, split = run([slice(0, 4)]), run([slice(0, 1), slice(1, 3), slice(3, 4)])
    assert torch.equal(whole.final, split.final) and torch.equal(whole.logprobs, split.logprobs)


def test_stream_seeds_differ_by_every_input():
    from rlgen_cli.sde.noise import stream_seed

    seeds = {stream_seed(s, e, k, salt) for s in (0, 1) for e in (0, 1) for k in (0, 1, 2) for salt in (0, 1)}
    assert len(seeds) == 24 and all(0 <= s < 2**63 for s in seeds)
