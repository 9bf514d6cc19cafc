"""A ``-m`` sweep separates its jobs: a rule line, then the job's header, before each job's output."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_RUN


@pytest.mark.slow  # ≈ 25 s: two one-epoch tiny trainings
def test_each_sweep_job_starts_after_a_rule_line(cli, tmp_path: Path):
    code, out = cli(
        "train",
        "-m",
        "algo.lr=1e-3,3e-3",
        *TINY_RUN,
        "epochs=1",
        "eval_every=0",
        "images_every=0",
        "save_every=0",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert code == 0, out
    lines = out.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("sweep job ")]
    assert [lines[i].split(" → ")[0] for i in headers] == ["sweep job 0", "sweep job 1"], out
    for i in headers:
        assert set(lines[i - 1].strip()) == {"─"}, lines[i - 1]  # the rule right above the header
    assert "epoch 1" in "\n".join(lines[headers[0] : headers[1]])  # job 0's output lies between the two
