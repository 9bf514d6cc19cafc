"""``algo.reward_scoring``: where the GRPO family scores its rollout batches. A worker thread beside the
sampler where it can hide something (an accelerator, a served reward), in line on a CPU run whose rewards
compute locally; the scores, metrics and weights are the same either way."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlgen_cli.models.sd3 import LORA_WEIGHTS_NAME
from rlgen_cli.recipes import flow_run, reward_scoring
from rlgen_cli.rewards.base import is_served
from rlgen_cli.rewards.jpeg import jpeg_compressibility
from rlgen_cli.rewards.remote.client import FlowGrpoRemoteReward, OpenAIJudgeReward, RemoteReward
from tests.conftest import TINY_RUN

SCORE = flow_run.score
MEASURED = ("time/", "peak_memory_mb")  # clocks, and on a CPU the process's peak so far (both runs share it)


def _run(mode: str, device: str, *rewards: object) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=SimpleNamespace(algo=SimpleNamespace(reward_scoring=mode)),
        device=torch.device(device),
        reward=SimpleNamespace(rewards={f"r{i}": r for i, r in enumerate(rewards)}),
    )


def test_the_served_rewards_say_so_and_the_local_ones_do_not():
    assert all(is_served(cls) for cls in (RemoteReward, FlowGrpoRemoteReward, OpenAIJudgeReward))
    assert not is_served(jpeg_compressibility())


@pytest.mark.parametrize(
    ("mode", "device", "served", "thread"),
    [
        ("auto", "cpu", False, False),  # the sampler holds every core: nothing to hide behind
        ("auto", "cpu", True, True),  # a served reward waits on the network
        ("auto", "cuda", False, True),  # the reward's work runs beside the device's
        ("thread", "cpu", False, True),
        ("inline", "cuda", True, False),
    ],
)
def test_auto_uses_a_thread_only_where_it_can_hide_something(mode, device, served, thread):
    rewards = [jpeg_compressibility(), *([SimpleNamespace(served=True)] if served else [])]
    assert reward_scoring.overlaps_sampling(_run(mode, device, *rewards)) is thread


def _train(monkeypatch, run_dir: Path, mode: str) -> tuple[list[dict], dict[str, torch.Tensor], set[str]]:
    """Two epochs with ``algo.reward_scoring=mode``: their metrics, the final LoRA weights and the names
    of the threads that scored."""
    from tests.conftest import run_cli

    threads: set[str] = set()

    def recorded(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return SCORE(*args, **kwargs)

    monkeypatch.setattr(flow_run, "score", recorded)
    code, out = run_cli(
        "train", *TINY_RUN, "epochs=2", "eval_every=0", "save_every=2", f"algo.reward_scoring={mode}",
        "algo.sample_batch_size=2", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert code == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(run_dir / "checkpoints" / "epoch_000002" / "weights" / LORA_WEIGHTS_NAME)
    return rows, weights, threads


def test_scoring_in_line_gives_the_threads_metrics_and_weights(monkeypatch, tmp_path):
    inline_rows, inline_weights, inline_threads = _train(monkeypatch, tmp_path / "inline", "inline")
    thread_rows, thread_weights, thread_threads = _train(monkeypatch, tmp_path / "thread", "thread")
    assert inline_threads == {threading.current_thread().name}
    assert len(thread_threads) == 1 and next(iter(thread_threads)).startswith("rlgen-reward")
    assert len(inline_rows) == len(thread_rows) == 2
    for inline, thread in zip(inline_rows, thread_rows, strict=True):
        assert inline.keys() == thread.keys()
        differ = {k for k in inline if not k.startswith(MEASURED) and inline[k] != thread[k]}
        assert not differ, {k: (inline[k], thread[k]) for k in differ}
        assert inline["reward/mean"] == thread["reward/mean"]
    assert inline_weights.keys() == thread_weights.keys()
    assert all(torch.equal(inline_weights[k], thread_weights[k]) for k in inline_weights)
