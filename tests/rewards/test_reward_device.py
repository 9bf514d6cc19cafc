"""A reward model's device is pinned when the reward is built: CUDA without an index becomes the device
current in the building (main) thread. The model loads and scores on the reward worker thread, whose
current CUDA device is 0 whatever the launcher selected, so an unpinned ``"cuda"`` put every process's
reward model on GPU 0. No GPU is needed: the CUDA queries are stood in for."""

from __future__ import annotations

import pytest
import torch

from rlgen_cli.rewards import clip, geneval_detect


@pytest.fixture
def process_on_gpu_3(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


@pytest.mark.parametrize("asked", [None, "cuda", torch.device("cuda")])
def test_cuda_without_an_index_is_the_device_current_at_build(process_on_gpu_3, asked):
    assert clip.resolve_device(asked) == "cuda:3"
    assert geneval_detect.resolve_device(None if asked is None else str(asked)) == torch.device("cuda", 3)


def test_an_explicit_device_is_kept(process_on_gpu_3):
    assert clip.resolve_device("cuda:1") == "cuda:1"
    assert clip.resolve_device("cpu") == "cpu"
    assert geneval_detect.resolve_device("cuda:0") == torch.device("cuda", 0)


def test_without_cuda_the_default_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert clip.resolve_device(None) == "cpu"
    assert geneval_detect.resolve_device(None) == torch.device("cpu")
