"""A reward that turns NaN (or infinite) mid-run stops the run with one line and exit code 2, naming the
last good checkpoint; that checkpoint is intact, and ``resume=auto`` continues from it exactly as an
uninterrupted run would have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from rlgen_cli.rewards.base import RewardBatch, RewardResult
from rlgen_cli.rewards.registry import REWARDS
from rlgen_cli.training.checkpoints.checkpoint import (
    CHECKPOINTS_DIR,
    COUNTERS_KEY,
    list_checkpoints,
    open_checkpoint,
)
from tests.conftest import TINY_RUN

NAME = "fails_from_call"  # registered by the fixture below, for these tests only
RUN = [*TINY_RUN, "save_every=1", "keep_last=5", "eval_every=0", "images_every=0", "algo.lr=1e-2"]


class FailsFromCall:
    """Scores 0 for its first ``from_call`` calls, then ``value`` (``nan``, ``inf`` …) for every sample.

    The tiny run scores its 4 samples in one batch per epoch, so call k is epoch k (0-based)."""

    def __init__(self, from_call: int, value: str = "nan") -> None:
        self.name, self.from_call, self.value, self.calls = NAME, from_call, float(value), 0

    def score(self, batch: RewardBatch) -> RewardResult:
        failing = self.calls >= self.from_call
        self.calls += 1
        return RewardResult(scores=torch.full((len(batch),), self.value if failing else 0.0))


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    monkeypatch.setitem(REWARDS, NAME, FailsFromCall)


def _train(run: Path, epochs: int, fails_from_call: int, value: str = "nan", *extra: str) -> tuple[int, str]:
    """The tiny run with its JPEG reward plus the failing one (whose 0 leaves the JPEG scores unchanged)."""
    from tests.conftest import run_cli

    return run_cli(
        "train",
        *RUN,
        f"epochs={epochs}",
        f"+reward.weights.{NAME}=1.0",
        f"+reward.kwargs.{NAME}={{from_call: {fails_from_call}, value: {value}}}",
        *extra,
        f"hydra.run.dir={run}",
    )


def _lora(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(run / CHECKPOINTS_DIR / f"epoch_{epoch:06d}" / "weights" / LORA_WEIGHTS_NAME)


def _assert_stopped_after_first_epoch(run: Path, code: int, out: str, what: str) -> None:
    """Exit 2 with one line naming the reward, the count and the last good checkpoint (no traceback);
    epoch 1's checkpoint alone, complete."""
    assert code == 2, out
    assert "Traceback" not in out, out
    last_good = run / CHECKPOINTS_DIR / "epoch_000001"
    (line,) = [line for line in out.splitlines() if line.startswith("error:")]
    assert line.startswith(
        f"error: non-finite rewards {{'{NAME}': '{what}'}} in a scored batch of 4 samples"
    ), out
    assert line.endswith(f"the last good checkpoint is {last_good} (resume=auto continues from it)"), out
    assert [c.path.name for c in list_checkpoints(run)] == ["epoch_000001"]
    on_disk = sorted(p.name for p in (run / CHECKPOINTS_DIR).iterdir())
    assert on_disk == ["epoch_000001"]  # no half-written checkpoint or temporary directory left behind
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["reward/mean"] == rows[0]["reward/mean"]
    ckpt = open_checkpoint(run / CHECKPOINTS_DIR / "epoch_000001")
    assert ckpt.state()[COUNTERS_KEY]["epoch"] == 1
    weights = _lora(run, 1)
    assert weights and all(bool(torch.isfinite(w).all()) for w in weights.values())


def test_inf_reward_stops_the_run_and_keeps_the_last_checkpoint(tmp_path: Path):
    run = tmp_path / "run"
    code, out = _train(run, 3, 1, "inf")
    _assert_stopped_after_first_epoch(run, code, out, "0 NaN, 4 inf")


def _abort_then_resume(crashed: Path) -> None:
    """A NaN at epoch 2 of 2 stops the run; with the reward fixed, ``resume=auto`` finishes it from epoch 1."""
    code, out = _train(crashed, 2, 1, "nan")
    _assert_stopped_after_first_epoch(crashed, code, out, "4 NaN, 0 inf")
    fixed = f"resume_changes=[reward.kwargs.{NAME}]"  # the reward fixed: it never fails now
    code, out = _train(crashed, 2, 99, "nan", "resume=auto")
    assert code == 2 and "reward.kwargs.fails_from_call.from_call: 1 → 99" in out, out  # not by accident
    code, out = _train(crashed, 2, 99, "nan", "resume=auto", fixed)
    assert code == 0, out
    last_good = crashed / CHECKPOINTS_DIR / "epoch_000001"
    assert f"resumed from {last_good} at epoch 1" in (crashed / "run.log").read_text()
    rows = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # epoch 2 logged once, by the resumed run


def test_nan_reward_stops_the_run_and_resume_auto_finishes_it(tmp_path: Path):
    _abort_then_resume(tmp_path / "crashed")
    assert [c.path.name for c in list_checkpoints(tmp_path / "crashed")] == ["epoch_000001", "epoch_000002"]


@pytest.mark.slow  # two more epochs for the uninterrupted reference
def test_resume_after_a_nan_abort_equals_an_uninterrupted_run(tmp_path: Path):
    crashed, straight = tmp_path / "crashed", tmp_path / "straight"
    _abort_then_resume(crashed)
    code, out = _train(straight, 2, 99, "nan")
    assert code == 0, out
    resumed, uninterrupted = _lora(crashed, 2), _lora(straight, 2)
    assert resumed.keys() == uninterrupted.keys() and len(resumed) > 0
    for key in resumed:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=0, atol=0)
