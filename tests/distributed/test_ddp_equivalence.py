"""One process × 8 samples and two gloo processes × 4 give the same rewards, advantages and update.

Both runs roll out in batches of 4 (SD3's outputs depend slightly on batch size) — the single process
with two accumulated micro-batches, the pair with one each and DDP averaging — so the per-sample noise
streams, the gathered group statistics and the averaged gradients must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME

GEOMETRY = [
    "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.sample_batch_size=4", "algo.train_batch_size=4",
    "model.num_steps=3", "epochs=1", "eval_every=0", "images_every=0", "progress=false",
]  # fmt: skip


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "epoch_000001" / "weights" / LORA_WEIGHTS_NAME)


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


def test_two_processes_equal_one(cli, tmp_path: Path):
    single, pair = tmp_path / "single", tmp_path / "pair"
    code, out = cli("train", *GEOMETRY, "algo.gradient_accumulation_steps=2", f"hydra.run.dir={single}")
    assert code == 0, out
    code, out = cli(
        "train", *GEOMETRY, "launcher=accelerate", "launcher.num_processes=2", f"hydra.run.dir={pair}"
    )
    assert code == 0, out
    one, two = _metrics(single), _metrics(pair)
    assert one["num_groups"] == two["num_groups"] == 2  # the groups were gathered across ranks
    for key in ("reward/mean", "reward/std", "zero_std_ratio", "trained_samples", "policy_loss"):
        assert abs(one[key] - two[key]) <= 1e-9 * max(1.0, abs(one[key])), key
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-6 * one["grad_norm"]  # DDP-averaged gradient
    a, b = _weights(single), _weights(pair)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
