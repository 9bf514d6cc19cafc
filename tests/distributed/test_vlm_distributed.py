"""The VLM recipes over two CPU (gloo) processes: the same config (two micro-batches per optimizer step,
counted over all processes: one process accumulates both, two take one each) gives the same rollouts,
group statistics, loss and update to float rounding; resume and SFT work.

Token GRPO runs 3 prompts × 4 completions, rolled out in batches of 6 — rank 0 holds group 0 and half of
group 1, rank 1 the other half and group 2 — so the rewards must be gathered with their dataset indices
before normalising, each rank must sample its rows under the seed of their global rollout batch, and
dapo's token normaliser must count the tokens of both ranks (``recipes/vlm_rl.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_cli

GEOMETRY = [
    "model=tiny_qwen2_vl", "data=tiny_vlm", "reward=length", "progress=false", "eval_every=0",
    "algo.prompts_per_epoch=3", "algo.group_size=4", "algo.sample_batch_size=6", "algo.train_batch_size=6",
    "algo.gradient_accumulation_steps=2", "algo.token.max_completion_tokens=12", "algo.lr=1e-2", "algo.kl_weight=0.04", "epochs=2", "save_every=1",
]  # fmt: skip
TOKEN_GRPO = ["algo=token_grpo", *GEOMETRY]  # dapo: the loss normaliser spans ranks
PAIR = ["launcher=accelerate", "launcher.num_processes=2"]
ADAPTER = Path("weights") / "adapter_model.safetensors"
# what must match between the runs: the same samples, group statistics, loss and KL
SAME = ("reward/mean", "reward/std", "zero_std_ratio", "num_groups", "completions/mean_length",
        "policy_loss", "kl_loss", "ratio_min", "ratio_max", "lr")  # fmt: skip


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"epoch_{epoch:06d}" / ADAPTER)


def _train(run: Path, *overrides: str) -> Path:
    code, out = run_cli("train", *overrides, f"hydra.run.dir={run}")
    assert code == 0, out
    return run


def _assert_same_runs(one: Path, two: Path, epochs: int) -> None:
    rows_one, rows_two = _metrics(one), _metrics(two)
    assert len(rows_one) == len(rows_two) == epochs  # rank 0 alone wrote metrics.jsonl
    for a, b in zip(rows_one, rows_two, strict=True):
        for key in SAME:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]  # averaged over ranks
    x, y = _weights(one, epochs), _weights(two, epochs)
    assert x.keys() == y.keys()
    assert max((x[k] - y[k]).abs().max().item() for k in x) < 1e-5


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two epochs of token GRPO: one process accumulating both micro-batches of a step, and two processes."""
    root = tmp_path_factory.mktemp("vlm_dist")
    single = _train(root / "single", *TOKEN_GRPO)
    pair = _train(root / "pair", *TOKEN_GRPO, *PAIR)
    return single, pair


def test_two_processes_equal_one_with_accumulation(token_runs: tuple[Path, Path]):
    single, pair = token_runs
    rows = _metrics(pair)
    assert rows[0]["num_groups"] == 3 and rows[0]["reward/std"] > 0  # group 1 spans both ranks
    assert rows[0]["ratio_min"] == rows[0]["ratio_max"] == 1.0 and rows[1]["kl_loss"] > 0
    _assert_same_runs(single, pair, epochs=2)


@pytest.mark.slow  # ~11 s; single-process VLM resume is in test_vlm_recipes
def test_resumed_pair_equals_the_uninterrupted_one(token_runs: tuple[Path, Path], tmp_path: Path):
    _, pair = token_runs
    middle = pair / "checkpoints" / "epoch_000001"
    resumed = _train(tmp_path, *TOKEN_GRPO, *PAIR, f"resume={middle}")
    assert [row["step"] for row in _metrics(resumed)] == [2]
    a, b = _weights(resumed, 2), _weights(pair, 2)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@pytest.mark.slow  # ~11 s; the 2-process token GRPO test covers the VLM's DDP path
def test_sft_on_two_processes_changes_the_weights(tmp_path: Path):
    from peft.utils import get_peft_model_state_dict

    from rlgen_cli.vlm.policy import build_vlm
    from tests.vlm.conftest import compose_config

    sft = [*GEOMETRY[:5], "algo=vlm_sft", "data.train=builtin:tiny_sft.jsonl", "algo.lr=1e-2", "epochs=1"]
    run = _train(tmp_path, *sft, *PAIR)
    rows = _metrics(run)
    assert len(rows) == 1 and rows[0]["global_step"] == 1 and rows[0]["tokens"] > 0
    typed, _ = compose_config("train", sft)
    initial = get_peft_model_state_dict(build_vlm(typed.model, torch.device("cpu")).model)
    trained = _weights(run, 1)
    assert set(trained) == set(initial)
    assert not [k for k in initial if torch.equal(initial[k], trained[k]) and "lora_B" in k]


@pytest.mark.slow
def test_step_grpo_two_processes_equal_one(tmp_path: Path):
    step = ["algo=step_grpo", *GEOMETRY, "epochs=1"]
    single = _train(tmp_path / "single", *step)
    _assert_same_runs(single, _train(tmp_path / "pair", *step, *PAIR), epochs=1)


@pytest.mark.slow  # ~14 s; test_engines runs a ZeRO-2 epoch in the default suite
def test_deepspeed_zero2_equals_one_process(token_runs: tuple[Path, Path], tmp_path: Path):
    pytest.importorskip("deepspeed")
    single, _ = token_runs
    zero2 = _train(tmp_path, *TOKEN_GRPO, "launcher=deepspeed_zero2", "launcher.num_processes=2")
    _assert_same_runs(single, zero2, epochs=2)
    assert (zero2 / "checkpoints" / "epoch_000002" / "engine").is_dir()  # the ZeRO optimizer shards


@pytest.mark.parametrize(
    ("sharded", "world_size", "engine", "message"),
    [(True, 2, "hf", "launcher=deepspeed_zero2"), (False, 2, "vllm", "algo.token.engine=hf")],
)
def test_sharded_weights_and_multi_process_vllm_are_refused(sharded, world_size, engine, message):
    from rlgen_cli.errors import UserError
    from rlgen_cli.vlm.training import require_whole_weights

    with pytest.raises(UserError, match=message):
        require_whole_weights(SimpleNamespace(sharded=sharded, world_size=world_size), engine)
    require_whole_weights(SimpleNamespace(sharded=False, world_size=2), "hf")
