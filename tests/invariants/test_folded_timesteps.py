"""``algo.timesteps_per_pass``: the trained steps of a micro-batch folded into one transformer call and one
backward give the gradient of the per-step update (one call and one backward per step), for every
objective and window the update supports; the rollout's log-probs are recomputed within the documented
bound (``rlgen check-onpolicy``); an update with folding still trains. Every comparison has an arm that
moves one input slightly and must fail the same tolerance."""

from __future__ import annotations

import functools

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rlgen_cli._hydra import conf_dir, verb_overrides
from rlgen_cli.recipes import flow_grpo, flow_run
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.sde.rollout import StepSpec, fold_rows, recompute_step, recompute_steps, rollout
from rlgen_cli.sde.window import plan_window
from rlgen_cli.tasks.common import validated
from rlgen_cli.training.reporting.progress import Progress
from tests.conftest import TINY_RUN

register_schemas()

STEPS = 3
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-7}
"""Folding sums the same per-step losses in another order (and, where the model is not batch invariant,
recomputes them with ~1e-7 rounding differences): gradients agree to ~1e-6 relative; a 1e-3 change of
one advantage moves them by ~1e-3."""


def _recipe(tmp_path, overrides: list[str]) -> flow_run.FlowRun:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(
            config_name="train",
            overrides=verb_overrides(
                "train", [*TINY_RUN, f"model.num_steps={STEPS}", "model.resolution=16", *overrides]
            ),
        )
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(tmp_path)
    run = flow_run.setup(validated(cfg), cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B starts at 0, which would leave every A without a gradient
        for name, param in run.policy.trainable.named():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return run


def _gradients(run, monkeypatch, rollouts, advantages, per_pass: int) -> tuple[list[torch.Tensor], list]:
    """The gradient each optimizer step of one update would apply (no step taken), and the ``sync`` flag
    of every backward, with ``algo.timesteps_per_pass = per_pass``."""
    params = run.policy.trainable.parameters()
    grads: list[torch.Tensor] = []
    syncs: list[bool] = []

    def capture(_run) -> float:
        if run.dist.exact is not None:  # launcher.exact_reduction: the float64 sums become the gradients
            run.dist.exact.reduce()
        grads.append(
            torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.flatten() for p in params])
        )
        for p in params:
            p.grad = None
        return 0.0

    monkeypatch.undo()  # the backward and optimizer step of an earlier call
    backward = run.dist.backward
    monkeypatch.setattr(flow_grpo.flow_run, "optimizer_step", capture)
    monkeypatch.setattr(
        run.dist, "backward", lambda loss, sync=True: syncs.append(sync) or backward(loss, sync)
    )
    run.cfg.algo.timesteps_per_pass = per_pass
    flow_grpo.update(run, rollouts, advantages, Progress(enabled=False))
    return grads, syncs


def _rollouts(run):
    with Progress(enabled=False) as progress:
        rollouts = flow_grpo.sample_rollouts(run, 0, progress)
    return rollouts, torch.linspace(-1.0, 1.0, len(rollouts.indices))


EVERY_STEP = "algo.window.timestep_fraction=1.0"
SETTINGS = {
    "grpo": ["algo=grpo", "algo.kl_weight=0", EVERY_STEP],
    "grpo_cfg_conditional": [
        "algo=grpo", "algo.kl_weight=0", EVERY_STEP, "model.guidance_scale=4.5", "algo.cfg_grad=conditional",
    ],
    "grpo_kl": ["algo=grpo", "algo.kl_weight=0.5", EVERY_STEP],
    "grpo_guard": ["algo=grpo_guard", EVERY_STEP],
    "dance_train_mask": ["algo=dance", "algo.window.timestep_fraction=0.7"],  # per-sample step subsets
}  # fmt: skip


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_folded_update_has_the_per_step_gradient(tmp_path, monkeypatch, setting):
    overrides = [
        *SETTINGS[setting], "algo.prompts_per_epoch=2", "algo.group_size=2", "algo.sample_batch_size=2",
        "algo.train_batch_size=2", "algo.clip_range=1e-2",
    ]  # fmt: skip
    run = _recipe(tmp_path, overrides)
    rollouts, advantages = _rollouts(run)
    if setting == "dance_train_mask":  # the folds have uneven rows
        mask = rollouts.traj.train_mask
        assert mask is not None and not mask.all() and mask.any(dim=0).sum() > 1
    per_step, per_step_syncs = _gradients(run, monkeypatch, rollouts, advantages, per_pass=1)
    folded, folded_syncs = _gradients(run, monkeypatch, rollouts, advantages, per_pass=3)
    assert len(per_step) == len(folded) == 2  # two micro-batches of 2, an optimizer step after each
    trained = [len(flow_grpo.trained_rows(rollouts.traj.index(part))) for part in (slice(0, 2), slice(2, 4))]
    assert len(per_step_syncs) == sum(trained)  # a backward per trained step ...
    assert len(folded_syncs) == sum(-(-t // 3) for t in trained)  # ... and per fold of ≤ 3 steps
    assert folded_syncs[-1] and sum(folded_syncs) == 2  # the last backward before each optimizer step syncs
    for a, b in zip(folded, per_step, strict=True):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, **GRAD_TOL)
    # the arm that must fail: one advantage 1e-3 larger moves the gradient outside the tolerance
    nudged = advantages.clone()
    nudged[0] += 1e-3
    moved, _ = _gradients(run, monkeypatch, rollouts, nudged, per_pass=3)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(moved[0], per_step[0], **GRAD_TOL)


def test_an_update_with_folded_timesteps_trains(tmp_path):
    run = _recipe(tmp_path, ["algo=grpo", "algo.kl_weight=0", "algo.timesteps_per_pass=8"])
    rollouts, advantages = _rollouts(run)
    before = [p.detach().clone() for p in run.policy.trainable.parameters()]
    stats = flow_grpo.update(run, rollouts, advantages, Progress(enabled=False))
    after = run.policy.trainable.parameters()
    assert stats["grad_norm"] > 0
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # every LoRA tensor moved
    assert stats["ratio_max"] - 1 < 1e-6 and 1 - stats["ratio_min"] < 1e-6  # on-policy: ratio ≈ 1


def test_step_folds_groups_consecutive_trained_steps():
    trained = [(j, slice(None)) for j in (0, 2, 3, 5, 6)]
    assert [[j for j, _ in fold] for fold in flow_grpo.step_folds(trained, 2)] == [[0, 2], [3, 5], [6]]
    assert [[j for j, _ in fold] for fold in flow_grpo.step_folds(trained, 8)] == [[0, 2, 3, 5, 6]]
    assert len(flow_grpo.step_folds(trained, 1)) == 5


# -- the step maths: exact per row whenever the velocity is -------------------------------------------
def _toy_velocity(weight: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A row-wise velocity (no op mixes rows, so any batch gives the same rows)."""
    return torch.tanh(x * weight) * sigma.reshape(-1, 1, 1, 1) - x


def test_recompute_steps_equals_recompute_step_row_for_row():
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    x = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(9))
    sigmas = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.0])
    plan = plan_window("all", 4, timestep_fraction=1.0)
    spec = StepSpec("flow_sde", 0.7)
    weight = torch.tensor(1.3, requires_grad=True)
    velocity = functools.partial(_toy_velocity, weight)
    traj = rollout(velocity, x, sigmas, plan, spec, generators)
    fold = [(0, slice(None)), (2, torch.tensor([0, 2])), (3, torch.tensor([1]))]
    assert fold_rows(3, fold).tolist() == [0, 1, 2, 0, 2, 1]
    folded = recompute_steps(velocity, traj, fold, spec)
    for (j, rows), out in zip(fold, folded, strict=True):
        alone = recompute_step(velocity, traj.index(rows), j, spec)
        assert torch.equal(out.logprob, alone.logprob) and torch.equal(out.mean, alone.mean)
        assert torch.equal(out.logprob, traj.logprobs[rows, j])  # the rollout's own log-probs: ratio 1
    (grad,) = torch.autograd.grad(sum(out.logprob.sum() for out in folded), weight)
    assert grad != 0
    # the arm that must fail: scoring step 2's rows at step 3's σ changes the log-probs
    wrong = recompute_steps(velocity, traj, [(3, slice(None))], spec)[0].logprob
    assert not torch.equal(wrong, traj.logprobs[:, 2])


# -- rlgen check-onpolicy folds as the update does --------------------------------------------------------
# the tiny SD3's patch-embedding convolution is not batch invariant from 16 rows on (oneDNN picks another
# kernel): 4 samples × 3 steps × CFG give log-probs ≈ 1e-7 apart, inside the 1e-6 tolerance; perturbed
# weights must fail
@pytest.mark.parametrize(
    ("overrides", "code_expected", "verdict"),
    [
        (["model.guidance_scale=4.5"], 0, "PASS max error"),
        (["check.perturb_weights=1e-2"], 1, "FAIL max error"),
    ],
    ids=["stays_within_the_bound", "fails_with_perturbed_weights"],
)
def test_check_onpolicy_with_folded_timesteps(cli, tmp_path, overrides, code_expected, verdict):
    code, out = cli(
        "check-onpolicy", *TINY_RUN, *overrides, "algo.timesteps_per_pass=3", f"hydra.run.dir={tmp_path}"
    )
    assert code == code_expected, out
    assert verdict in out


def test_timesteps_per_pass_below_one_exits_2_naming_the_key(cli, tmp_path):
    code, out = cli("train", *TINY_RUN, "algo.timesteps_per_pass=0", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "algo.timesteps_per_pass" in out, out
