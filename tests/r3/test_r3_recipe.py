"""Tree-RL through the CLI: one reason step and one refine step of tiny_r3, and what they train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.r3.conftest import TINY_R3, compose_r3, warm_text_overrides

WEIGHT_FILES = {
    "text": "text/adapter_model.safetensors",
    "generator": "generator/pytorch_lora_weights.safetensors",
    "editor": "editor/pytorch_lora_weights.safetensors",
}


def _train(cli, run: Path, *extra: str) -> tuple[Path, list[str]]:
    overrides = [*TINY_R3, *extra, f"hydra.run.dir={run}"]
    code, out = cli("train", *overrides)
    assert code == 0, out
    return run, overrides


@pytest.fixture(scope="module")
def two_steps(cli, tmp_path_factory) -> tuple[Path, list[str]]:
    """Step 0 (reason) and step 1 (refine) of the random tiny_r3 (its reflections mostly ask for edits)."""
    return _train(cli, tmp_path_factory.mktemp("r3_run"), "epochs=2")


@pytest.fixture(scope="module")
def warm_reason_step(cli, warm_text_dir: Path, tmp_path_factory) -> tuple[Path, list[str]]:
    """One reason step with a text policy that closes its plans: the text track has a signal."""
    return _train(cli, tmp_path_factory.mktemp("r3_warm"), *warm_text_overrides(warm_text_dir), "epochs=1")


@pytest.fixture(scope="module")
def cli():
    from tests.conftest import run_cli

    return run_cli


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_even_step_reasons_odd_step_refines(two_steps):
    run, _ = two_steps
    reason, refine = _metrics(run)
    assert (reason["stage"], refine["stage"]) == (0.0, 1.0)
    assert reason["format_rate"] == 0 and reason["reward/text/mean"] == 0  # random texts: malformed → 0
    assert reason["advantage/image/abs_mean"] > 0
    assert refine["buffer/size"] == 4  # the reason step's 4 images
    assert 0 <= refine["no_edit_rate"] <= 1 and refine["sde_step"] in (0.0, 1.0)  # edit: first 2 steps
    for m in (reason, refine):  # exactly on-policy: one update per rollout
        assert m["ratio_error_max"] == 0.0
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values() if isinstance(v, float))


def test_every_branch_is_logged(two_steps):
    run, _ = two_steps
    rows = [json.loads(line) for line in (run / "samples" / "rank_0.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == ["reason"] * 4 + ["refine"] * 4
    for stage in ("reason", "refine"):
        group = [r for r in rows if r["stage"] == stage]
        assert len({(r["index"], r["sde_step"], r["noise_sum"]) for r in group}) == 1  # one group, one noise


def _initial_weights(overrides: list[str], directory: Path) -> Path:
    """The untrained composite's trainable weights, built as the recipe builds it (same seed, same order)."""
    from rlgen_cli.r3.composite import build_composite

    typed, _ = compose_r3("train", [o for o in overrides if not o.startswith("hydra.")])
    torch.manual_seed(typed.seed)
    build_composite(typed.r3.policy, torch.device("cpu")).save_trainable(directory)
    return directory


def _changed(run: Path, overrides: list[str], part: str, initial: Path, epochs: int) -> tuple[set, set]:
    """(every tensor, the changed tensors) of ``part``'s trainable weights after the run."""
    trained = run / "checkpoints" / f"epoch_{epochs:06d}" / "weights"
    before, after = load_file(initial / WEIGHT_FILES[part]), load_file(trained / WEIGHT_FILES[part])
    assert before.keys() == after.keys() and before, part
    return set(before), {k for k in before if not torch.equal(before[k], after[k])}


def test_image_tensors_change_in_both_stages(two_steps, tmp_path: Path):
    run, overrides = two_steps
    initial = _initial_weights(overrides, tmp_path / "initial")
    for part in ("generator", "editor"):  # the generator trains at step 0, the editor at step 1
        tensors, changed = _changed(run, overrides, part, initial, epochs=2)
        lora_b = {k for k in tensors if "lora_B" in k}  # B starts at 0: one step moves every B, not yet A
        assert lora_b and lora_b <= changed, f"{part}: {sorted(lora_b - changed)[:3]} unchanged"


def test_text_tensors_change_once_plans_are_well_formed(warm_reason_step, tmp_path: Path):
    run, overrides = warm_reason_step
    (reason,) = _metrics(run)
    assert reason["format_rate"] > 0 and reason["advantage/text/abs_mean"] > 0
    initial = _initial_weights(overrides, tmp_path / "initial")
    _, changed = _changed(run, overrides, "text", initial, epochs=1)
    assert any("lora_B" in k for k in changed)


def test_switches_turn_a_track_off(cli, tmp_path: Path):
    """tune_image_cot=false trains the text alone; enable_sde_gen=false samples ODE (no image step)."""
    overrides = [*TINY_R3, "epochs=1", "r3.tune_image_cot=false", "r3.enable_sde_gen=false"]
    code, out = cli("train", *overrides, f"hydra.run.dir={tmp_path}")
    assert code == 0, out
    (metrics,) = _metrics(tmp_path)
    assert metrics["sde_step"] == -1.0 and not any(k.startswith("image/") for k in metrics)
    assert "text/policy_loss" in metrics
