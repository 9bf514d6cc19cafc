"""``rlgen serve-reward``: help, config schema, worker plan, and one real run of the verb."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch
from hydra import compose, initialize_config_dir

from rlgen_cli._hydra import conf_dir
from rlgen_cli.errors import UserError
from rlgen_cli.rewards import RewardBatch, build_reward
from rlgen_cli.rewards.remote import RemoteReward
from rlgen_cli.schema.serve import ServeRewardConfig
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.server.app import ServerSettings
from rlgen_cli.server.runner import worker_env, worker_plan
from rlgen_cli.tasks.common import validated
from rlgen_cli.tasks.serve_reward import reward_specs
from tests.conftest import run_cli
from tests.server.helpers import http


def _compose(*overrides: str) -> ServeRewardConfig:
    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return validated(compose(config_name="serve_reward", overrides=list(overrides)))


def test_help():
    code, out = run_cli("serve-reward", "--help")
    assert code == 0 and "Serve the rewards" in out and "server.port" in out


def test_config_defaults_and_overrides():
    cfg = _compose()
    assert isinstance(cfg, ServeRewardConfig)
    assert (cfg.server.host, cfg.server.port, cfg.server.workers) == ("127.0.0.1", 8765, 1)
    assert reward_specs(cfg.reward) == {"jpeg_compressibility": {}}
    cfg = _compose("reward=jpeg_incompressibility", "server.port=9000", "server.devices=[cuda:0,cuda:1]")
    # (RewardConfig's default weights merge with the group's, so the default reward may be listed too.)
    assert "jpeg_incompressibility" in reward_specs(cfg.reward) and cfg.server.port == 9000
    assert cfg.server.devices == ["cuda:0", "cuda:1"]
    with pytest.raises(UserError, match="server.workers"):
        _compose("server.workers=0")
    code, _ = run_cli("serve-reward", "server.prot=1")
    assert code == 2


def test_every_server_setting_is_a_config_key_with_the_same_default():
    assert asdict(_compose().server) == asdict(ServerSettings())
    cfg = _compose("server.max_decoded_mb=8", "server.max_request_items=1000", "server.max_image_side=4096")
    settings = ServerSettings(**asdict(cfg.server))
    assert (settings.max_decoded_bytes, settings.max_request_items, settings.max_image_side) == (
        8 * 2**20,
        1000,
        4096,
    )
    for key in ("max_decoded_mb", "max_request_items", "max_metadata_depth", "max_image_side"):
        with pytest.raises(UserError, match=f"server.{key}"):
            _compose(f"server.{key}=0")


def test_worker_plan_and_devices():
    settings = ServerSettings(port=9000, workers=3, devices=["cuda:0", "1"])
    assert worker_plan(settings) == [(9000, "cuda:0"), (9001, "1"), (9002, "cuda:0")]
    assert worker_env("cuda:1") == {"CUDA_VISIBLE_DEVICES": "1"} and worker_env("2") == {
        "CUDA_VISIBLE_DEVICES": "2"
    }
    assert worker_env("cpu") == {"CUDA_VISIBLE_DEVICES": ""} and worker_env(None) == {}
    with pytest.raises(UserError, match="server.devices"):
        worker_env("tpu:0")
    with pytest.raises(UserError, match="port=0"):
        worker_plan(ServerSettings(port=0, workers=2))
    with pytest.raises(UserError, match="max_batch"):
        ServerSettings(max_batch=0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_reward_verb_serves_and_shuts_down_cleanly():
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "rlgen_cli.cli",
        "serve-reward",
        "reward=jpeg_compressibility",
        f"server.port={port}",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ | {"NO_COLOR": "1"}
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.1)
        images = torch.rand(2, 3, 16, 16)
        batch = RewardBatch(prompts=["a", "b"], images=images)
        remote = RemoteReward("jpeg_compressibility", ports=[port]).score(batch)
        assert torch.equal(remote.scores, build_reward("jpeg_compressibility").score(batch).scores)
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, out
    assert "serving rewards ['jpeg_compressibility']" in out and "drained" in out


# -- a server whose model cannot load never answers /healthz ok ------------------------------------------------
def _serve_until_exit_or_ready(
    args: list[str], env: dict[str, str], timeout_s: float = 120
) -> tuple[int | None, bool, str]:
    """Start ``rlgen serve-reward ARGS`` on a free port and poll ``/healthz`` until the process exits or
    answers 200: (exit code or None when it answered and was stopped, whether it answered ok, output)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "rlgen_cli.cli", "serve-reward", *args, f"server.port={port}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ | env)
    answered, deadline = False, time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # not listening yet
                answered = http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200
            if answered:
                break
            time.sleep(0.1)
    finally:
        code = proc.poll()
        if code is None:
            proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
    return code, answered, " ".join(out.split())


def test_an_offline_reward_server_fails_at_start_naming_the_models_it_lacks(tmp_path):
    """PickScore offline with an empty hub cache: exit 2 at start naming both sources (it answered
    /healthz ok and hung the first score on hub retries)."""
    env = {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code, answered, out = _serve_until_exit_or_ready(["reward=pickscore"], env)
    assert not answered and code == 2, out
    assert "2 prerequisites are missing" in out
    assert "reward.kwargs.pickscore.model_path=yuvalkirstain/PickScore_v1: not in the local hub cache" in out
    assert "reward.kwargs.pickscore.processor_path=laion/CLIP-ViT-H-14-laion2B-s32B-b79K" in out


def test_a_model_that_does_not_load_stops_the_server_before_it_listens(tmp_path):
    """The directory exists (the up-front check passes) but holds no CLIP: the server loads it before
    listening, so it exits 2 naming the reward and the path instead of answering /healthz ok."""
    empty = tmp_path / "not_a_clip"
    empty.mkdir()
    env = {"NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code, answered, out = _serve_until_exit_or_ready(
        [
            "reward=clipscore",
            f"reward.kwargs.clipscore.model_path={empty}",
            "reward.kwargs.clipscore.device=cpu",
        ],
        env,
    )
    assert not answered and code == 2, out
    assert (
        f"error: reward 'clipscore' could not load its model (reward.kwargs.clipscore.model_path={empty})"
        in out
    )
