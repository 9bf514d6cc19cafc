"""Shared helpers of the reward-server tests: tiny rewards, a urllib HTTP helper, metric lookup."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import torch

from rlgen_cli.rewards.base import RewardBatch, RewardResult

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class MeanReward:
    """Score = mean pixel value; optionally sleeps, fails its first calls, or returns NaN for some samples."""

    def __init__(
        self, name: str = "mean", sleep_s: float = 0.0, fail_first: int = 0, nan_below: float = -1.0
    ):
        self.name, self.sleep_s, self.fail_first, self.nan_below = name, sleep_s, fail_first, nan_below
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def score(self, batch: RewardBatch) -> RewardResult:
        with self._lock:
            self.calls.append(len(batch))
            failing = len(self.calls) <= self.fail_first
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if failing:
            raise RuntimeError("transient failure (test)")
        means = batch.images.mean(dim=(1, 2, 3))
        scores = torch.where(means < self.nan_below, torch.full_like(means, float("nan")), means)
        return RewardResult(scores=scores, details={"mean": means, "tag": [p[:3] for p in batch.prompts]})


def constant_images(values: list[float], size: int = 8) -> torch.Tensor:
    """(B, 3, size, size) images, image i filled with values[i] (exactly representable in uint8)."""
    return torch.stack([torch.full((3, size, size), round(v * 255) / 255) for v in values])


def http(
    method: str, url: str, body: dict | bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict | str]:
    """One request; returns (status, parsed JSON or text)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json"} if isinstance(body, dict) else {}
    request = urllib.request.Request(url, data=data, method=method, headers=hdrs | (headers or {}))
    try:
        with _NO_PROXY.open(request, timeout=30) as response:
            status, raw, ctype = response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, raw, ctype = err.code, err.read(), err.headers.get("Content-Type", "")
    return status, json.loads(raw) if ctype.startswith("application/json") else raw.decode()


def metric(text: str, name: str) -> float:
    """The value of one exposition line ``name`` (full series name with labels)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
