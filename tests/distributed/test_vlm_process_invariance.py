"""Process-count invariance of the VLM recipes: the same config on 1, 2 and 4 processes, bit for bit.

Token GRPO: 4 prompts × 4 completions in global micro-batches of 2 (rollout batches of 2 too), 4
micro-batches per optimizer step → 2 steps per epoch, and on 2 processes each takes 2 micro-batches of
every step, dealt round-robin (global micro-batch b → process b mod 2), so every group spans both
processes. The completions of a rollout batch are sampled under a seed keyed by its global position,
rewards are put back in global order before the group statistics, dapo's token normaliser counts the
tokens of the whole step and gradients are summed in float64 once per step (``recipes/vlm_rl.py``,
``launcher.exact_reduction``). SFT: the 8 conversations of tiny_sft.jsonl (none dropped) in micro-batches of 1,
4 per step → 2 steps per epoch, dealt the same way (``recipes/vlm_sft.py``). Each process sums two
micro-batches per step, so DDP's float32 all-reduce (the failing arm) meets them in another order. The single-process runs compute with one thread, as launched workers do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli
from tests.distributed.test_process_invariance import one_thread

COMMON = [
    "model=tiny_qwen2_vl",
    "data=tiny_vlm",
    "reward=length",
    "progress=false",
    "eval_every=0",
    "epochs=2",
]
TOKEN_GRPO = [
    *COMMON, "algo=token_grpo", "algo.prompts_per_epoch=4", "algo.group_size=4", "algo.sample_batch_size=2",
    "algo.train_batch_size=2", "algo.gradient_accumulation_steps=4", "algo.token.max_completion_tokens=12",
    "algo.lr=1e-2", "algo.kl_weight=0.04",
]  # fmt: skip
SFT = [
    *COMMON, "algo=vlm_sft", "data.train=builtin:tiny_sft.jsonl", "algo.token.sft_drop_markers=[]",
    "algo.train_batch_size=1", "algo.gradient_accumulation_steps=4", "algo.lr=1e-2",
]  # fmt: skip
PAIR = ["launcher=accelerate", "launcher.num_processes=2"]
QUAD = ["launcher=accelerate", "launcher.num_processes=4"]
ADAPTER = Path("checkpoints") / "epoch_000002" / "weights" / "adapter_model.safetensors"
TOKEN_SAME = ("reward/mean", "reward/std", "zero_std_ratio", "num_groups", "completions/mean_length",
              "policy_loss", "kl_loss", "ratio_min", "ratio_max", "grad_norm", "lr", "global_step")  # fmt: skip
SFT_SAME = ("loss", "tokens", "grad_norm", "lr", "global_step")


def _train(run: Path, *overrides: str) -> Path:
    with one_thread():
        code, out = run_cli("train", *overrides, f"hydra.run.dir={run}")
    assert code == 0, out
    return run


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / ADAPTER)


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_same_runs(one: Path, two: Path, keys: tuple[str, ...]) -> None:
    rows_one, rows_two = _metrics(one), _metrics(two)
    assert len(rows_one) == len(rows_two) == 2
    for a, b in zip(rows_one, rows_two, strict=True):
        for key in keys:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert _bit_equal(_weights(one), _weights(two))


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm_invariance")
    return {"one": _train(root / "one", *TOKEN_GRPO), "two": _train(root / "two", *TOKEN_GRPO, *PAIR)}


@pytest.mark.slow  # ~1 min on two CPU cores
def test_token_grpo_on_two_processes_is_bit_identical(token_runs: dict[str, Path]):
    rows = _metrics(token_runs["two"])
    assert rows[-1]["global_step"] == 4 and rows[0]["num_groups"] == 4  # 2 steps per epoch, 4 groups
    assert rows[0]["reward/std"] > 0 and rows[1]["kl_loss"] > 0  # the update moved the policy
    _assert_same_runs(token_runs["one"], token_runs["two"], TOKEN_SAME)


@pytest.mark.slow  # ~30 s: the arm that shows the test above can fail
def test_token_grpo_float32_all_reduce_breaks_bit_equality(token_runs: dict[str, Path], tmp_path: Path):
    inexact = _train(tmp_path, *TOKEN_GRPO, *PAIR, "launcher.exact_reduction=false")
    first = _metrics(token_runs["one"])[0]
    assert _metrics(inexact)[0]["reward/mean"] == first["reward/mean"]  # the same samples
    assert not _bit_equal(_weights(token_runs["one"]), _weights(inexact))


@pytest.mark.slow  # ~1 min: one micro-batch of every step on each of 4 processes
def test_token_grpo_on_four_processes_is_bit_identical(token_runs: dict[str, Path], tmp_path: Path):
    four = _train(tmp_path, *TOKEN_GRPO, *QUAD)
    _assert_same_runs(token_runs["one"], four, TOKEN_SAME)


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm_sft_invariance")
    return {"one": _train(root / "one", *SFT), "two": _train(root / "two", *SFT, *PAIR)}


@pytest.mark.slow  # ~40 s
def test_sft_on_two_processes_is_bit_identical(sft_runs: dict[str, Path]):
    rows = _metrics(sft_runs["two"])
    assert rows[-1]["global_step"] == 4 and rows[0]["tokens"] > 0  # 2 steps per epoch
    _assert_same_runs(sft_runs["one"], sft_runs["two"], SFT_SAME)


@pytest.mark.slow  # ~20 s: the arm that shows the test above can fail
def test_sft_float32_all_reduce_breaks_bit_equality(sft_runs: dict[str, Path], tmp_path: Path):
    inexact = _train(tmp_path, *SFT, *PAIR, "launcher.exact_reduction=false")
    assert _metrics(inexact)[0]["tokens"] == _metrics(sft_runs["one"])[0]["tokens"]  # the same batches
    assert not _bit_equal(_weights(sft_runs["one"]), _weights(inexact))


@pytest.mark.slow  # ~40 s
def test_sft_on_four_processes_is_bit_identical(sft_runs: dict[str, Path], tmp_path: Path):
    four = _train(tmp_path, *SFT, *QUAD)
    _assert_same_runs(sft_runs["one"], four, SFT_SAME)


def test_sft_micro_batches_are_dealt_round_robin():
    from rlgen_cli.recipes.vlm_sft import rank_micro_batches

    whole = rank_micro_batches(7, seed=3, batch_size=2, rank=0, world_size=1)
    halves = [rank_micro_batches(7, seed=3, batch_size=2, rank=r, world_size=2) for r in (0, 1)]
    assert [len(b) for b in whole] == [2, 2, 2, 1] and sorted(i for b in whole for i in b) == list(range(7))
    assert halves == [[whole[0], whole[2]], [whole[1], whole[3]]]  # micro-batch b → process b mod 2
    # 5 conversations make 3 micro-batches: the order wraps to 4 full ones, 2 per process
    padded = [rank_micro_batches(5, seed=3, batch_size=2, rank=r, world_size=2) for r in (0, 1)]
    order = [i for b in rank_micro_batches(5, seed=3, batch_size=2, rank=0, world_size=1) for i in b]
    assert [len(b) for p in padded for b in p] == [2, 2, 2, 2]
    assert padded[0][0] + padded[1][0] + padded[0][1] + padded[1][1] == [*order, *order[:3]]


def test_token_grpo_deals_whole_rollout_batches_when_the_step_allows():
    from rlgen_cli.recipes.vlm_rl import assignment_unit
    from rlgen_cli.schema.algo import TokenAlgoConfig

    geometry = {"prompts_per_epoch": 4, "group_size": 4}
    small = TokenAlgoConfig(
        **geometry, sample_batch_size=2, train_batch_size=2, gradient_accumulation_steps=4
    )
    assert [assignment_unit(small, n) for n in (1, 2, 4)] == [2, 2, 2]
    mixed = TokenAlgoConfig(
        **geometry, sample_batch_size=4, train_batch_size=2, gradient_accumulation_steps=4
    )
    assert [assignment_unit(mixed, n) for n in (1, 2)] == [4, 4]  # a step of 8 = 2 pieces of 4
    # R1-VL's step: 16 completions rolled out in one batch cannot give 4 processes whole rollout batches,
    # so each takes training micro-batches (and samples them itself)
    r1vl = TokenAlgoConfig(
        **geometry, sample_batch_size=16, train_batch_size=1, gradient_accumulation_steps=16
    )
    assert [assignment_unit(r1vl, n) for n in (1, 4)] == [16, 1]
