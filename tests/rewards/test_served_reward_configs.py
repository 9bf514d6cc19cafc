"""The served-reward configs (conf/reward/*): they compose, build without network access, take endpoint
overrides, and work against loopback servers (rlgen's for ``geneval_remote``, a Flow-GRPO-style pickle
server for ``deqa``)."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
import torch
from aiohttp import web
from hydra import compose, initialize_config_dir
from PIL import Image

from rlgen_cli._hydra import conf_dir
from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.rewards.remote import FlowGrpoRemoteReward, OpenAIJudgeReward, RemoteReward
from rlgen_cli.schema.serve import ServeRewardConfig
from rlgen_cli.schema.store import register_schemas
from rlgen_cli.server.app import ServerSettings, build_app
from rlgen_cli.server.runner import BackgroundServer
from rlgen_cli.tasks.common import validated
from tests.server.helpers import MeanReward, constant_images

CONFIGS = {
    "geneval_remote": ("remote", RemoteReward, "http://gpu:8765"),
    "geneval_flowgrpo": ("flowgrpo_remote", FlowGrpoRemoteReward, "http://gpu:8765"),
    "unifiedreward": ("unifiedreward", OpenAIJudgeReward, "http://gpu:8765/v1"),
    "geneval_plus_judge": ("geneval_plus", OpenAIJudgeReward, "http://gpu:8765/v1"),
    "tiif_judge": ("tiif", OpenAIJudgeReward, "http://gpu:8765/v1"),
    "deqa": ("deqa", FlowGrpoRemoteReward, "http://gpu:8765"),
    "geneval_pickscore": ("remote", RemoteReward, "http://gpu:8765"),
}


def _reward_cfg(*overrides: str):
    register_schemas()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg: ServeRewardConfig = validated(compose(config_name="serve_reward", overrides=list(overrides)))
    return cfg.reward


def _mix(reward_cfg):
    return build_mix(dict(reward_cfg.weights), **{k: dict(v) for k, v in reward_cfg.kwargs.items()})


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_config_composes_builds_and_takes_endpoint_overrides(config):
    name, cls, url = CONFIGS[config]
    ports = f"reward.kwargs.{name}.ports=[8765,8766]"
    mix = _mix(_reward_cfg(f"reward={config}", f"reward.kwargs.{name}.hosts=[gpu]", ports))
    assert isinstance(mix.rewards[name], cls)  # built without any network access
    assert mix.rewards[name].pool.urls == [url, url.replace("8765", "8766")]
    if config == "geneval_pickscore":
        assert set(mix.rewards) == {"remote", "pickscore"}


@pytest.mark.parametrize("config", ["geneval_remote", "tiif_judge"])
def test_full_endpoint_urls_replace_the_default_port(config):
    name, _, url = CONFIGS[config]
    cfg = _reward_cfg(
        f"reward={config}", f"reward.kwargs.{name}.ports=null", f"reward.kwargs.{name}.endpoints=[{url}]"
    )
    assert _mix(cfg).rewards[name].pool.urls == [url]
    assert _mix(_reward_cfg(f"reward={config}")).rewards[name].pool.urls[0].startswith("http://127.0.0.1:")


def test_geneval_remote_config_scores_through_an_rlgen_server():
    values = [0.2, 0.4, 0.8]
    settings = ServerSettings(port=0, max_wait_ms=0, token="t")
    with BackgroundServer(build_app({"geneval": MeanReward()}, settings)) as server:
        cfg = _reward_cfg(
            "reward=geneval_remote",
            f"reward.kwargs.remote.ports=[{server.port}]",
            "reward.kwargs.remote.token=t",
        )
        result = _mix(cfg).score(RewardBatch(prompts=["a"] * 3, images=constant_images(values)))
    assert result.scores.tolist() == pytest.approx([round(v * 255) / 255 for v in values], abs=1e-6)


def _fake_deqa() -> web.Application:
    """Flow-GRPO's app_deqa.py protocol: pickle {"images": [JPEG]} in, pickle {"outputs": [score/5]} out."""

    async def score(request: web.Request) -> web.Response:
        data = pickle.loads(await request.read())  # the test server trusts its own client
        means = [np.asarray(Image.open(io.BytesIO(j), formats=["jpeg"])).mean() / 255 for j in data["images"]]
        return web.Response(body=pickle.dumps({"outputs": [(1 + 4 * m) / 5 for m in means]}))

    app = web.Application()
    app.router.add_post("/", score)
    return app


def test_deqa_config_scores_through_a_flowgrpo_style_server():
    values = [0.0, 0.5, 1.0]
    with BackgroundServer(_fake_deqa()) as server:
        cfg = _reward_cfg("reward=deqa", f"reward.kwargs.deqa.ports=[{server.port}]")
        mix = _mix(cfg)
        result = mix.score(RewardBatch(prompts=["x"] * 3, images=constant_images(values, 16)))
    assert result.scores.tolist() == pytest.approx([(1 + 4 * v) / 5 for v in values], abs=0.02)
    assert mix.rewards["deqa"].stats()["ok"] == 1 and not torch.isnan(result.scores).any()
