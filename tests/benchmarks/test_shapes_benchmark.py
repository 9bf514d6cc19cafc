"""benchmarks/shapes.py's seed statistics: gains from each seed's own base, interpolated onto one grid."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("shapes_benchmark", ROOT / "benchmarks" / "shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SEEDS = {
    0: {"minutes": [0.0, 1.0, 2.0], "strict": [0.30, 0.35, 0.40], "lenient": [0.3, 0.3, 0.3],
        "extra_per_image": [0.7, 0.6, 0.5]},
    1: {"minutes": [0.0, 2.0], "strict": [0.20, 0.24], "lenient": [0.4, 0.5], "extra_per_image": [0.6, 0.6]},
}  # fmt: skip


def test_gain_band_interpolates_each_seed_from_its_own_base(bench):
    grid, mean, low, high = bench.gain_band(SEEDS, "strict")
    assert grid == [0.0, 1.0, 2.0]
    # seed 0 gains [0, .05, .10]; seed 1 interpolated at minute 1: (0.20 + 0.24)/2 − 0.20 = .02, then .04
    assert mean == pytest.approx([0.0, 0.035, 0.07])
    assert low == pytest.approx([0.0, 0.02, 0.04]) and high == pytest.approx([0.0, 0.05, 0.10])


def test_summary_reports_mean_change_and_spread(bench):
    out = bench.summary(SEEDS)
    assert out["seeds"] == 2 and out["minutes"] == 2.0
    assert out["strict_before"] == pytest.approx(0.25) and out["strict_after"] == pytest.approx(0.32)
    assert out["strict_delta"] == pytest.approx(0.07)
    assert (out["strict_delta_min"], out["strict_delta_max"]) == pytest.approx((0.04, 0.10))
    assert out["lenient_delta"] == pytest.approx(0.05) and out["extra_per_image_delta"] == pytest.approx(-0.1)


def test_plot_draws_a_band_per_algorithm(bench, tmp_path: Path):
    out = tmp_path / "shapes.png"
    bench.plot({"grpo_fast": SEEDS, "grpo_partial": {0: SEEDS[0]}}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["gdpo", "gdpo_sum", "grpo_gardo", "nft", "awm", "dgpo", "grpo_lenient"])
def test_every_arm_composes_to_a_valid_run(bench, name: str):
    """An arm that no longer composes would fail only after the earlier arms' hours of training."""
    from tests.vlm.conftest import compose_config

    run, _ = compose_config("train", [*bench.COMMON, *bench.RUNS[name]])
    if name.startswith("gdpo"):
        assert run.reward.weights == {"shapes_geneval": 1.0, "jpeg_compressibility": 0.25}
        assert run.reward.aggregation == ("gdpo" if name == "gdpo" else "sum_then_normalize")
    if name == "grpo_gardo":
        assert run.algo.gardo.kl_gate and run.algo.gardo.refresh_every == 16 and run.algo.kl_weight == 0.04


def test_the_two_reward_arms_report_jpeg_size(bench):
    rows = [
        {"step": 0, bench.METRICS["strict"]: 0.3, bench.METRICS["lenient"]: 0.4, bench.METRICS["extra_per_image"]: 0.6,
         bench.OPTIONAL_METRICS["jpeg_kb"]: 1.10},
        {"step": 1, "time/epoch": 60.0},
        {"step": 2, "time/epoch": 60.0, bench.METRICS["strict"]: 0.35, bench.METRICS["lenient"]: 0.4,
         bench.METRICS["extra_per_image"]: 0.5, bench.OPTIONAL_METRICS["jpeg_kb"]: 1.05},
    ]  # fmt: skip
    points = bench.curve(rows)
    assert points["minutes"] == [0.0, 2.0] and points["jpeg_kb"] == [1.1, 1.05]
    out = bench.summary({0: points})
    assert out["jpeg_kb_delta"] == pytest.approx(-0.05)
    assert "jpeg_kb_delta" not in bench.summary(SEEDS)  # arms that do not score it
