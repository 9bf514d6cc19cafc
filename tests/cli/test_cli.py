"""The typer verbs forward to Hydra: help, ls, overrides, errors with exit 2, --cfg, multirun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_RUN


def test_help_lists_verbs_and_groups(cli):
    code, out = cli("train", "--help")
    assert code == 0
    for group in ("model=", "algo=", "reward=", "launcher=", "data=", "experiment="):
        assert group in out
    assert "tiny_sd3" in out and "hydra/launcher" in out


def test_import_does_not_pull_torch():
    code = "import sys, rlgen_cli.cli; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_ls_lists_groups_and_rejects_unknown(cli):
    code, out = cli("ls")
    assert code == 0 and "model: " in out and "tiny_sd3" in out
    assert "algo: " in out and "grpo_fast" in out and "mix_grpo" in out
    code, out = cli("ls", "nosuchgroup")
    assert code == 2 and "nosuchgroup" in out


def test_unknown_key_exits_2_naming_it(cli, capsys):
    code, out = cli("train", "algo.lrr=1e-3")
    captured = capsys.readouterr()
    assert code == 2
    assert "algo.lrr" in out + captured.err + captured.out


def test_wrong_type_exits_2_naming_it(cli, capsys):
    code, out = cli("train", "algo.lr=fast")
    captured = capsys.readouterr()
    assert code == 2
    assert "algo.lr" in out + captured.err + captured.out


def test_cross_field_check_exits_2_with_the_fix(cli, run_dir, capsys):
    code, out = cli("train", "algo.group_size=3", "algo.prompts_per_epoch=1", f"hydra.run.dir={run_dir}")
    captured = capsys.readouterr()
    assert code == 2
    message = out + captured.err + captured.out
    assert "must be divisible by algo.sample_batch_size" in message and "Traceback" not in message


def test_cfg_job_prints_composed_config_without_running(cli, capsys):
    code, out = cli("train", "--cfg", "job", "algo.lr=0.123")
    captured = capsys.readouterr()
    assert code == 0
    assert "lr: 0.123" in out + captured.out


def test_multirun_writes_one_run_dir_per_job(cli, tmp_path: Path):
    sweep = tmp_path / "sweep"
    code, _ = cli(
        "train",
        "-m",
        "algo.lr=1e-4,3e-4",
        *TINY_RUN,
        "epochs=1",
        "eval_every=0",
        "images_every=0",
        f"hydra.sweep.dir={sweep}",
    )
    assert code == 0
    runs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in runs] == ["0", "1"]
    for run in runs:
        assert (run / "resolved.yaml").is_file() and (run / "metrics.jsonl").is_file()
    assert "lr: 0.0003" in (runs[1] / "resolved.yaml").read_text()


def test_plot_draws_several_runs_and_rejects_non_runs(cli, tmp_path: Path):
    import json

    for name, slope in (("a", 1.0), ("b", 2.0)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": i, "reward/mean": slope * i, "kl_to_ref": 0.01 * i} for i in range(5)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "curves.png"
    code, output = cli("plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out))
    assert code == 0, output
    from PIL import Image

    assert Image.open(out).size[0] > 500  # two panels: reward and KL
    code, output = cli("plot", str(tmp_path / "nothing"))
    assert code == 2 and "no metrics.jsonl" in output


@pytest.mark.slow  # ~18 s; the joblib sweep and -m multirun tests cover sweeps in the default suite
def test_submitit_local_sweep_writes_one_run_per_job(cli, tmp_path: Path):
    sweep = tmp_path / "sweep"
    code, out = cli(
        "train",
        "-m",
        "hydra/launcher=submitit_local",
        "algo.lr=1e-3,3e-3",
        *TINY_RUN,
        "epochs=1",
        "eval_every=0",
        "images_every=0",
        "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={sweep}",
    )
    assert code == 0, out
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert runs == ["0", "1"]
    assert all((sweep / r / "metrics.jsonl").is_file() for r in runs)


def _rlgen(*args: str) -> tuple[int, str]:
    """``rlgen ARGS`` exactly as typed (the ``cli`` fixture adds experiment=tiny_cpu to a bare train)."""
    from typer.testing import CliRunner

    from rlgen_cli.cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_the_introductory_command_shows_geneval_data_and_no_shapes_settings():
    code, out = _rlgen("train", "model=flux", "algo=grpo_fast", "reward=geneval", "--cfg", "job")
    assert code == 0, out
    assert "train: dataset/geneval/train_metadata.jsonl" in out
    assert "test: dataset/geneval/test_metadata.jsonl" in out
    assert "time_limit_minutes: 0.0" in out and "eval_before: false" in out and "epochs: 100000" in out
    assert "builtin:shapes" not in out  # no ShapesEval data or model


def test_bare_train_shows_the_shapes_run():
    code, out = _rlgen("train", "--cfg", "job")
    assert code == 0, out
    assert "train: builtin:shapes_train.jsonl" in out and "path: builtin:shapes_base" in out
    assert (
        "epochs: 150" in out
        and "name: nft" in out
        and "time_limit_minutes: 18.0" in out
        and "eval_before: true" in out
    )


def test_a_missing_data_file_exits_2_before_any_model_loads(tmp_path: Path, monkeypatch, capsys):
    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the data files were checked")

    monkeypatch.setattr("rlgen_cli.recipes.flow_run.build_policy", no_model)
    monkeypatch.chdir(tmp_path)  # no dataset/ folder here
    code, out = _rlgen("train", "model=tiny_sd3", "reward=pickscore", f"hydra.run.dir={tmp_path / 'run'}")
    message = " ".join((out + capsys.readouterr().err).split())  # rich wraps long lines
    assert code == 2, message
    assert (
        f"data.train: prompt file dataset/pickscore/train.txt does not exist (looked at {tmp_path}" in message
    )
    assert "github.com/yifan123/flow_grpo" in message and "one prompt per line" in message
    assert "data.train=/path/to/train.txt (data.test=… likewise)" in message


def test_a_tag_repeat_for_a_missing_tag_exits_2_before_any_model_loads(tmp_path: Path, monkeypatch, capsys):
    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was loaded before data.tag_repeats was checked")

    monkeypatch.setattr("rlgen_cli.recipes.flow_run.build_policy", no_model)
    code, out = _rlgen("train", "+data.tag_repeats={colour: 2}", f"hydra.run.dir={tmp_path}")
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2, message
    assert "data.tag_repeats names 'colour', which no prompt of" in message and "'colors'," in message


def test_tag_repeats_on_a_vlm_run_exits_2_rather_than_being_ignored(tmp_path: Path, capsys):
    code, out = _rlgen(
        "train", "model=tiny_qwen2_vl", "+data.tag_repeats={counting: 2}", f"hydra.run.dir={tmp_path}"
    )
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2 and "data.tag_repeats is not a setting of data" in message, message


def test_an_editing_model_without_source_images_exits_2_naming_the_row(tmp_path: Path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("make it red\n")
    code, out = _rlgen(
        "check-onpolicy",
        "model=tiny_flux_kontext",
        f"data.train={prompts}",
        f"data.test={prompts}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2 and "example 0 of" in message and "has no 'image' field" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_flux_kontext", "tiny_qwen_image_edit"])
def test_check_onpolicy_of_an_editing_model_needs_no_other_argument(model, tmp_path: Path):
    code, out = _rlgen("check-onpolicy", f"model={model}", "progress=false", f"hydra.run.dir={tmp_path}")
    assert code == 0 and "PASS" in out, out


def test_sample_of_a_tiny_editing_model_draws_its_editing_set(tmp_path: Path):
    import json

    code, out = _rlgen(
        "sample", "model=tiny_qwen_image_edit", "num_steps=2", "progress=false", f"hydra.run.dir={tmp_path}"
    )
    assert code == 0, out
    rows = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    edits = (tmp_path / "tiny_edit" / "tiny_edit_test.jsonl").read_text().splitlines()
    assert [r["prompt"] for r in rows] == [json.loads(line)["prompt"] for line in edits]
    assert all((tmp_path / r["file"]).is_file() for r in rows)


def test_sample_of_an_editing_model_refuses_prompts_without_sources(tmp_path: Path, capsys):
    code, out = _rlgen(
        "sample", "model=tiny_flux_kontext", "prompts=[make it red]", f"hydra.run.dir={tmp_path}"
    )
    message = " ".join((out + capsys.readouterr().err).split())
    assert code == 2 and "drop prompts= to draw data.test (builtin:tiny_edit_test.jsonl)" in message, message
