"""Process-count invariance: the same config gives the same run on 1, 2 and 4 processes, bit for bit.

The config states global quantities (``algo.prompts_per_epoch × algo.group_size`` samples per epoch,
``algo.gradient_accumulation_steps`` micro-batches per optimizer step over all processes); each process
takes whole micro-batches dealt round-robin (``data/sampler.py``), rewards are put back in global order
before the group statistics, and gradients are summed in float64 once per step
(``training/distributed/dist.py``, ``launcher.exact_reduction``). The CLI runs below have several optimizer steps
per epoch and several micro-batches per step, so both the assignment and the reduction matter: with
the old contiguous slices or with DDP's own float32 all-reduce the weights after two epochs differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from rlgen_cli.data import GroupSampler
from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from rlgen_cli.training.distributed.dist import LocalDist
from tests.conftest import run_cli

# 16 samples per epoch in global micro-batches of 2: 8 micro-batches, 4 per optimizer step → 2 steps per
# epoch; on 4 processes each takes one micro-batch of every step, on 2 processes two
GEOMETRY = [
    "algo.prompts_per_epoch=4", "algo.group_size=4", "algo.sample_batch_size=2", "algo.train_batch_size=2",
    "algo.gradient_accumulation_steps=4", "model.num_steps=3", "epochs=2", "eval_every=0", "images_every=0",
    "progress=false",
]  # fmt: skip
SAME = ("reward/mean", "reward/std", "zero_std_ratio", "num_groups", "trained_samples", "policy_loss",
        "grad_norm", "global_step")  # fmt: skip


@contextmanager
def one_thread() -> Iterator[None]:
    """One CPU thread for an in-process run, as every launched worker has (OMP_NUM_THREADS=1): the float
    sums inside a CPU matmul depend on how many threads split it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _train(run: Path, *overrides: str) -> Path:
    with one_thread():
        code, out = run_cli("train", *GEOMETRY, *overrides, f"hydra.run.dir={run}")
    assert code == 0, out
    return run


def _processes(n: int) -> list[str]:
    return [] if n == 1 else ["launcher=accelerate", f"launcher.num_processes={n}"]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the pieces, in one process ----------------------------------------------------------------------
def test_micro_batches_are_dealt_round_robin():
    ranks = [GroupSampler(10, 4, 4, seed=3, num_replicas=2, rank=r) for r in (0, 1)]
    assert ranks[0].positions(unit=2) == [0, 1, 4, 5, 8, 9, 12, 13]
    assert ranks[1].positions(unit=2) == [2, 3, 6, 7, 10, 11, 14, 15]
    assert ranks[1].positions() == list(range(8, 16))  # default: one contiguous slice
    everyone = ranks[0].global_indices_for_epoch(5)
    assert ranks[1].indices_for_epoch(5, unit=2) == [everyone[p] for p in ranks[1].positions(unit=2)]
    with pytest.raises(ValueError, match="pieces of 3 samples"):
        ranks[0].positions(unit=3)


def _summed_gradient(terms: list[float], exact: bool) -> torch.Tensor:
    """The gradient of Σ_i terms[i]·w accumulated over one backward per term, as a step would see it."""
    weight = nn.Parameter(torch.zeros(1))
    dist = LocalDist(torch.device("cpu"))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    dist.prepare(None, optimizer, max_grad_norm=0.0, micro_batch_size=1, exact_reduction=exact)
    for term in terms:
        dist.backward((weight * torch.tensor(term)).sum())
    if exact:
        dist.exact.reduce()
    return weight.grad.clone()


@pytest.mark.parametrize("exact", [True, False])
def test_exact_reduction_makes_the_sum_order_free(exact: bool):
    # float32: 1 + 1e-8 rounds back to 1, so ((1 + ε) − 1) + ε = ε but (1 − 1) + (ε + ε) = 2ε
    eps = 1e-8
    sequential = _summed_gradient([1.0, eps, -1.0, eps], exact)  # one process: g0, g1, g2, g3
    paired = _summed_gradient([1.0, -1.0, eps, eps], exact)  # the order two processes' sums meet in
    if exact:
        assert torch.equal(sequential, paired) and sequential.item() == pytest.approx(2 * eps, rel=1e-6)
    else:  # the perturbation arm: float32 accumulation depends on the order
        assert not torch.equal(sequential, paired)


def test_a_parameter_no_backward_reached_keeps_no_gradient():
    used, unused = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    dist = LocalDist(torch.device("cpu"))
    optimizer = torch.optim.SGD([used, unused], lr=0.1)
    dist.prepare(None, optimizer, max_grad_norm=0.0, micro_batch_size=1, exact_reduction=True)
    dist.backward((3 * used).sum())
    assert used.grad is None and unused.grad is None  # moved into the float64 buffer
    dist.clip_and_step(optimizer, [used, unused], float("inf"))
    assert torch.allclose(used.detach(), torch.full((2,), 0.7)) and torch.equal(
        unused.detach(), torch.ones(2)
    )


# -- settings that cannot be split: exit code 2 before anything runs ------------------------------------
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            [
                "algo.gradient_accumulation_steps=3",
                "algo.train_batch_size=2",
                "algo.sample_batch_size=2",
                "algo.prompts_per_epoch=3",
                "algo.group_size=4",
            ],
            "algo.gradient_accumulation_steps=3 micro-batches per optimizer step cannot be split over 2 processes",
        ),
        (
            [
                "algo.gradient_accumulation_steps=2",
                "algo.train_batch_size=2",
                "algo.sample_batch_size=4",
                "algo.prompts_per_epoch=2",
                "algo.group_size=4",
            ],
            "lcm(algo.sample_batch_size=4, algo.train_batch_size=2) = 4 samples at a time",
        ),
    ],
)
def test_an_unsplittable_step_stops_with_the_reason(cli, overrides: list[str], expected: str):
    code, out = cli("train", *overrides, "launcher=accelerate", "launcher.num_processes=2")
    assert code == 2 and expected in out, out


def test_one_process_rolls_out_across_optimizer_steps():
    """A rollout batch spanning two optimizer steps has nothing to deal on one process (the fast rollout
    of docs/memory_speed.md); two processes could not each take whole rollout batches of it."""
    from rlgen_cli.errors import UserError
    from rlgen_cli.schema.algo import FlowGrpoAlgoConfig

    algo = FlowGrpoAlgoConfig(
        prompts_per_epoch=2,
        group_size=4,
        sample_batch_size=8,
        train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    algo.require_process_split(1)
    with pytest.raises(UserError, match="in whole rollout batches"):
        algo.require_process_split(2)


def test_exact_reduction_is_refused_where_an_engine_reduces(cli):
    code, out = cli("train", "launcher=deepspeed_zero2", "launcher.exact_reduction=true")
    assert code == 2 and "launcher.exact_reduction=false" in out, out


# -- real runs over gloo -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("invariance")
    return {n: _train(root / f"processes_{n}", *_processes(n)) for n in (1, 2, 4)}


@pytest.mark.slow  # ~4 min on two CPU cores (the 4-process run); test_ddp_equivalence is the quick one
@pytest.mark.parametrize("processes", [2, 4])
def test_the_process_count_changes_no_result(runs: dict[int, Path], processes: int):
    one, many = _metrics(runs[1]), _metrics(runs[processes])
    assert len(one) == len(many) == 2 and one[-1]["global_step"] == 4  # 2 steps per epoch
    for a, b in zip(one, many, strict=True):
        for key in SAME:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert _bit_equal(_weights(runs[1]), _weights(runs[processes]))


@pytest.mark.slow  # ~1 min: the arm that shows the test above can fail
def test_float32_all_reduce_breaks_bit_equality(runs: dict[int, Path], tmp_path: Path):
    inexact = _train(tmp_path / "inexact", *_processes(2), "launcher.exact_reduction=false")
    a, b = _weights(runs[1]), _weights(inexact)
    assert not _bit_equal(a, b)
    assert _metrics(runs[1])[0]["reward/mean"] == _metrics(inexact)[0]["reward/mean"]  # same samples
