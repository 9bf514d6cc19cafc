"""Online DPO (``algo.pref.ref_update_step=N``) resumed from a checkpoint between two refreshes of its
reference copy: the copy travels in the checkpoint, so the resumed run samples from, and anchors its loss
to, the same reference as an uninterrupted one — same metrics, same weights, bit for bit. A checkpoint
without the copy (saved by an rlgen before it was kept) resumes only where the copy equals the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from rlgen_cli.recipes.flow_pref import REFERENCE_KEY
from rlgen_cli.training.checkpoints.checkpoint import STATE_FILE, write_manifest
from tests.conftest import TINY_RUN

# one optimizer step per epoch; the reference copy refreshed after steps 2, 4, ...: the epoch-1 checkpoint
# (global_step 1) lies between two refreshes, the epoch-2 one (global_step 2) on one
ONLINE_DPO = [
    *TINY_RUN, "algo=dpo", "algo.pref.ref_update_step=2", "algo.pref.timesteps_per_sample=1", "epochs=3",
    "save_every=1", "keep_last=5", "eval_every=0", "images_every=0", "algo.lr=1e-2",
]  # fmt: skip
UNTIMED = ("time/", "peak_memory_mb")  # differ between any two runs


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(UNTIMED)} for row in rows]


def _weights(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"epoch_{epoch:06d}" / "weights" / LORA_WEIGHTS_NAME)


def _stopped_after(straight: Path, run: Path, epoch: int, keep_reference: bool = True) -> Path:
    """``run`` as a run of ``straight``'s config stopped after ``epoch`` stands: that checkpoint and the
    metrics up to it; without ``keep_reference``, the checkpoint as an older rlgen saved it (no reference
    copy; its manifest rewritten to match)."""
    name = f"checkpoints/epoch_{epoch:06d}"
    shutil.copytree(straight / name, run / name)
    rows = (straight / "metrics.jsonl").read_text().splitlines(keepends=True)[:epoch]
    (run / "metrics.jsonl").write_text("".join(rows))
    if not keep_reference:
        state = torch.load(run / name / STATE_FILE, weights_only=True)
        del state[REFERENCE_KEY]
        torch.save(state, run / name / STATE_FILE)
        write_manifest(run / name)
    return run / name


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    from tests.conftest import run_cli

    run = tmp_path_factory.mktemp("online_dpo") / "straight"
    code, out = run_cli("train", *ONLINE_DPO, f"hydra.run.dir={run}")
    assert code == 0, out
    return run


def _assert_same_run(straight: Path, resumed: Path) -> None:
    expected, got = _rows(straight), _rows(resumed)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert all("dpo_loss" in r for r in got)
    assert got == expected
    a, b = _weights(straight, 3), _weights(resumed, 3)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)


def test_resume_between_refreshes_equals_the_uninterrupted_run(straight: Path, tmp_path: Path, cli):
    resumed = tmp_path / "resumed"
    checkpoint = _stopped_after(straight, resumed, 1)
    code, out = cli("train", *ONLINE_DPO, f"resume={checkpoint}", f"hydra.run.dir={resumed}")
    assert code == 0, out
    _assert_same_run(straight, resumed)


def test_a_checkpoint_without_the_reference_copy_is_refused_between_refreshes(
    straight: Path, tmp_path: Path, cli
):
    older = tmp_path / "older"
    checkpoint = _stopped_after(straight, older, 1, keep_reference=False)
    code, out = cli("train", *ONLINE_DPO, f"resume={checkpoint}", f"hydra.run.dir={older}")
    assert code == 2, out
    assert "does not hold online DPO's reference copy" in out, out
    assert "global_step is a multiple of algo.pref.ref_update_step=2" in out, out
    assert not (older / "checkpoints" / "epoch_000002").exists()


def test_a_checkpoint_without_the_reference_copy_resumes_on_a_refresh(straight: Path, tmp_path: Path, cli):
    """At global_step 2 the copy was just refreshed from the weights: rebuilding it from them is exact."""
    older = tmp_path / "older"
    checkpoint = _stopped_after(straight, older, 2, keep_reference=False)
    code, out = cli("train", *ONLINE_DPO, f"resume={checkpoint}", f"hydra.run.dir={older}")
    assert code == 0, out
    _assert_same_run(straight, older)
