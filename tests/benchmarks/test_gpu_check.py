"""benchmarks/gpu_check.py (``make gpu-check``) cannot rot between device loans: its dry run runs the rows
at tiny sizes on the CPU and prints the JSON a device run prints. The numbers mean nothing here; the
shape of the record, their finiteness, and the on-policy check's verdicts (as is: pass; perturbed: fail)
do."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ROWS = ("sd3_epoch", "rollout_vs_diffusers", "onpolicy", "flux_step", "wan_step", "folded_timesteps",
        "two_processes")  # fmt: skip


def _gpu_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "gpu_check.py", *args],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})},
    )


def _record(*args: str) -> dict:
    done = _gpu_check(*args)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and last.startswith("{"), f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(last)


def _numbers(value) -> list[float]:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [value]
    items = value.values() if isinstance(value, dict) else value
    return [n for item in items for n in _numbers(item)]


def _assert_ran(record: dict, names: tuple[str, ...]) -> None:
    assert record["dry_run"] is True and record["device"] == "cpu"
    assert list(record["rows"]) == list(names)
    for name, row in record["rows"].items():
        assert row["status"] in ("ok", "skipped"), (name, row)
        assert all(math.isfinite(n) for n in _numbers(row)), (name, row)


def _assert_onpolicy(row: dict) -> None:
    assert row["passed"] and row["max_ratio_error"] <= row["tolerance"], row
    assert row["perturbed_failed"] and row["perturbed_max_ratio_error"] > row["tolerance"], row


def test_dry_run_of_the_onpolicy_row_passes_and_its_perturbed_arm_fails():
    record = _record("--dry-run", "--rows", "onpolicy,two_processes")
    _assert_ran(record, ("onpolicy", "two_processes"))
    _assert_onpolicy(record["rows"]["onpolicy"])
    assert "dry run" in record["rows"]["two_processes"]["skipped"]


@pytest.mark.slow
def test_dry_run_runs_every_row():
    record = _record("--dry-run")
    _assert_ran(record, ROWS)
    rows = record["rows"]
    _assert_onpolicy(rows["onpolicy"])
    for name in ("sd3_epoch", "flux_step", "wan_step"):
        assert rows[name]["plan"]["total_bytes"] > rows[name]["plan"]["state_bytes"] > 0, rows[name]
        assert rows[name]["peak_bytes"] is None  # no device counter on the CPU
    epoch = rows["sd3_epoch"]
    rows_of = epoch["velocity_rows"]  # the KL probe after the update counts apart from the rollout
    assert rows_of["sampling"] > 0 and rows_of["training"] > 0 and rows_of["probe"] > 0
    assert epoch["seconds"]["epoch"] >= epoch["seconds"]["update"] > 0
    assert rows["flux_step"]["step_s"] > 0 and rows["wan_step"]["step_s"] > 0
    folded = rows["folded_timesteps"]
    assert folded["equal"] and folded["reversed_advantages_relative_difference"] > folded["tolerance"], folded
    assert rows["rollout_vs_diffusers"]["equal"], rows["rollout_vs_diffusers"]


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCHMARKS))  # its sibling modules (_common, real_size) import by name
    try:
        spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("gpu_check", None)


def _sleeps(ctx) -> dict:
    time.sleep(30)
    return {"never": 1}


def _breaks(ctx) -> dict:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _answers(ctx) -> dict:
    return {"value": 1.5}


def test_rows_are_independent_each_within_its_budget_and_the_run_within_its_limit(gpu_check, monkeypatch):
    rows = {"sleeps": (_sleeps, 0.5), "breaks": (_breaks, 10.0), "answers": (_answers, 10.0),
            "late": (_answers, 10.0)}  # fmt: skip
    monkeypatch.setattr(gpu_check, "ROWS", rows)
    ctx = gpu_check.Context(dry_run=True, device="cpu")
    start = time.monotonic()
    record = gpu_check.run_rows(ctx, list(rows), limit=60.0)
    assert time.monotonic() - start < 5  # the sleeping row was cut at its 0.5 s budget
    got = record["rows"]
    assert got["sleeps"]["status"] == "timeout" and got["sleeps"]["budget_s"] == 0.5, got
    assert got["breaks"]["status"] == "failed" and "illegal memory access" in got["breaks"]["error"], got
    assert got["answers"]["status"] == "ok" and got["answers"]["value"] == 1.5, got
    # the whole run's limit caps a row's budget; once spent, the rows left are skipped, saying why
    monkeypatch.setitem(rows, "sleeps", (_sleeps, 30.0))
    record = gpu_check.run_rows(ctx, ["sleeps", "late"], limit=1.5)
    assert record["rows"]["sleeps"]["status"] == "timeout" and record["rows"]["sleeps"]["budget_s"] == 1.5
    late = record["rows"]["late"]
    assert late["status"] == "skipped" and "limit of 1.5 s" in late["skipped"], late


def test_without_cuda_it_refuses_with_exit_2(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == gpu_check.EXIT_NO_DEVICE
    out = capsys.readouterr()
    assert "no CUDA device" in out.err and "--dry-run" in out.err and not out.out


def test_an_unknown_row_is_named(gpu_check, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.parse(["--rows", "sd3_epoch,nope"])
    assert stop.value.code == 2 and "nope" in capsys.readouterr().err


STUCK_ROW = """
import json, signal, sys, time
sys.path.insert(0, {benchmarks!r})
import gpu_check

def stuck(ctx):  # the alarm cannot reach it, as in a hung collective
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(60)

gpu_check.GRACE_S = 0.5
gpu_check.ROWS = {{"answers": (lambda ctx: {{"value": 2.0}}, 10.0), "stuck": (stuck, 10.0)}}
gpu_check.run_rows(gpu_check.Context(dry_run=True, device="cpu"), ["answers", "stuck"], limit=3.0)
print("not reached")
"""


@pytest.mark.slow  # a subprocess importing the script: ~10 s
def test_a_row_stuck_in_native_code_is_cut_at_the_limit_and_the_record_printed():
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", STUCK_ROW.format(benchmarks=str(BENCHMARKS))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and "not reached" not in done.stdout, done.stderr[-2000:]
    rows = json.loads(lines[-1])["rows"]
    assert rows["answers"] == {**rows["answers"], "status": "ok", "value": 2.0}
    assert rows["stuck"]["status"] == "timeout" and "native code" in rows["stuck"]["error"]
    assert time.monotonic() - start < 60  # not the stuck row's 60 s
