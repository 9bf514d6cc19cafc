"""The epoch benchmarks still run end to end and print their JSON (they drive a training run from outside
the recipes, so an API change there breaks them without any recipe test noticing). One short repeat
each: the numbers mean nothing here, only that every phase runs and every field is printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _json_of(script: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, script, *args], cwd=BENCHMARKS, capture_output=True, text=True, timeout=900
    )
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert last.startswith("{"), f"{script} printed no JSON (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(last)


@pytest.mark.slow
def test_overhead_replays_the_epoch_and_compares_with_a_baseline():
    result = _json_of(
        "overhead.py",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "algo.cfg_grad=conditional",
        "--baseline",
        "algo.cfg_grad=both",
    )
    for arm in ("recipe", "baseline"):
        assert result[arm]["epoch_s"] > 0 and result[arm]["model_calls_s"] > 0, result[arm]
        assert result[arm]["calls_per_epoch"]["backwards"] > 0
        inside = result[arm]["model_calls_in_epoch_s"]  # the epoch's own calls, clocked on a CPU
        assert 0 < inside < result[arm]["epoch_s"], result[arm]
        assert result[arm]["outside_calls_share"] == pytest.approx(
            1 - inside / result[arm]["epoch_s"], abs=2e-4
        )
    assert "epoch_vs_baseline" in result and "valid" in result


@pytest.mark.slow
def test_overhead_measures_the_default_runs_diffusion_nft_epoch():
    result = _json_of("overhead.py", "--geometry", "shapes_nft", "--repeats", "1", "--warmup", "1")
    calls = result["recipe"]["calls_per_epoch"]
    assert calls["no_grad_forwards"] > 0 and calls["grad_forwards"] > 0 and calls["backwards"] > 0, calls
    assert result["recipe"]["model_calls_s"] > 0 and "overhead_ratio" in result


@pytest.mark.slow
def test_profile_epoch_splits_the_epoch_into_phases():
    result = _json_of("profile_epoch.py", "--repeats", "1", "--warmup", "1")
    assert result["profiled_epoch_s"] > 0
    assert result["seconds"]["transformer_forward"] > 0 and result["seconds"]["backward"] > 0
    shares = result["share"]  # rounded to 4 decimals each: the phases cover the epoch
    assert abs(sum(shares.values()) - 1.0) <= 1e-4 * len(shares), shares


def test_every_function_profile_epoch_labels_is_where_it_looks(monkeypatch):
    """The profiler wraps recipe functions by module attribute; one moved elsewhere (as ``save_grid`` did
    to recipes/flow_run.py) breaks the script with an AttributeError only the slow smoke above would see."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import profile_epoch

    tables = [*profile_epoch.MODULE_PHASES.items(), *profile_epoch.CLASS_PHASES.items()]
    missing = [
        f"{owner.__name__}.{name}" for owner, names in tables for name in names if name not in vars(owner)
    ]
    assert not missing, f"profile_epoch.py labels functions that moved: {missing}"


def test_vlm_rollout_times_the_same_tokens_three_ways():
    done = subprocess.run(
        [sys.executable, "vlm_rollout.py", "--repeats", "1"],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert min(result["bare_s"], result["pipeline_s"], result["rlgen_s"]) > 0
    assert result["overhead_ratio"] == pytest.approx(result["rlgen_s"] / result["bare_s"])
    assert result["overhead_vs_pipeline"] == pytest.approx(result["rlgen_s"] / result["pipeline_s"])
    assert result["bare_tokens_per_s"] > 0 and result["logprob_ms_per_token"] > 0
