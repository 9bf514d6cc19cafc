"""ShapesEval training from the shipped base at CI size (DiffusionNFT, as the default `rlgen train` runs it;
GRPO-Fast in the slow suite), the run-length controls it relies on (eval before training, the time limit,
on GRPO-Fast), and the whole default run (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rlgen_cli._hydra import DEFAULT_RUNS
from rlgen_cli.models.shapes import MODEL_ASSETS
from rlgen_cli.training.reporting.images import CAPTIONED_TILE, FAIL_COLOR, PASS_COLOR, caption_height
from rlgen_cli.training.reporting.report import ROW_LABEL_WIDTH

SMALL = [
    "algo.prompts_per_epoch=2", "algo.group_size=4", "algo.sample_batch_size=8",
    "algo.train_batch_size=8", "algo.gradient_accumulation_steps=1", "algo.lr=1e-3", "data.eval_num_prompts=12",
    "model.eval_num_steps=4", "eval_every=3", "images_every=0", "progress=false",
]  # fmt: skip
STRICT = "eval/reward/shapes_geneval/strict/mean"
LENIENT = "eval/reward/shapes_geneval/accuracy/mean"
EXTRA = "eval/reward/shapes_geneval/n_extra/mean"
HELDOUT_STRICT = "eval_heldout/reward/shapes_geneval/strict/mean"


def _green_tiles(grid_png: Path, n: int, columns: int) -> int:
    """How many of the ``n`` tiles of a captioned grid wear the green (strict pass) border."""
    with Image.open(grid_png) as grid:
        pixels = grid.convert("RGB").load()
        height = CAPTIONED_TILE + caption_height()
        corners = [pixels[(i % columns) * CAPTIONED_TILE + 1, (i // columns) * height + 1] for i in range(n)]
    assert set(corners) <= {PASS_COLOR, FAIL_COLOR}, set(corners)  # every tile marked, nothing else
    return corners.count(PASS_COLOR)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# The default, and GRPO-Fast (slow: the same reports; GRPO-Fast trains on ShapesEval in the time-limit tests
# below and raises its reward in tests/recipes/test_learning_flow.py).
@pytest.mark.parametrize(
    "experiment", ["shapes_nft", pytest.param("shapes_grpo_fast", marks=pytest.mark.slow)]
)
def test_training_from_the_shipped_base_changes_weights_and_reports(cli, tmp_path: Path, experiment: str):
    run = tmp_path / "shapes"
    code, out = cli("train", f"experiment={experiment}", *SMALL, "epochs=3", f"hydra.run.dir={run}")
    assert code == 0, out
    rows = _rows(run)
    # epochs completed: evaluated before training, then after every epoch
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for row in (rows[0], rows[1], rows[-1]):
        assert 0 <= row[STRICT] <= row[LENIENT] + 1e-9 <= 1 + 1e-9
        assert "eval/reward/shapes_geneval/strict/tag/counting" in row
    # the held-out split: evaluated before and after only, 12 prompts (data.eval_num_prompts) × 1 image
    assert [r["step"] for r in rows if HELDOUT_STRICT in r] == [0, 3]
    assert rows[-1]["eval_heldout/num_samples"] == 12
    table = (run / "before_after.txt").read_text().splitlines()
    assert table[0].split()[:2] == ["tag", "strict"] and table[-3].startswith("overall")
    strict_before, strict_after = rows[0][HELDOUT_STRICT], rows[-1][HELDOUT_STRICT]
    assert table[-2].split()[:4] == [
        "unseen",
        f"{100 * strict_before:.1f}",
        "→",
        f"{100 * strict_after:.1f}",
    ]
    assert table[-1].startswith("unseen: 12 samples")
    assert (run / "shapes_curves.png").is_file()
    # before (top) and after (bottom) of the 12 prompts, 32-pixel samples drawn 128 wide over their captions,
    # right of the strip naming the rows
    with Image.open(run / "images" / "before_after.png") as grid:
        assert grid.size == (ROW_LABEL_WIDTH + 12 * CAPTIONED_TILE, 2 * (CAPTIONED_TILE + caption_height()))
    # each evaluation grid (4 columns of 12) marks as many passes as its strict accuracy counts
    images = run / "images"
    assert _green_tiles(images / "eval_epoch_000000.png", 12, 4) == round(12 * rows[0][STRICT])
    assert _green_tiles(images / "eval_heldout_epoch_000000.png", 12, 4) == round(12 * strict_before)
    assert _green_tiles(images / "eval_heldout_epoch_000003.png", 12, 4) == round(12 * strict_after)
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


@pytest.mark.parametrize("counts", ["wall", "training"])
def test_time_limit_stops_after_the_epoch_that_crosses_it_and_saves(cli, tmp_path: Path, counts: str):
    run = tmp_path / "limited"
    code, out = cli(
        "train",
        "experiment=shapes_grpo_fast",
        *SMALL,
        "epochs=50",
        "time_limit_minutes=0.0001",
        f"time_limit_counts={counts}",
        "eval_before=false",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1] and STRICT in rows[0] and rows[0]["time/epoch"] > 0
    assert HELDOUT_STRICT in rows[0]  # the held-out split: after the last epoch, with or without eval_before
    assert (run / "checkpoints" / "epoch_000001").is_dir()


TAG = "eval/reward/shapes_geneval/strict/tag/"
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


@pytest.mark.slow
def test_the_default_run_gains_strict_accuracy_unflagged(cli, tmp_path: Path):
    """The whole default `rlgen train` (DiffusionNFT, ≈ 16.5 min on 2 idle cores; measured +21.9 strict,
    two_object +12.5, counting +20.8, every tag up, extra objects 0.7 → 0.4, held-out +7.4, guard silent
    — docs/shapes.md): ≥ +15 strict points at the last evaluation, two_object and counting ≥ +8 each, no
    tag falling, no more extra objects than before, the held-out combinations not falling, and the
    reward-hacking guard never flagged. The GRPO-Fast recipe's seed-42 run (+11.8) fails it."""
    run = tmp_path / "default"
    default = DEFAULT_RUNS["train"]  # what `rlgen train` adds without a group choice (run_cli's is tiny_cpu)
    code, out = cli("train", "progress=false", default, f"hydra.run.dir={run}")
    assert code == 0, out
    rows = _rows(run)
    evals = [row for row in rows if STRICT in row]
    before, after = evals[0], evals[-1]
    assert before["step"] == 0
    assert after[STRICT] - before[STRICT] >= 0.15, (before[STRICT], after[STRICT])
    gains = {tag: after[TAG + tag] - before[TAG + tag] for tag in TAGS}
    assert gains["two_object"] >= 0.08 and gains["counting"] >= 0.08, gains
    assert min(gains.values()) >= 0, gains
    assert after[EXTRA] <= before[EXTRA], (before[EXTRA], after[EXTRA])
    heldout = [row[HELDOUT_STRICT] for row in rows if HELDOUT_STRICT in row]
    assert len(heldout) == 2 and heldout[1] >= heldout[0], heldout
    assert not [key for row in rows for key in row if key.startswith("guard/event/")]
    assert all("guard/heldout" in row for row in evals)  # the guard watched every evaluation
