"""DiffusionNFT's old policy (``recipes/flow_forward.py``) in every checkpoint a run can resume: the guard's
``best_heldout`` carries it as the epoch checkpoints do, and a checkpoint without it (saved by an older
rlgen) resumes only where the old policy was the checkpoint's own weights (decay 0 at its last refresh);
elsewhere the resume is refused rather than rebuilt from the weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rlgen_cli.recipes.flow_forward import OLD_KEY
from rlgen_cli.training.checkpoints.checkpoint import COUNTERS_KEY, STATE_FILE, write_manifest
from rlgen_cli.training.control.ema import SHADOW_KEY
from tests.recipes.test_forward_cli import RUN, _weights

NFT = [
    *RUN,
    "algo=nft",
    "algo.forward.nft_beta=0.5",
    "algo.forward.old.rate=0.3",
    "algo.forward.old.max_decay=0.9",
]
FLAT = "algo.forward.old.flat_steps=5"  # decay 0 for the first 5 steps: the old policy is the weights


def _state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / STATE_FILE, weights_only=True)


def _without_old_policy(source: Path, run: Path, epoch: int) -> None:
    """``run`` stopped after ``epoch`` with ``source``'s checkpoint as an older rlgen saved it."""
    name = f"checkpoints/epoch_{epoch:06d}"
    shutil.copytree(source / name, run / name)
    state = _state(run / name)
    del state[OLD_KEY]
    torch.save(state, run / name / STATE_FILE)
    write_manifest(run / name)


def test_the_guards_best_checkpoint_holds_the_old_policy_of_its_epoch(cli, tmp_path: Path):
    run = tmp_path / "guarded"
    guard = ["eval_every=1", "data.eval_num_prompts=2", "+guard.monitors.brightness=1.0", "guard.window=1"]
    code, out = cli("train", *NFT, "reward=brightness", *guard, "epochs=2", f"hydra.run.dir={run}")
    assert code == 0, out
    best = _state(run / "checkpoints" / "best_heldout")
    epoch = best[COUNTERS_KEY]["epoch"]
    assert epoch > 0, "the held-out reward never rose past its value before training: nothing to compare"
    same_epoch = _state(run / "checkpoints" / f"epoch_{epoch:06d}")
    assert OLD_KEY in best
    for saved, expected in zip(best[OLD_KEY][SHADOW_KEY], same_epoch[OLD_KEY][SHADOW_KEY], strict=True):
        assert torch.equal(saved, expected)


def test_a_checkpoint_without_the_old_policy_is_refused_where_it_was_not_the_weights(cli, tmp_path: Path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert cli("train", *NFT, "epochs=1", f"hydra.run.dir={whole}")[0] == 0
    _without_old_policy(whole, resumed, 1)
    code, out = cli("train", *NFT, "epochs=2", "resume=auto", f"hydra.run.dir={resumed}")
    assert code == 2, out
    assert "does not hold the old policy" in out and "decay 0.3" in out
    assert not (resumed / "checkpoints" / "epoch_000002").exists()


def test_a_checkpoint_without_the_old_policy_resumes_exactly_where_the_decay_was_0(cli, tmp_path: Path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert cli("train", *NFT, FLAT, "epochs=2", f"hydra.run.dir={whole}")[0] == 0
    _without_old_policy(whole, resumed, 1)
    code, out = cli("train", *NFT, FLAT, "epochs=2", "resume=auto", f"hydra.run.dir={resumed}")
    assert code == 0, out
    expected, got = _weights(whole, 2), _weights(resumed, 2)
    assert expected.keys() == got.keys() and len(expected) > 0
    assert all(torch.equal(expected[k], got[k]) for k in expected)
