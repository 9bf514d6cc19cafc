"""A policy group of 2 on 2 processes: both ranks roll out the same group — prompt (reason) or stage-1
image (refine), initial noise and SDE step — each its own half of the branches, with group statistics over
both halves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.r3.conftest import TINY_R3


def _rows(run: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run / "samples" / f"rank_{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~22 s on two processes; R3's single-process tracks run in the default suite
def test_two_ranks_share_prompt_noise_and_sde_step(tmp_path: Path):
    overrides = [
        *TINY_R3, "epochs=2", "launcher=accelerate", "launcher.num_processes=2", "r3.group_size=4",
        f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    code, out = run_cli("train", *overrides)
    assert code == 0, out
    rank0, rank1 = _rows(tmp_path, 0), _rows(tmp_path, 1)
    assert [r["position"] for r in rank0] == [0, 1] * 2 and [r["position"] for r in rank1] == [2, 3] * 2
    for step, stage in ((1, "reason"), (2, "refine")):  # steps completed, as metrics.jsonl
        rows = [r for r in rank0 + rank1 if r["step"] == step]
        assert {r["stage"] for r in rows} == {stage} and {r["group"] for r in rows} == {0}
        shared = {(r["index"], r["prompt"], r["sde_step"], r["noise_sum"]) for r in rows}
        assert len(shared) == 1, shared  # one prompt, one initial noise, one SDE step on both ranks
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["stage"] for m in metrics] == [0.0, 1.0]
    assert metrics[1]["buffer/size"] == 4  # both ranks' stage-1 images, on every rank
