"""``algo.shuffle_samples=per_process``: Flow-Factory's per-process permutation of the samples before
micro-batches are cut (docs/maths.md §4.5). Same samples, same per-sample gradient; only which samples
share a micro-batch and an optimizer step changes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.data.sample_order import flow_factory_seed, shuffled_order, training_orders
from rlgen_cli.recipes import flow_grpo
from rlgen_cli.training.distributed.dist import LocalDist
from rlgen_cli.training.reporting.progress import Progress
from tests.conftest import TINY_RUN
from tests.recipes.test_zero_advantage import ADV, _composed, _one_step_rollouts

# the module whose optimizer_step the recipe calls (recipes/flow_run.py; recipes/loop.py before it)
STEPPER = getattr(flow_grpo, "flow_run", None) or flow_grpo.loop
MASK64 = 2**64 - 1
# CPython's tuple hash (Objects/tupleobject.c, xxHash's round on 64-bit Py_hash_t)
XXPRIME_1, XXPRIME_2, XXPRIME_5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def cpython_int_tuple_hash(items: tuple[int, ...]) -> int:
    """hash() of a tuple of small non-negative ints (each hashes to itself), by the documented rounds."""
    acc = XXPRIME_5
    for lane in items:
        acc = (acc + lane * XXPRIME_2) & MASK64
        acc = ((acc << 31) | (acc >> 33)) & MASK64  # rotate left by 31
        acc = (acc * XXPRIME_1) & MASK64
    acc = (acc + (len(items) ^ (XXPRIME_5 ^ 3527539))) & MASK64
    signed = acc - 2**64 if acc >= 2**63 else acc
    return 1546275796 if signed == -1 else signed


@pytest.mark.parametrize("key", [(0, 0, 0), (42, 0, 0), (42, 3, 1), (12345, 19, 2)])
def test_the_seed_is_flow_factorys_hash_of_seed_epoch_and_inner_epoch(key):
    assert flow_factory_seed(*key) == cpython_int_tuple_hash(key) % 2**32


def test_each_inner_epoch_permutes_every_sample_once_with_its_own_draw():
    orders = training_orders("per_process", 42, 3, 2, 16)
    assert len(orders) == 2
    for inner, order in enumerate(orders):
        assert sorted(order.tolist()) == list(range(16))  # a permutation: every sample trains once
        expected = torch.Generator().manual_seed(cpython_int_tuple_hash((42, 3, inner)) % 2**32)
        assert order.tolist() == torch.randperm(16, generator=expected).tolist()
    assert orders[0].tolist() != orders[1].tolist()
    assert orders[0].tolist() != list(range(16))  # not rollout order
    assert shuffled_order(42, 4, 0, 16).tolist() != orders[0].tolist()  # the epoch reseeds
    assert training_orders("none", 42, 3, 2, 16) is None


def test_an_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="expected 'none' or 'per_process'"):
        training_orders("random", 0, 0, 1, 4)


def _trained(monkeypatch, shuffle: str, accumulation: int) -> tuple[list[list[int]], torch.Tensor]:
    """Which samples (ids) each optimizer step trains, in order, and d(loss)/d(log-prob) per sample,
    through the recipe's own micro-batching: 8 samples in micro-batches of 2."""
    algo = SimpleNamespace(
        train_batch_size=2,
        gradient_accumulation_steps=accumulation,
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
    logp = torch.zeros(len(ADV), requires_grad=True)
    steps: list[list[int]] = [[]]

    def logprob_of(_run, _traj, cond, _j, _spec):
        steps[-1].extend(cond.tensors["ids"].tolist())
        return SimpleNamespace(logprob=logp[cond.tensors["ids"]]), None

    monkeypatch.setattr(flow_grpo, "step_logprob", logprob_of)
    monkeypatch.setattr(STEPPER, "optimizer_step", lambda _run: steps.append([]) or 0.0)
    orders = training_orders(shuffle, 42, 0, 1, len(ADV))
    flow_grpo.update_values(run, _one_step_rollouts(len(ADV)), ADV, Progress(enabled=False), orders=orders)
    return steps[:-1], logp.grad


def test_shuffling_changes_which_samples_share_a_step_and_not_their_gradient(monkeypatch):
    in_order, grad = _trained(monkeypatch, "none", accumulation=2)
    assert in_order == [[0, 1, 2, 3], [4, 5, 6, 7]]
    shuffled, shuffled_grad = _trained(monkeypatch, "per_process", accumulation=2)
    # by hand: seed 42, epoch 0, inner epoch 0 → randperm(8) under Flow-Factory's seed, cut in order
    seed = cpython_int_tuple_hash((42, 0, 0)) % 2**32
    order = torch.randperm(8, generator=torch.Generator().manual_seed(seed)).tolist()
    assert shuffled == [order[:4], order[4:]]
    assert {frozenset(s) for s in shuffled} != {frozenset(s) for s in in_order}
    # ratio 1: ∂loss/∂logp_i = −A_i / (2 per micro-batch · 2 micro-batches per step), whatever the order
    assert torch.equal(grad, -ADV / 4) and torch.equal(shuffled_grad, grad)


def test_one_step_per_epoch_trains_the_same_samples_in_one_step(monkeypatch):
    (in_order,), _ = _trained(monkeypatch, "none", accumulation=4)
    (shuffled,), _ = _trained(monkeypatch, "per_process", accumulation=4)
    assert shuffled != in_order and sorted(shuffled) == in_order == list(range(8))


# -- one process, the real recipe -------------------------------------------------------------------
EIGHT_SAMPLES = [
    *(o for o in TINY_RUN if not o.startswith(("algo.group_size", "algo.train_batch_size"))),
    "algo.group_size=4", "algo.train_batch_size=1", "epochs=1", "eval_every=0", "images_every=0",
]  # fmt: skip


def _run(cli, run_dir: Path, monkeypatch, *overrides: str) -> tuple[list[list[float]], dict, dict]:
    """Train one epoch; returns the stored log-probs (they identify the samples) each optimizer step
    trained, the epoch's metrics and the trained LoRA weights."""
    steps: list[list[float]] = [[]]
    step_loss, optimizer_step = flow_grpo.step_loss, STEPPER.optimizer_step

    def recording_loss(algo, out, kl, step_traj, j, adv, gate=None):
        if j == 0:  # each micro-batch's first trained step: one entry per sample
            steps[-1].extend(step_traj.logprobs[:, j].tolist())
        return step_loss(algo, out, kl, step_traj, j, adv, gate)

    def recording_step(run):
        steps.append([])
        return optimizer_step(run)

    monkeypatch.setattr(flow_grpo, "step_loss", recording_loss)
    monkeypatch.setattr(STEPPER, "optimizer_step", recording_step)
    code, out = cli("train", *EIGHT_SAMPLES, *overrides, f"hydra.run.dir={run_dir}")
    assert code == 0, out
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (weights,) = sorted((run_dir / "checkpoints").glob("epoch_*/weights/**/*.safetensors"))
    return steps[:-1], row, load_file(weights)


@pytest.mark.slow  # four tiny trainings, about 20 s on two cores
def test_a_one_process_run_differs_only_in_which_samples_share_a_step(cli, tmp_path, monkeypatch):
    eps = torch.finfo(torch.float32).eps
    for accumulation, num_steps in ((8, 1), (4, 2)):
        geometry = f"algo.gradient_accumulation_steps={accumulation}"
        kept, kept_row, kept_weights = _run(cli, tmp_path / f"none{num_steps}", monkeypatch, geometry)
        shuffled, row, weights = _run(
            cli, tmp_path / f"shuffled{num_steps}", monkeypatch, geometry, "algo.shuffle_samples=per_process"
        )
        assert len(kept) == len(shuffled) == num_steps
        # the same samples (one trained step each here), rolled out and scored alike
        assert sorted(sum(kept, [])) == sorted(sum(shuffled, [])) and len(set(sum(kept, []))) == 8
        order = shuffled_order(42, 0, 0, 8).tolist()
        rollout_order = sum(kept, [])
        assert sum(shuffled, []) == [rollout_order[i] for i in order]
        assert {k: v for k, v in row.items() if k.startswith("reward")} == {
            k: v for k, v in kept_row.items() if k.startswith("reward")
        }
        moved = max((weights[k] - kept_weights[k]).abs().max().item() for k in weights)
        # one step over the same 8 per-sample gradients (summed in float64): the same update
        if num_steps == 1:
            for key, value in weights.items():
                torch.testing.assert_close(value, kept_weights[key], rtol=4 * eps, atol=4 * eps * 1e-2)
        else:  # the first step sees other samples: another update
            assert {frozenset(s) for s in shuffled} != {frozenset(s) for s in kept}
            assert moved > 1e-4, moved


TWO_PROCESSES = (
    "model=tiny_sd3 algo=grpo launcher=accelerate launcher.num_processes=2 algo.drop_zero_advantage=false"
)


def test_several_processes_warn_and_exactness_refuses(caplog):
    """Like algo.drop_zero_advantage: a warning under the default launcher.exact_reduction (null), refused
    under true naming the fix."""
    from rlgen_cli.errors import UserError
    from rlgen_cli.tasks.common import validated

    shuffled = f"{TWO_PROCESSES} algo.shuffle_samples=per_process"
    with caplog.at_level("WARNING", logger="rlgen_cli.schema.algo"):
        validated(_composed(shuffled))
    assert "algo.shuffle_samples=per_process permutes each process's own samples" in caplog.text
    with pytest.raises(UserError, match="pass algo.shuffle_samples=none"):
        validated(_composed(f"{shuffled} launcher.exact_reduction=true"))
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlgen_cli.schema.algo"):
        validated(_composed(f"{TWO_PROCESSES} launcher.exact_reduction=true"))  # none: nothing to refuse
    assert "differs from one on another process count" not in caplog.text


def test_an_unknown_shuffle_is_refused_at_compose_time(cli, tmp_path):
    code, out = cli("train", *EIGHT_SAMPLES, "algo.shuffle_samples=random", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "shuffle_samples" in out, out
