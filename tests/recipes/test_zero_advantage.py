"""``algo.drop_zero_advantage``: Flow-GRPO trains only samples with a non-zero advantage, in as many
micro-batches as before (each smaller), so every kept sample weighs more (docs/maths.md §4.5)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rlgen_cli.algos import nonzero_advantage_rows
from rlgen_cli.models import Cond
from rlgen_cli.recipes import flow_grpo
from rlgen_cli.recipes.flow_grpo import Rollouts
from rlgen_cli.sde.rollout import Trajectory
from rlgen_cli.training.distributed.dist import LocalDist
from rlgen_cli.training.reporting.progress import Progress
from tests.conftest import TINY_RUN

ADV = torch.tensor([0.0, 1.5, 0.0, -0.5, 0.0, 0.0, 1.0, 0.0])  # samples 1, 3 and 6 carry a signal


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_nonzero_rows_are_kept_and_topped_up_to_whole_micro_batches():
    rows = nonzero_advantage_rows(ADV, num_batches=2, generator=_gen())
    # 3 kept; 3 % 2 = 1 → one zero-advantage sample fills the second micro-batch: 4 rows, ascending
    assert len(rows) == 4 and rows.tolist() == sorted(rows.tolist())
    assert {1, 3, 6} <= set(rows.tolist())
    assert ADV[rows].eq(0).sum() == 1
    assert nonzero_advantage_rows(ADV, num_batches=3, generator=_gen()).tolist() == [1, 3, 6]


def test_fillers_are_random_and_cover_an_all_zero_batch():
    fillers = {
        tuple(set(nonzero_advantage_rows(ADV, 2, _gen(seed)).tolist()) - {1, 3, 6}) for seed in range(20)
    }
    assert len(fillers) > 1  # drawn from the generator, not always the first zero
    rows = nonzero_advantage_rows(torch.zeros(6), num_batches=3, generator=_gen())
    assert len(rows) == 3  # nothing to learn from: one sample per micro-batch (upstream's Fast script)
    assert nonzero_advantage_rows(torch.ones(4), 2, _gen()).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("advantages", "num_batches", "match"),
    [(torch.zeros(2, 4), 1, r"must be \(N,\)"), (ADV, 0, "do not fill"), (ADV, 9, "do not fill")],
)
def test_bad_arguments_are_rejected(advantages, num_batches, match):
    with pytest.raises(ValueError, match=match):
        nonzero_advantage_rows(advantages, num_batches, _gen())


def _one_step_rollouts(n: int) -> Rollouts:
    """n samples with one trained step whose stored log-prob is 0; the conditioning carries sample ids."""
    zeros = torch.zeros(n, 1, 1)
    traj = Trajectory(
        latents=zeros,
        next_latents=zeros,
        logprobs=torch.zeros(n, 1),
        stds=torch.ones(n, 1),
        sigmas=torch.tensor([1.0]),
        sigmas_next=torch.tensor([0.5]),
        step_indices=torch.tensor([0]),
        sigma_max=1.0,
        final=zeros[:, 0],
    )
    return Rollouts(torch.arange(n), [""] * n, [{}] * n, Cond({"ids": torch.arange(n)}), traj, zeros)


def _logp_gradient(monkeypatch, drop: bool) -> tuple[torch.Tensor, int]:
    """d(loss of one epoch)/d(new log-prob) per sample, through the recipe's own micro-batching and
    loss, and the number of optimizer steps. 8 samples, train batches of 4, 2 micro-batches per step."""
    algo = SimpleNamespace(
        train_batch_size=4,
        gradient_accumulation_steps=2,
        num_inner_epochs=1,
        objective="grpo",
        clip_range=1e-4,
        kl_weight=0.0,
        timesteps_per_pass=1,
    )
    sampler = SimpleNamespace(
        kind="flow_sde", noise_level=0.7, logprob_reduce="mean", logprob_form="gaussian"
    )
    run = SimpleNamespace(
        cfg=SimpleNamespace(algo=algo, sampler=sampler), device=torch.device("cpu"), dist=LocalDist("cpu")
    )
    logp = torch.zeros(len(ADV), requires_grad=True)  # ratio 1: inside the trust region
    # the training forward of sample i gives log-prob logp[i] (the stored one is 0)
    monkeypatch.setattr(
        flow_grpo,
        "step_logprob",
        lambda _run, _traj, cond, _j, _spec: (SimpleNamespace(logprob=logp[cond.tensors["ids"]]), None),
    )
    steps = []
    monkeypatch.setattr(flow_grpo.flow_run, "optimizer_step", lambda _run: steps.append(1) or 0.0)
    keep, num_batches = torch.arange(len(ADV)), None
    if drop:
        num_batches = len(ADV) // algo.train_batch_size
        keep = nonzero_advantage_rows(ADV, num_batches, _gen())
    rollouts = _one_step_rollouts(len(ADV)).select(keep)
    flow_grpo.update(run, rollouts, ADV[keep], Progress(enabled=False), num_batches)
    return logp.grad, len(steps)


def test_kept_samples_weigh_as_upstreams_filtered_loss(monkeypatch):
    # by hand, at ratio 1 the policy loss of a micro-batch is mean(−A·ratio): ∂/∂logp_i = −A_i / |batch|,
    # and each micro-batch's loss is divided by the 2 accumulated micro-batches
    kept, steps_kept = _logp_gradient(monkeypatch, drop=False)
    torch.testing.assert_close(kept, -ADV / (4 * 2))  # 2 batches of 4
    dropped, steps_dropped = _logp_gradient(monkeypatch, drop=True)
    torch.testing.assert_close(dropped, -ADV / (2 * 2))  # the 4 trained samples in 2 batches of 2
    assert steps_kept == steps_dropped == 1  # the same optimizer steps: N / N' = 2× the weight each


def test_a_run_with_equal_rewards_trains_one_sample_per_micro_batch(cli, tmp_path, monkeypatch):
    # every group's rewards are equal → every advantage is 0 → 1 filler per micro-batch (4 samples, 1 batch)
    def equal_rewards(run, images, prompts, metadata, sources=None, by_tag=False):
        return {name: torch.full((len(prompts),), 0.5) for name in run.reward.rewards}, {}

    monkeypatch.setattr(flow_grpo.flow_run, "score", equal_rewards)
    code, out = cli(
        "train",
        *TINY_RUN,
        "epochs=1",
        "eval_every=0",
        "save_every=0",
        "images_every=0",
        "algo.drop_zero_advantage=true",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 0, out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["trained_samples"] for row in rows if "trained_samples" in row] == [1]  # of 4 sampled


TWO_PROCESSES = (
    "model=tiny_sd3 algo=grpo launcher=accelerate launcher.num_processes=2 algo.gradient_accumulation_steps=2"
)


def _composed(args: str):
    from omegaconf import OmegaConf

    from rlgen_cli._hydra import compose_verb

    cfg = compose_verb("train", args.split())
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = "/tmp/unused"
    return cfg


def test_per_process_packing_runs_with_a_warning_unless_exactness_is_insisted_on(caplog):
    """Several processes, algo=grpo's upstream packing: under the default launcher.exact_reduction (null,
    on where it can be) the run goes ahead and says it depends on the process count; under true it is
    refused naming the fix."""
    from rlgen_cli.errors import UserError
    from rlgen_cli.tasks.common import validated

    with caplog.at_level("WARNING", logger="rlgen_cli.schema.algo"):
        typed = validated(_composed(TWO_PROCESSES))
    assert typed.algo.drop_zero_advantage and typed.launcher.reduces_exactly
    assert "this run differs from one on another process count" in caplog.text
    with pytest.raises(UserError, match="pass algo.drop_zero_advantage=false"):
        validated(_composed(f"{TWO_PROCESSES} launcher.exact_reduction=true"))
