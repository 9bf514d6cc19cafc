"""Resume under DeepSpeed ZeRO: epoch 1, resume=auto, epoch 2 equals two uninterrupted epochs.

ZeRO partitions the optimizer state over ranks, so the checkpoint's ``engine/`` directory holds the engine's
own ``save_checkpoint`` output (one shard per rank), which its ``load_checkpoint`` restores; rlgen's
weights, counters and sampler sit beside it as for every launcher. Two gloo processes on the CPU, the
geometry of ``test_engines`` (2 prompts × 4 samples, one micro-batch of 4 per rank), a large learning rate
so that a lost Adam state would show in the second epoch's weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.errors import UserError
from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from rlgen_cli.training.checkpoints.checkpoint import ENGINE_DIR, OPTIMIZER_KEY, open_checkpoint
from rlgen_cli.training.distributed.dist import ENGINE_TAG, AccelerateDist, LocalDist
from tests.conftest import run_cli

pytest.importorskip("deepspeed")

GEOMETRY = [
    "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.sample_batch_size=4", "algo.train_batch_size=4",
    "model.num_steps=3", "eval_every=0", "images_every=0", "progress=false", "save_every=1", "algo.lr=1e-2",
    "launcher.num_processes=2",
]  # fmt: skip
# per-phase seconds and memory differ between any two runs
UNTIMED = ("time/", "peak_memory_mb")


def _weights(run: Path, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"epoch_{epoch:06d}" / "weights" / LORA_WEIGHTS_NAME)


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(UNTIMED)} for row in rows]


def _train(run: Path, *extra: str) -> None:
    code, out = run_cli("train", *GEOMETRY, *extra, f"hydra.run.dir={run}")
    assert code == 0, out


def _resume_equals_uninterrupted(tmp_path: Path, launcher: str, *extra: str) -> Path:
    """Two straight epochs; then a run holding only the straight run's first checkpoint — where an
    interrupted run would stand — resumes for the second (two launches instead of three). Returns it."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(straight, f"launcher={launcher}", "epochs=2", *extra)
    shutil.copytree(straight / "checkpoints" / "epoch_000001", resumed / "checkpoints" / "epoch_000001")
    _train(resumed, f"launcher={launcher}", "epochs=2", "resume=auto", *extra)
    a, b = _weights(straight, 2), _weights(resumed, 2)
    assert a.keys() == b.keys()
    assert max((a[k] - _weights(straight, 1)[k]).abs().max().item() for k in a) > 1e-4  # epoch 2 trained
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
    (_, one), (two,) = _metrics(straight), _metrics(resumed)  # the resumed run logs epoch 2 only
    assert one.keys() == two.keys() and two["global_step"] == 2
    for key, value in one.items():
        assert two[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    return resumed


def _engine_files(run: Path, epoch: int) -> list[str]:
    ckpt = open_checkpoint(run / "checkpoints" / f"epoch_{epoch:06d}")
    state = ckpt.state()
    assert state[OPTIMIZER_KEY] == {
        "engine": "deepspeed",
        "zero_stage": state[OPTIMIZER_KEY]["zero_stage"],
        "world_size": 2,
    }
    prefix = f"{ENGINE_DIR}/"
    names = sorted(name.removeprefix(prefix) for name in ckpt.manifest() if name.startswith(prefix))
    assert names and all((ckpt.engine / name).is_file() for name in names)
    return names


@pytest.mark.slow  # ~40 s; test_engines runs a ZeRO-2 epoch through the CLI in the default suite
def test_zero2_resume_equals_uninterrupted(tmp_path: Path):
    resumed = _resume_equals_uninterrupted(tmp_path, "deepspeed_zero2")
    shards = [name for name in _engine_files(resumed, 2) if "optim_states" in name]
    assert len(shards) == 2 and all(name.startswith(f"{ENGINE_TAG}/") for name in shards)  # one per rank
    assert not list((resumed / "checkpoints").glob(".*"))  # staging moved into the checkpoint


@pytest.mark.slow
def test_zero3_resume_equals_uninterrupted(tmp_path: Path):
    resumed = _resume_equals_uninterrupted(tmp_path, "deepspeed_zero3")
    assert len([name for name in _engine_files(resumed, 2) if "optim_states" in name]) == 2


EMA = ["algo.ema.enabled=true", "algo.ema.update_every=1", "algo.ema.decay=0.5", "eval_every=1",
       "data.eval_num_prompts=2", "model.eval_num_steps=3"]  # fmt: skip


@pytest.mark.slow
def test_zero3_ema_equals_zero2_ema_and_resumes(tmp_path: Path):
    """ZeRO-3 gathers the shards for the EMA update and writes the EMA into them for evaluation: the
    EMA-weighted evaluation, the saved EMA weights and the raw weights match ZeRO-2's whole-weight EMA,
    and a resume restores the EMA with the optimizer shards."""
    whole = tmp_path / "zero2"
    _train(whole, "launcher=deepspeed_zero2", "epochs=2", *EMA)
    resumed = _resume_equals_uninterrupted(tmp_path, "deepspeed_zero3", *EMA)
    for epoch in (1, 2):
        a, b = _weights(whole, epoch), _weights(resumed, epoch)  # the EMA weights
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
        raw_a, raw_b = (
            open_checkpoint(run / "checkpoints" / f"epoch_{epoch:06d}").state()["raw_trainable"]
            for run in (whole, resumed)
        )
        assert max((x - y).abs().max().item() for x, y in zip(raw_a, raw_b, strict=True)) < 1e-5
    one, two = _metrics(whole)[1], _metrics(resumed)[0]
    assert two["eval/reward/mean"] == pytest.approx(one["eval/reward/mean"], rel=1e-5)


# -- the errors, without processes --------------------------------------------------------------------
ZERO2_OF_2 = {"engine": "deepspeed", "zero_stage": 2, "world_size": 2}


def test_zero_shards_refuse_other_launchers(tmp_path: Path):
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(UserError, match="launcher=deepspeed_zero2 and 2 processes"):
        LocalDist(torch.device("cpu")).load_optimizer_state(optimizer, ZERO2_OF_2, tmp_path)


@pytest.mark.parametrize(
    ("stage", "world", "state", "match"),
    [
        (2, 4, ZERO2_OF_2, "ZeRO-2 over 2 processes, this run is ZeRO-2 over 4"),
        (3, 2, ZERO2_OF_2, "launcher=deepspeed_zero2"),
        (2, 2, {"state": {}, "param_groups": []}, "one full optimizer state"),
        (2, 2, None, "one full optimizer state"),
    ],
)
def test_zero_refuses_a_state_it_cannot_load(tmp_path: Path, stage: int, world: int, state, match: str):
    """Checked before the engine reads anything (``model`` is never touched)."""
    dist = SimpleNamespace(zero_stage=stage, world_size=world, model=None)
    with pytest.raises(UserError, match=match):
        AccelerateDist._load_engine_state(dist, state, tmp_path)
