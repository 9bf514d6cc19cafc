"""Full fine-tuning with a KL term keeps its reference at the starting weights across a resume: the
frozen copy is taken before the checkpoint's weights load (``VLMPolicy.keep_reference``), so a resumed run
ends bit-equal to an uninterrupted one. A copy made after the load would be the checkpoint itself, and
the policy would be pulled towards where it was, not where it started."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

RUN = [
    "model=tiny_qwen2_vl", "algo=token_grpo", "data=tiny_vlm", "reward=length", "progress=false", "epochs=2",
    "save_every=1", "keep_last=5", "eval_every=0", "algo.kl_weight=0.5", "algo.lr=1e-2",
    "model.lora.enabled=false",
]  # fmt: skip


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "peak_memory"))} for row in rows]


def test_a_resumed_full_fine_tuning_run_keeps_the_starting_reference(cli, tmp_path: Path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, out = cli("train", *RUN, f"hydra.run.dir={straight}")
    assert code == 0, out
    first = "checkpoints/epoch_000001"
    shutil.copytree(straight / first, resumed / first)
    (resumed / "metrics.jsonl").write_text((straight / "metrics.jsonl").read_text().splitlines(True)[0])
    code, out = cli("train", *RUN, "resume=auto", f"hydra.run.dir={resumed}")
    assert code == 0, out
    expected, got = _rows(straight), _rows(resumed)
    assert expected[1]["kl_loss"] > 0 and got == expected
    name = "checkpoints/epoch_000002/weights/model.safetensors"
    a, b = load_file(straight / name), load_file(resumed / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_reference_copied_after_a_load_is_refused(tmp_path: Path):
    from rlgen_cli.vlm.policy import build_vlm
    from tests.vlm.conftest import TINY_VLM, compose_config

    typed, _ = compose_config(
        "train", [*TINY_VLM, "algo=step_grpo", "reward=length", "model.lora.enabled=false"]
    )
    policy = build_vlm(typed.model, torch.device("cpu"))
    policy.save_trainable(tmp_path / "weights")
    policy.load_trainable(tmp_path / "weights")
    with pytest.raises(RuntimeError, match="must be kept"), policy.reference():
        pass
