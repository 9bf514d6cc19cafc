"""Every verb checks what it will need before it builds or loads a model, and reports ALL missing ones
together with exit code 2: prompt files, checkpoint, resume target, model weights, reward settings and
files, hub sources that cannot be fetched, reward servers. ``--cfg job`` runs a run's first checks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from rlgen_cli.rewards.requirements import ModelSource, Package, hub_unreachable
from tests.conftest import TINY_RUN

MASK2FORMER = "facebook/mask2former-swin-small-coco-instance"
CLIP_L14 = "openai/clip-vit-large-patch14"
TINY_DATA = ("data.train=builtin:tiny_train.txt", "data.test=builtin:tiny_test.txt")


def _rlgen(*args: str) -> tuple[int, str]:
    """``rlgen ARGS`` exactly as typed, in this process."""
    from typer.testing import CliRunner

    from rlgen_cli.cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@pytest.fixture
def no_model(monkeypatch):
    """Any model build fails the test: the checks must all come first."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a model was built before the prerequisites were checked")

    # the recipe loop first: importing it binds the models' build_policy, which must not be the stand-in yet
    for where in ("rlgen_cli.recipes.flow_run.build_policy", "rlgen_cli.models.build_policy"):
        monkeypatch.setattr(where, refuse)


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch) -> Path:
    """A hub cache holding nothing (the hub client reads its location when it looks)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    return cache


def _message(out: str, capsys) -> str:
    return " ".join((out + capsys.readouterr().err).split())  # rich wraps long lines


def test_train_lists_every_missing_prerequisite_at_once(tmp_path, monkeypatch, capsys, no_model):
    monkeypatch.chdir(tmp_path)  # no dataset/geneval here
    code, out = _rlgen(
        "train",
        "model=tiny_flux",
        "algo=grpo_fast",
        "reward=geneval",
        f"resume={tmp_path / 'gone'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = _message(out, capsys)
    assert code == 2, message
    assert "4 prerequisites are missing (no model was loaded)" in message
    assert "1. data.train: prompt file dataset/geneval/train_metadata.jsonl does not exist" in message
    assert "2. data.test: prompt file dataset/geneval/test_metadata.jsonl does not exist" in message
    assert f"3. resume={tmp_path / 'gone'}: {tmp_path / 'gone'} is not a complete rlgen checkpoint" in message
    assert (
        "4. reward 'geneval' needs detector_path and clip_path: set reward.kwargs.geneval.detector_path="
        in message
    )


def test_a_missing_detector_exits_2_before_the_model_is_built(tmp_path, capsys, no_model):
    code, out = _rlgen(
        "train",
        "model=tiny_flux",
        "algo=grpo_fast",
        "reward=geneval",
        *TINY_DATA,
        f"reward.kwargs.geneval.clip_path={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = _message(out, capsys)
    assert code == 2, message
    assert "reward 'geneval' needs detector_path: set reward.kwargs.geneval.detector_path=" in message


def test_a_missing_resume_target_exits_2_before_the_model_is_built(tmp_path, capsys, no_model):
    code, out = _rlgen("train", *TINY_RUN, f"resume={tmp_path / 'gone'}", f"hydra.run.dir={tmp_path / 'run'}")
    message = _message(out, capsys)
    assert code == 2, message
    assert f"resume={tmp_path / 'gone'}: {tmp_path / 'gone'} is not a complete rlgen checkpoint" in message


def test_offline_hub_sources_not_in_the_cache_are_named_with_how_to_fetch_them(
    tmp_path, capsys, no_model, empty_hub_cache
):
    code, out = _rlgen(
        "train",
        "model=sd3",
        "algo=grpo_fast",
        "reward=geneval",
        *TINY_DATA,
        f"reward.kwargs.geneval.detector_path={MASK2FORMER}",
        f"reward.kwargs.geneval.clip_path={CLIP_L14}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = _message(out, capsys)
    assert code == 2, message
    assert "3 prerequisites are missing" in message
    assert "model.path=stabilityai/stable-diffusion-3.5-medium: not in the local hub cache" in message
    for key, repo in (("detector_path", MASK2FORMER), ("clip_path", CLIP_L14)):
        assert (
            f"reward.kwargs.geneval.{key}={repo}: not in the local hub cache and the hub is offline"
            in message
        )
        assert f"`huggingface-cli download {repo}`" in message


def test_sample_lists_a_missing_checkpoint_and_prompt_file(tmp_path, capsys, no_model):
    code, out = _rlgen(
        "sample",
        f"checkpoint={tmp_path / 'ckpt'}",
        f"prompts_file={tmp_path / 'prompts.jsonl'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = _message(out, capsys)
    assert code == 2, message
    assert "2 prerequisites are missing" in message
    assert (
        f"1. checkpoint={tmp_path / 'ckpt'}: {tmp_path / 'ckpt'} is not a complete rlgen checkpoint"
        in message
    )
    assert f"2. prompts_file: prompt file {tmp_path / 'prompts.jsonl'} does not exist" in message


def test_eval_lists_checkpoint_data_model_and_reward(tmp_path, capsys, no_model):
    code, out = _rlgen(
        "eval",
        f"checkpoint={tmp_path / 'ckpt'}",
        f"data.test={tmp_path / 'test.txt'}",
        "reward=geneval",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = _message(out, capsys)
    assert code == 2, message
    assert "3 prerequisites are missing" in message
    assert f"1. checkpoint={tmp_path / 'ckpt'}:" in message
    assert f"2. data.test: prompt file {tmp_path / 'test.txt'} does not exist" in message
    assert "3. reward 'geneval' needs detector_path and clip_path" in message


def test_a_local_model_path_that_does_not_exist_is_named(tmp_path, capsys, no_model):
    code, out = _rlgen(
        "sample",
        "model=sd3",
        f"model.path={tmp_path / 'sd3'}",
        "prompts=[a cat]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    message = _message(out, capsys)
    assert code == 2, message
    assert f"model.path={tmp_path / 'sd3'}: no such directory" in message


@pytest.mark.parametrize(
    ("model", "image", "expected"),
    [
        ("model=tiny_sd3", "src.png", "eval_heldout: example 0 of {heldout} gives a source image ('image') and "
         "model.family=sd3 does not edit"),
        ("model=tiny_flux_kontext", "gone.png", "eval_heldout: example 0 of {heldout} names source image "
         "{dir}/gone.png, which does not exist"),
    ],
)  # fmt: skip
def test_eval_heldout_gets_the_source_image_checks_of_data_test(
    tmp_path, capsys, no_model, model, image, expected
):
    """A tiny_sd3 run would drop eval_heldout's images without a word, an editing run would fail on its
    missing image only after the last epoch: both stop first, with exit code 2 and no model built."""
    Image.new("RGB", (8, 8)).save(tmp_path / "src.png")
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"prompt": "make it blue", "image": image}) + "\n", encoding="utf-8")
    code, out = _rlgen(
        "train", *TINY_RUN, model, f"eval_heldout={heldout}", f"hydra.run.dir={tmp_path / 'run'}"
    )
    message = _message(out, capsys)
    assert code == 2, message
    assert expected.format(heldout=heldout, dir=tmp_path) in message


# -- the requirement checks themselves -------------------------------------------------------------------------
def _cache_repo(cache: Path, repo: str, files: tuple[str, ...]) -> None:
    """A hub cache entry as huggingface_hub writes it: refs/main → a commit whose snapshot holds ``files``."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    for name in files:
        (root / "snapshots" / commit / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "snapshots" / commit / name).write_text("{}")


def test_a_cached_hub_source_is_there_offline_and_an_uncached_one_is_not(empty_hub_cache):
    _cache_repo(empty_hub_cache, "owner/clip", ("config.json",))
    _cache_repo(empty_hub_cache, "owner/weights", ("model.pt",))
    assert ModelSource("k", "owner/clip").problem() is None
    assert ModelSource("k", "owner/weights/model.pt", single_file=True).problem() is None
    missing = ModelSource("reward.kwargs.x.model_path", "owner/other").problem()
    assert missing.startswith("reward.kwargs.x.model_path=owner/other: not in the local hub cache")
    assert "`huggingface-cli download owner/other`" in missing
    other_file = ModelSource("k", "owner/weights/other.pt", single_file=True).problem()
    assert "`huggingface-cli download owner/weights other.pt`" in other_file


def test_local_sources_must_exist(tmp_path):
    assert ModelSource("k", str(tmp_path)).problem() is None
    assert ModelSource("k", f"{tmp_path}/gone").problem() == f"k={tmp_path}/gone: no such directory; " + (
        "fix the path, or give a hub id to download it"
    )
    assert "no such file" in ModelSource("k", "./gone.pt", single_file=True).problem()


def test_online_an_uncached_source_is_missing_only_when_the_hub_does_not_answer(empty_hub_cache, monkeypatch):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refuses connections
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with socket.socket() as open_:
            open_.bind(("127.0.0.1", 0))
            open_.listen()
            live = f"http://127.0.0.1:{open_.getsockname()[1]}"
            for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
                monkeypatch.delenv(var, raising=False)
            for endpoint, expected in ((live, None), (dead, "the hub cannot be reached (127.0.0.1: ")):
                monkeypatch.setenv("HF_ENDPOINT", endpoint)
                hub_unreachable.cache_clear()
                problem = ModelSource("k", "owner/name").problem()
                assert (problem is None) if expected is None else (expected in problem), problem
                # local_files_only never downloads, whether or not the hub answers
                assert (
                    "local_files_only is set"
                    in ModelSource("k", "owner/name", local_files_only=True).problem()
                )
    hub_unreachable.cache_clear()


def test_a_missing_package_is_named_with_its_install_command():
    assert Package("reward 'x'", "json", "pip install json").problem() is None
    assert Package("reward 'x'", "no_such_module_here", "pip install y").problem() == (
        "reward 'x' needs the Python package no_such_module_here: pip install y"
    )


# -- --cfg job --------------------------------------------------------------------------------------------------
def test_cfg_job_rejects_a_value_a_run_rejects(capsys):
    code, out = _rlgen("train", "--cfg", "job", "algo.ema.decay=1e300")
    message = _message(out, capsys)
    assert code == 2, message
    assert "algo.ema.decay must be in [0, 1], got 1e+300" in message


def test_cfg_job_prints_a_valid_config_and_takes_overrides_after_the_flag(capsys):
    code, out = _rlgen("train", "--cfg", "job", "algo.lr=0.125")
    assert code == 0, _message(out, capsys)
    assert "  lr: 0.125\n" in out and "experiment" not in capsys.readouterr().err


# -- one real run of the command, as a user types it ----------------------------------------------------------
def test_the_command_exits_2_without_a_traceback_or_a_model(tmp_path):
    """The issue's command (data present, detector missing): exit 2, one message, no model built (the
    recipe's model line never appears), no traceback."""
    cmd = [
        sys.executable, "-m", "rlgen_cli.cli", "train", "model=tiny_flux", "algo=grpo_fast", "reward=geneval",
        *TINY_DATA, "progress=false", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    env = os.environ | {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, out
    assert "error: reward 'geneval' needs detector_path and clip_path" in out
    assert "Traceback" not in out and "trainable parameters" not in out
