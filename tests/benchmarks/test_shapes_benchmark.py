"""benchmarks/shapes.py's seed statistics: gains from each seed's own base, interpolated onto one grid."""

from __future__ import annotations

import importlib.util
import json
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


ARMS = (
    "grpo", "grpo_fast", "mix_grpo", "dance", "dpo", "nft", "awm", "dgpo", "gdpo", "gdpo_sum", "grpo_gardo",
    "grpo_partial", "grpo_lenient",
)  # fmt: skip


def test_the_arms_below_are_all_the_benchmarks_arms(bench):
    assert set(bench.RUNS) == set(ARMS)


@pytest.mark.parametrize("name", ARMS)
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


def _result(tmp_path: Path, name: str, curves: dict, **settings) -> Path:
    result = {"benchmark": "shapes", "minutes_per_run": 10.0, "seeds": 2, "jobs": 1, "threads_per_run": 2,
              "hack_run": {"name": "grpo_lenient", "seeds": 1, "minutes": 4.0}, "wall_s": 60.0, **settings,
              "curves": {arm: {str(seed): points for seed, points in seeds.items()} for arm, seeds in curves.items()}}  # fmt: skip
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return path


def test_merge_draws_the_arms_of_several_results_together(bench, tmp_path: Path):
    first = _result(tmp_path, "a.json", {"grpo_fast": SEEDS, "grpo_lenient": {0: SEEDS[0]}})
    second = _result(tmp_path, "b.json", {"nft": {1: SEEDS[1]}}, seeds=1, wall_s=30.0)
    third = _result(
        tmp_path, "c.json", {"nft": {0: SEEDS[0]}}, seeds=1, wall_s=10.0
    )  # the same arm, another seed
    curves, settings = bench.merge([first, second, third])
    assert sorted(curves) == ["grpo_fast", "grpo_lenient", "nft"] and curves["nft"] == SEEDS
    assert settings["wall_s"] == 100.0 and settings["seeds"] == 2 and settings["hack_run"]["minutes"] == 4.0
    assert [s["arms"] for s in settings["sources"]] == [["grpo_fast", "grpo_lenient"], ["nft"], ["nft"]]
    result = bench.write(curves, settings, tmp_path)
    assert result["summary"]["grpo_fast"]["strict_delta"] == pytest.approx(0.07)
    assert (tmp_path / "shapes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("settings", "arms", "found"),
    [
        ({"minutes_per_run": 5.0}, ("nft",), "minutes_per_run=5.0 but"),
        ({"threads_per_run": 1}, ("nft",), "threads_per_run=1 but"),
        ({}, ("grpo_fast",), "grpo_fast seed 0 is in an earlier file too"),
    ],
)
def test_merge_refuses_unequal_budgets_and_repeated_arms(bench, tmp_path: Path, settings, arms, found):
    first = _result(tmp_path, "a.json", {"grpo_fast": SEEDS})
    second = _result(tmp_path, "b.json", dict.fromkeys(arms, SEEDS), **settings)
    with pytest.raises(SystemExit, match=found):
        bench.merge([first, second])
