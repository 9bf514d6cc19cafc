"""Clients of served rewards, usable in a mix like any reward (registered as ``remote``,
``flowgrpo_remote``, ``openai_judge`` and their presets).

* :mod:`.client` — the three reward clients and the judge parsers;
* :mod:`.transport` — the HTTP transport they share (balancing, health checks, retries, failover);
* :mod:`.protocols` — the two foreign wire formats (Flow-GRPO's reward server, OpenAI chat completions);
* :mod:`.wire` — rlgen's own wire format, which the server (:mod:`rlgen_cli.server`) imports too.
"""

from rlgen_cli.rewards.remote.client import (
    PARSERS,
    FlowGrpoRemoteReward,
    OpenAIJudgeReward,
    RemoteReward,
    parse_qwenvl,
    parse_unifiedreward,
)
from rlgen_cli.rewards.remote.transport import (
    EndpointPool,
    RemoteRewardError,
    RequestRefusedError,
    parse_endpoints,
)

__all__ = [
    "PARSERS",
    "EndpointPool",
    "FlowGrpoRemoteReward",
    "OpenAIJudgeReward",
    "RemoteReward",
    "RemoteRewardError",
    "RequestRefusedError",
    "parse_endpoints",
    "parse_qwenvl",
    "parse_unifiedreward",
]
