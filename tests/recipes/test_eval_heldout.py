"""``eval_heldout``, the second test split, is evaluated after the last epoch of every run that sets it —
with or without ``eval_before``, fresh or resumed; a resumed ``eval_before`` run writes the same before →
after table as an uninterrupted one; ``eval_before`` or ``eval_heldout`` in a run that never evaluates
(``eval_every=0``) is refused at validation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlgen_cli.training.reporting.report import BEFORE_AFTER_TABLE
from tests.conftest import TINY_RUN

RUN = [*TINY_RUN, "epochs=2", "eval_every=5", "save_every=1", "keep_last=5", "images_every=0",
       "eval_heldout=builtin:tiny_test.txt"]  # fmt: skip
HELDOUT = "eval_heldout/reward/mean"


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_without_an_evaluation_before_training_evaluates_it_after_the_last_epoch(cli, tmp_path: Path):
    run = tmp_path / "run"
    code, out = cli("train", *RUN, "eval_before=false", f"hydra.run.dir={run}")
    assert code == 0, out
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert "eval/reward/mean" in rows[0] and HELDOUT not in rows[0]  # the first epoch's evaluation: test only
    assert HELDOUT in rows[1] and rows[1]["eval_heldout/num_samples"] > 0


def test_a_resumed_run_evaluates_it_after_the_last_epoch(cli, tmp_path: Path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli("train", *RUN, "eval_before=true", f"hydra.run.dir={straight}")[0] == 0
    shutil.copytree(straight / "checkpoints" / "epoch_000001", resumed / "checkpoints" / "epoch_000001")
    (resumed / "metrics.jsonl").write_text(
        "".join((straight / "metrics.jsonl").read_text().splitlines(True)[:2])
    )
    code, out = cli("train", *RUN, "eval_before=true", "resume=auto", f"hydra.run.dir={resumed}")
    assert code == 0, out
    last = _rows(resumed)[-1]
    assert last["step"] == 2 and last[HELDOUT] == _rows(straight)[-1][HELDOUT]
    # the evaluation before training read back from metrics.jsonl: the same before → after table
    table = (straight / BEFORE_AFTER_TABLE).read_text()
    assert "reward" in table and (resumed / BEFORE_AFTER_TABLE).read_text() == table


@pytest.mark.parametrize(
    "asked,named",
    [
        (
            [],
            "so eval_heldout=builtin:tiny_test.txt would do nothing: set eval_every=N, or eval_heldout=null",
        ),
        (["eval_before=true", "eval_heldout=null"], "so eval_before=True would do nothing"),
    ],
)
def test_a_run_that_never_evaluates_is_refused(cli, tmp_path: Path, asked: list[str], named: str):
    code, out = cli("train", *RUN, "eval_every=0", *asked, f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2, out
    assert f"eval_every=0 never evaluates, {named}" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
