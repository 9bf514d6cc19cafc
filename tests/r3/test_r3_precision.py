"""R3 in fp16: the one joint loss is scaled when any model a tuned track runs computes in fp16, the scale
is logged, and it travels in checkpoints like the flow and VLM recipes' (training/distributed/loss_scale.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.r3.policy import IMAGE, TEXT
from rlgen_cli.recipes.r3 import compute_dtype
from rlgen_cli.schema.model import model_config
from rlgen_cli.schema.r3 import R3CompositePolicy, R3Config
from tests.r3.conftest import TINY_R3


def _r3(text: str, generator: str, editor: str) -> R3Config:
    policy = R3CompositePolicy(
        text=model_config("qwen2_5_vl", tiny=True, dtype=text),
        generator=model_config("qwen_image", tiny=True, dtype=generator),
        editor=model_config("qwen_image_edit", tiny=True, dtype=editor),
    )
    return R3Config(policy=policy)


@pytest.mark.parametrize(
    ("dtypes", "tracks", "expected"),
    [
        (("float32", "float32", "float32"), [TEXT, IMAGE], "float32"),
        (("bfloat16", "bfloat16", "bfloat16"), [TEXT, IMAGE], "bfloat16"),
        (("bfloat16", "float16", "bfloat16"), [TEXT, IMAGE], "float16"),  # one fp16 model: scale
        (("float32", "bfloat16", "float16"), [IMAGE], "float16"),  # the editor trains in the image track
        (("float32", "float16", "float16"), [TEXT], "float32"),  # the image track is not tuned
        (("float16", "float32", "float32"), [TEXT], "float16"),
        (("float16", "float32", "float32"), [IMAGE], "float32"),
    ],
)
def test_the_loss_is_scaled_when_a_tuned_track_computes_in_fp16(dtypes, tracks, expected):
    assert compute_dtype(_r3(*dtypes), tracks) == expected


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


FP16 = [f"r3.policy.{role}.dtype=float16" for role in ("text", "generator", "editor")]


def test_one_fp16_step_logs_the_scale_and_saves_it(tmp_path: Path):
    from rlgen_cli.training.checkpoints.checkpoint import OPTIMIZER_KEY, STATE_FILE
    from rlgen_cli.training.distributed.dist import SCALER_KEY
    from rlgen_cli.training.distributed.loss_scale import INIT_SCALE
    from tests.conftest import run_cli

    code, out = run_cli("train", *TINY_R3, *FP16, "epochs=1", f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    (metrics,) = _metrics(tmp_path)
    assert (metrics["loss_scale"], metrics["skipped_steps"]) == (INIT_SCALE, 0.0), metrics
    assert metrics["grad_norm"] > 0  # unscaled before clipping: a 2^16-times norm would show
    saved = torch.load(tmp_path / "checkpoints" / "epoch_000001" / STATE_FILE, weights_only=True)
    assert saved[OPTIMIZER_KEY][SCALER_KEY]["scale"] == INIT_SCALE


@pytest.mark.slow
def test_fp16_run_logs_the_scale_and_resumes_it_exactly(tmp_path: Path, monkeypatch):
    """Two fp16 steps straight vs one step, then a resume: the scale (doubling after every clean step, so
    a scale the resume lost would show) and the trained weights of both runs are equal."""
    from rlgen_cli.training.checkpoints.checkpoint import OPTIMIZER_KEY, STATE_FILE
    from rlgen_cli.training.distributed import dist as dist_module
    from rlgen_cli.training.distributed.dist import SCALER_KEY
    from rlgen_cli.training.distributed.loss_scale import INIT_SCALE, LossScaler
    from tests.conftest import run_cli

    monkeypatch.setattr(dist_module, "LossScaler", functools.partial(LossScaler, growth_interval=1))
    run = [*TINY_R3, *FP16, "save_every=1", "keep_last=5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for args in (["epochs=2", f"hydra.run.dir={straight}"], ["epochs=1", f"hydra.run.dir={resumed}"]):
        code, out = run_cli("train", *run, *args)
        assert code == 0, out
    saved = torch.load(resumed / "checkpoints" / "epoch_000001" / STATE_FILE, weights_only=True)
    assert saved[OPTIMIZER_KEY][SCALER_KEY]["scale"] == 2 * INIT_SCALE  # one clean step grew it
    resume = ["epochs=2", "resume=auto", "resume_changes=[epochs]", f"hydra.run.dir={resumed}"]
    code, out = run_cli(
        "train", *run, *resume
    )  # the schedule's length named: the test's first run stopped at 1
    assert code == 0, out

    scales = [(row["loss_scale"], row["skipped_steps"]) for row in _metrics(straight)]
    assert scales == [(2 * INIT_SCALE, 0), (4 * INIT_SCALE, 0)]
    assert [(row["loss_scale"], row["skipped_steps"]) for row in _metrics(resumed)] == scales
    weights = "checkpoints/epoch_000002/weights"
    files = sorted(p.relative_to(straight / weights) for p in (straight / weights).rglob("*.safetensors"))
    assert len(files) == 3  # text, generator, editor
    for name in files:
        a, b = load_file(straight / weights / name), load_file(resumed / weights / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
