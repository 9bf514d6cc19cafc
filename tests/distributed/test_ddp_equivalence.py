"""One process and two gloo processes run the same config bit for bit: same rewards, same weights.

The config is global — 2 prompts × 4 samples per epoch, global micro-batches of 2, and
``algo.gradient_accumulation_steps=2`` micro-batches per optimizer step over all processes — so the epoch
has two optimizer steps; the pair deals the micro-batches round-robin (rank 0: 0 and 2, rank 1: 1 and
3), puts the gathered rewards back in global order, and sums the gradients in float64 once per step
(``launcher.exact_reduction``, on for ``launcher=accelerate``). Both compute with one CPU thread per
process: a matmul's float sums depend on how many threads split it. The 1 / 2 / 4-process version over two
epochs, and the arm without exact reduction, are in test_process_invariance.py (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from tests.distributed.test_process_invariance import one_thread

GEOMETRY = [
    "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.sample_batch_size=2", "algo.train_batch_size=2",
    "algo.gradient_accumulation_steps=2", "model.num_steps=3", "epochs=1", "eval_every=0", "images_every=0",
    "progress=false",
]  # fmt: skip


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "epoch_000001" / "weights" / LORA_WEIGHTS_NAME)


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_two_processes_equal_one(cli, tmp_path: Path):
    single, pair = tmp_path / "single", tmp_path / "pair"
    with one_thread():  # as each launched worker computes (OMP_NUM_THREADS=1): the same CPU kernels
        code, out = cli("train", *GEOMETRY, f"hydra.run.dir={single}")
    assert code == 0, out
    code, out = cli(
        "train", *GEOMETRY, "launcher=accelerate", "launcher.num_processes=2", f"hydra.run.dir={pair}"
    )
    assert code == 0, out
    one, two = _metrics(single), _metrics(pair)
    assert one["num_groups"] == two["num_groups"] == 2  # the groups were gathered across ranks
    assert one["global_step"] == two["global_step"] == 2  # two optimizer steps in the epoch
    for key in ("reward/mean", "reward/std", "zero_std_ratio", "trained_samples", "policy_loss", "grad_norm"):
        assert one[key] == two[key], key
    a, b = _weights(single), _weights(pair)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
