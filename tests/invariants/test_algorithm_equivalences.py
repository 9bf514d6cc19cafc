"""Equivalence classes: configurations that must give identical trajectories and losses.

* ``grpo_fast`` with window 0 == ``grpo`` (all steps but the last trained);
* ``mix_grpo`` with a window covering every step == ``grpo`` with every step trained;
* ``cps`` / ``dance`` with η = 0 == the Euler ODE (no randomness at all).
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlgen_cli._hydra import conf_dir, verb_overrides
from rlgen_cli.recipes import flow_grpo, flow_run
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.tasks.common import validated
from rlgen_cli.training.reporting.progress import Progress
from tests.conftest import TINY_RUN

register_schemas()


def _recipe(tmp_path, overrides: list[str]) -> flow_run.FlowRun:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(
            config_name="train",
            overrides=verb_overrides("train", [*TINY_RUN, "model.num_steps=4", *overrides]),
        )
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(tmp_path)
    return flow_run.setup(validated(cfg), cfg)


def _epoch(run: flow_run.FlowRun):
    with Progress(enabled=False) as progress:
        rollouts = flow_grpo.sample_rollouts(run, 0, progress)
        adv = torch.linspace(-1, 1, len(rollouts.indices))
        stats = flow_grpo.update(run, rollouts, adv, progress)
    return rollouts, stats


def _same(a, b) -> None:
    (ra, sa), (rb, sb) = a, b
    torch.testing.assert_close(ra.traj.latents, rb.traj.latents, rtol=0, atol=0)
    torch.testing.assert_close(ra.traj.logprobs, rb.traj.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(ra.images, rb.images, rtol=0, atol=0)
    assert sa["policy_loss"] == pytest.approx(sb["policy_loss"], abs=1e-9)
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-6)


def test_fast_with_window_zero_is_grpo(tmp_path):
    fast = _recipe(tmp_path / "a", ["algo=grpo_fast", "algo.window.size=0", "algo.clip_range=1e-2"])
    full = _recipe(
        tmp_path / "b",
        ["algo=grpo", "algo.window.timestep_fraction=0.75", "algo.clip_range=1e-2", "algo.kl_weight=0"],
    )
    _same(_epoch(fast), _epoch(full))


def test_mix_grpo_covering_every_step_is_grpo(tmp_path):
    # MixGRPO's own window ends before T − 2: end_offset 0 lets it cover all 4 steps
    mix = _recipe(
        tmp_path / "a",
        ["algo=mix_grpo", "algo.window.size=4", "algo.window.end_offset=0", "algo.clip_range=1e-2"],
    )
    full = _recipe(
        tmp_path / "b",
        ["algo=grpo", "algo.window.timestep_fraction=1.0", "algo.clip_range=1e-2", "algo.kl_weight=0"],
    )
    _same(_epoch(mix), _epoch(full))


@pytest.mark.parametrize("sampler", ["cps", "dance", "flow_sde"])
def test_zero_noise_is_the_ode(tmp_path, sampler):
    from rlgen_cli.sde.rollout import StepSpec
    from rlgen_cli.sde.sampling import sample_images

    recipe = _recipe(tmp_path, [f"sampler={sampler}"])  # the policy; the zero noise is the StepSpec's
    sde = sample_images(recipe.policy, ["a cat", "a dog"], 4, 2, 0, spec=StepSpec(sampler, 0.0))
    ode = sample_images(recipe.policy, ["a cat", "a dog"], 4, 2, 0, spec=StepSpec("ode", 0.0))
    torch.testing.assert_close(sde, ode, rtol=0, atol=0)
