"""The typed ``reward.kwargs`` of the served-reward clients in ``client.py`` (one dataclass per registered
name; fields as the client's constructor arguments, ``Any`` where it takes several forms)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class _EndpointKwargs:
    """Where a served reward answers: ``endpoints`` (URL or list), or ``hosts`` × ``ports``."""

    endpoints: Any = None
    hosts: Any = None
    ports: Any = None


@dataclasses.dataclass
class RemoteKwargs(_EndpointKwargs):
    """``reward.kwargs.remote`` (args as :class:`RemoteReward`)."""

    reward: str | None = None
    token: str | None = None
    batch_size: int = 32
    timeout_s: float = 120.0
    retries: int = 3
    backoff_s: float = 0.5
    health_interval_s: float = 10.0
    max_concurrency: int | None = None
    on_failure: str = "raise"
    binary: bool | None = None
    name: str = "remote"
    wire_format: str | None = None


@dataclasses.dataclass
class DeqaKwargs(_EndpointKwargs):
    """``reward.kwargs.deqa``: :class:`FlowGrpoRemoteKwargs` but the score key, which is fixed."""

    allow_pickle: bool = False
    only_strict: bool = True
    batch_size: int = 64
    timeout_s: float = 120.0
    retries: int = 3
    backoff_s: float = 1.0
    jpeg_quality: int = 75
    on_failure: str = "raise"
    max_concurrency: int | None = None
    name: str = "deqa"


@dataclasses.dataclass
class FlowGrpoRemoteKwargs(DeqaKwargs):
    """``reward.kwargs.flowgrpo_remote`` (args as :class:`FlowGrpoRemoteReward`)."""

    score_key: str = "scores"
    name: str = "flowgrpo_remote"


@dataclasses.dataclass
class JudgePresetKwargs(_EndpointKwargs):
    """``reward.kwargs.<unifiedreward | geneval_plus | tiif>``: :class:`OpenAIJudgeKwargs` but the parser."""

    model: str | None = None
    prompt_template: str | None = None
    system_prompt: str | None = None
    api_key: str | None = None
    max_tokens: int = 4096
    temperature: float = 0.0
    timeout_s: float = 300.0
    retries: int = 3
    backoff_s: float = 1.0
    health_interval_s: float = 30.0
    max_concurrency: int = 8
    jpeg_quality: int = 95
    on_failure: str = "raise"
    name: str = "openai_judge"


@dataclasses.dataclass
class OpenAIJudgeKwargs(JudgePresetKwargs):
    """``reward.kwargs.openai_judge`` (args as :class:`OpenAIJudgeReward`; a config names the parser)."""

    parser: str = "unifiedreward"
