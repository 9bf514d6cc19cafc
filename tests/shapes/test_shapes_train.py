"""The default `rlgen train` (ShapesEval, GRPO-Fast from the shipped base) at CI size, and the
run-length controls it relies on (eval before training, the time limit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.models.shapes import MODEL_ASSETS

SMALL = [
    "experiment=shapes_grpo_fast", "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.sample_batch_size=8",
    "algo.train_batch_size=8", "algo.gradient_accumulation_steps=1", "algo.lr=1e-3", "data.eval_num_prompts=12",
    "model.eval_num_steps=4", "eval_every=3", "images_every=0", "progress=false",
]  # fmt: skip
STRICT = "eval/reward/shapes_geneval/strict/mean"
LENIENT = "eval/reward/shapes_geneval/accuracy/mean"
EXTRA = "eval/reward/shapes_geneval/n_extra/mean"


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_grpo_fast_from_the_shipped_base_changes_weights_and_reports(cli, tmp_path: Path):
    run = tmp_path / "shapes"
    code, out = cli("train", *SMALL, "epochs=3", f"hydra.run.dir={run}")
    assert code == 0, out
    rows = _rows(run)
    assert [r["step"] for r in rows] == [-1, 0, 1, 2]  # evaluated before training, then every epoch
    for row in (rows[0], rows[1], rows[-1]):
        assert 0 <= row[STRICT] <= row[LENIENT] + 1e-9 <= 1 + 1e-9
        assert "eval/reward/shapes_geneval/strict/tag/counting" in row
    table = (run / "before_after.txt").read_text().splitlines()
    assert table[0].split()[:2] == ["tag", "strict"] and table[-1].startswith("overall")
    assert (run / "images" / "before_after.png").is_file() and (run / "shapes_curves.png").is_file()
    trained = load_file(
        run
        / "checkpoints"
        / "epoch_000003"
        / "weights"
        / "transformer"
        / "diffusion_pytorch_model.safetensors"
    )
    base = load_file(MODEL_ASSETS / "shapes_base" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(trained[k], base[k]) for k in base)


def test_time_limit_stops_after_the_epoch_that_crosses_it_and_saves(cli, tmp_path: Path):
    run = tmp_path / "limited"
    code, out = cli(
        "train", *SMALL, "epochs=50", "time_limit_minutes=0.0001", "eval_before=false", f"hydra.run.dir={run}"
    )
    assert code == 0, out
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0] and STRICT in rows[0] and rows[0]["time/epoch"] > 0
    assert (run / "checkpoints" / "epoch_000001").is_dir()


@pytest.mark.slow
def test_the_default_run_raises_strict_accuracy_by_ten_points(cli, tmp_path: Path):
    """The whole default `rlgen train` (≈ 17 min on 2 idle cores): ≥ +10 strict points at the last
    evaluation, and no more extra objects than before."""
    run = tmp_path / "default"
    code, out = cli("train", "experiment=shapes_grpo_fast", "progress=false", f"hydra.run.dir={run}")
    assert code == 0, out
    evals = [row for row in _rows(run) if STRICT in row]
    before, after = evals[0], evals[-1]
    assert before["step"] == -1
    assert after[STRICT] - before[STRICT] >= 0.10, (before[STRICT], after[STRICT])
    assert after[EXTRA] <= before[EXTRA], (before[EXTRA], after[EXTRA])
