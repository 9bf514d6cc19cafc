"""A policy group: one prompt's group of 8 spread over two processes (4 each), sharing the prompt,
the initial noise and the SDE window, with group statistics computed over the whole group.

In rlgen a policy group is not a special mode: the global batch is dealt over ranks in micro-batches, the
noise streams are keyed by global position (or by group with ``shared_initial_noise``), the window by
epoch, and rewards are gathered with their dataset indices before normalising. So the two-process run
must equal the one-process run exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GEOMETRY = [
    "algo.prompts_per_epoch=1", "algo.group_size=8", "algo.sample_batch_size=4", "algo.train_batch_size=4",
    "algo.gradient_accumulation_steps=2", "algo.shared_initial_noise=true", "algo=grpo_fast", "algo.window.size=1", "sampler=cps",
    "model.num_steps=3", "epochs=1", "eval_every=0", "images_every=0", "progress=false",
]  # fmt: skip


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow  # ~15 s; test_ddp_equivalence gathers groups across two ranks in the default suite
def test_group_spanning_two_processes_is_one_group(cli, tmp_path: Path):
    single, pair = tmp_path / "single", tmp_path / "pair"
    code, out = cli("train", *GEOMETRY, f"hydra.run.dir={single}")
    assert code == 0, out
    code, out = cli(
        "train", *GEOMETRY, "launcher=accelerate", "launcher.num_processes=2", f"hydra.run.dir={pair}"
    )
    assert code == 0, out
    one, two = _metrics(single), _metrics(pair)
    assert one["num_groups"] == two["num_groups"] == 1  # both halves normalised as one group
    for key in ("reward/mean", "reward/std", "policy_loss", "trained_samples"):
        assert abs(one[key] - two[key]) <= 1e-9 * max(1.0, abs(one[key])), key
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-6 * one["grad_norm"]
