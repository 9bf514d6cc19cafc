"""R3 with a fully fine-tuned text track and a text KL keeps its reference at the starting weights across a
resume (``CompositePolicy.keep_reference`` before the checkpoint loads): a resumed run ends bit-equal to
an uninterrupted one, where a reference copied after the load would be the checkpoint itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

RUN = [
    "model=tiny_r3", "progress=false", "epochs=2", "save_every=1", "keep_last=5", "eval_every=0",
    "r3.policy.text.lora.enabled=false", "r3.kl_weight_text=0.5", "r3.lr=1e-2",
]  # fmt: skip


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "peak_memory"))} for row in rows]


def test_a_resumed_run_keeps_the_starting_text_reference(cli, tmp_path: Path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, out = cli("train", *RUN, f"hydra.run.dir={straight}")
    assert code == 0, out
    shutil.copytree(straight / "checkpoints/epoch_000001", resumed / "checkpoints/epoch_000001")
    (resumed / "metrics.jsonl").write_text((straight / "metrics.jsonl").read_text().splitlines(True)[0])
    code, out = cli("train", *RUN, "resume=auto", f"hydra.run.dir={resumed}")
    assert code == 0, out
    assert _rows(resumed) == _rows(straight)
    paths = sorted((straight / "checkpoints/epoch_000002/weights/text").glob("*.safetensors"))
    assert paths, "no text weights saved"
    for path in paths:
        a, b = load_file(path), load_file(resumed / path.relative_to(straight))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
