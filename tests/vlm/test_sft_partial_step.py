"""SFT's optimizer step is the mean of the micro-batches it holds: a step cut short by the end of the epoch
(fewer micro-batches than ``gradient_accumulation_steps``) is not scaled down by the missing ones. An
epoch of one micro-batch under accumulation 3 takes the same step as under accumulation 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SFT = [
    "model=tiny_qwen2_vl",
    "algo=vlm_sft",
    "data=tiny_vlm",
    "data.train=builtin:tiny_sft.jsonl",
    "reward=length",
    "model.lora.enabled=false",
    "progress=false",
    "epochs=1",
    "eval_every=0",
    "algo.train_batch_size=64",
]  # fmt: skip  (64 ≥ the SFT set: the epoch is one micro-batch)


def _step(cli, run: Path, accumulation: int) -> dict:
    code, out = cli("train", *SFT, f"algo.gradient_accumulation_steps={accumulation}", f"hydra.run.dir={run}")
    assert code == 0, out
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


def test_a_step_cut_short_by_the_epoch_is_the_mean_of_what_it_holds(cli, tmp_path: Path):
    whole, short = _step(cli, tmp_path / "one", 1), _step(cli, tmp_path / "three", 3)
    assert whole["loss"] == short["loss"]  # the same micro-batch on the same weights
    assert short["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)  # not a third of it
