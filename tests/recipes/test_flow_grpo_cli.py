"""Flow-GRPO end to end through the CLI: training changes every LoRA tensor, checkpoints feed
``rlgen sample`` and ``rlgen eval``, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME, SD3Policy
from rlgen_cli.models.tiny import tiny_sd3_pipeline
from tests.conftest import TINY_RUN

FAST = [*TINY_RUN, "images_every=1", "eval_every=1", "algo.lr=1e-2"]


def _lora_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "weights" / LORA_WEIGHTS_NAME)


def _initial_lora(tiny_model_cfg) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(42)  # the recipe seeds torch with cfg.seed before building the adapter
    policy = SD3Policy(tiny_sd3_pipeline(0), tiny_model_cfg, torch.device("cpu"))
    return {f"transformer.{k}": v for k, v in get_peft_model_state_dict(policy.transformer).items()}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    from tests.conftest import run_cli

    run_dir = tmp_path_factory.mktemp("flow_grpo") / "run"
    code, out = run_cli("train", *FAST, "epochs=2", "save_every=1", "keep_last=5", f"hydra.run.dir={run_dir}")
    assert code == 0, out
    return run_dir


def test_run_dir_has_config_metrics_images_curve_and_checkpoints(trained_run: Path):
    for name in ("resolved.yaml", "provenance.json", "metrics.jsonl", "reward_curve.png", "run.log"):
        assert (trained_run / name).is_file(), name
    assert (trained_run / "images" / "train_epoch_000001.png").is_file()
    assert (trained_run / "images" / "eval_epoch_000002.png").is_file()
    ckpts = sorted(p.name for p in (trained_run / "checkpoints").iterdir())
    assert ckpts == ["epoch_000001", "epoch_000002"]


def test_losses_finite_and_metrics_complete(trained_run: Path):
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in (
            "reward/mean",
            "reward/std",
            "reward/jpeg_compressibility/mean",
            "approx_kl",
            "clipfrac",
            "ratio_min",
            "ratio_mean",
            "ratio_max",
            "zero_std_ratio",
            "policy_loss",
            "kl_loss",
            "grad_norm",
            "time/rollout",
            "time/reward",
            "time/update",
            "peak_memory_mb",
        ):
            assert row[key] is not None and row[key] == row[key], key
    assert "eval/reward/mean" in rows[1]


def test_every_lora_tensor_changed(trained_run: Path, tiny_model_cfg):
    initial = _initial_lora(tiny_model_cfg)
    trained = _lora_of(trained_run / "checkpoints" / "epoch_000002")
    assert trained.keys() == initial.keys() and len(trained) > 0
    unchanged = [k for k in trained if torch.equal(trained[k], initial[k])]
    assert unchanged == []


def test_sample_from_checkpoint_writes_pngs_and_manifest(trained_run: Path, tmp_path: Path, cli):
    out = tmp_path / "samples"
    code, output = cli(
        "sample",
        f"checkpoint={trained_run / 'checkpoints' / 'epoch_000002'}",
        "prompts=[a red circle,a dog]",
        "images_per_prompt=2",
        "num_steps=3",
        "progress=false",
        f"hydra.run.dir={out}",
    )
    assert code == 0, output
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["a red circle"] * 2 + ["a dog"] * 2
    assert all((out / r["file"]).is_file() for r in rows)


def test_eval_of_checkpoint_writes_results(trained_run: Path, tmp_path: Path, cli):
    out = tmp_path / "eval"
    code, output = cli(
        "eval",
        f"checkpoint={trained_run / 'checkpoints' / 'epoch_000002'}",
        "max_prompts=3",
        "num_steps=3",
        "progress=false",
        f"hydra.run.dir={out}",
    )
    assert code == 0, output
    results = json.loads((out / "results.json").read_text())
    assert results["num_samples"] == 3
    assert results["reward"]["mean"] == pytest.approx(results["components"]["jpeg_compressibility"]["mean"])
    assert len((out / "samples.jsonl").read_text().splitlines()) == 3


def test_sample_rejects_an_incomplete_checkpoint(tmp_path: Path, cli, capsys):
    code, out = cli("sample", f"checkpoint={tmp_path}", "prompts=[x]", f"hydra.run.dir={tmp_path / 'o'}")
    assert code == 2
    assert "not a complete rlgen checkpoint" in out + capsys.readouterr().err


def test_resume_equals_uninterrupted_run(trained_run: Path, tmp_path: Path, cli):
    resumed = tmp_path / "resumed"
    code, out = cli("train", *FAST, "epochs=1", f"hydra.run.dir={resumed}")
    assert code == 0, out
    code, out = cli("train", *FAST, "epochs=2", "resume=auto", f"hydra.run.dir={resumed}")
    assert code == 0, out
    straight = _lora_of(trained_run / "checkpoints" / "epoch_000002")
    again = _lora_of(resumed / "checkpoints" / "epoch_000002")
    for key in straight:
        torch.testing.assert_close(again[key], straight[key], rtol=0, atol=0)


def test_lr_schedule_decays_the_optimizer_rate_epoch_by_epoch(tmp_path: Path, cli):
    run = tmp_path / "linear"
    code, out = cli(
        "train",
        *TINY_RUN,
        "epochs=3",
        "eval_every=0",
        "save_every=0",
        "images_every=0",
        "algo.lr=1e-3",
        "algo.lr_schedule=linear",
        "algo.lr_min_ratio=0.1",
        f"hydra.run.dir={run}",
    )
    assert code == 0, out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = [row["lr"] for row in rows if "lr" in row]
    assert lrs == pytest.approx([1e-3, 5.5e-4, 1e-4])


def test_sample_builds_an_editing_set(tmp_path: Path, cli):
    meta = tmp_path / "counting.jsonl"
    rows = [
        {"tag": "counting", "prompt": "make it three apples", "source_prompt": "two apples",
         "include": [{"class": "apple", "count": 3}]},
        {"tag": "counting", "prompt": "make it one dog", "include": [{"class": "dog", "count": 1}]},
    ]  # fmt: skip
    meta.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "edit"
    code, output = cli(
        "sample",
        f"prompts_file={meta}",
        "edit_set=true",
        "num_steps=2",
        "progress=false",
        f"hydra.run.dir={out}",
    )
    assert code == 0, output
    written = [json.loads(line) for line in (out / "edit_set.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in written] == ["make it three apples", "make it one dog"]
    assert all((out / r["image"]).is_file() for r in written) and written[0]["include"][0]["count"] == 3
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [m["prompt"] for m in manifest] == ["two apples", "make it one dog"]  # sources from source_prompt
