"""What the reward server's request handlers share, kept on the application under :data:`STATE`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web

from rlgen_cli.rewards.base import Reward
from rlgen_cli.server.admission import Budget
from rlgen_cli.server.batcher import MicroBatcher
from rlgen_cli.server.fingerprint import fingerprint
from rlgen_cli.server.metrics import ServerMetrics
from rlgen_cli.server.settings import ServerSettings

__all__ = ["STATE", "ServerState"]


@dataclass
class ServerState:
    """What the handlers share: rewards, settings, metrics, one batcher per reward, the decode pool, and
    each reward's fingerprint (sent with its replies)."""

    rewards: dict[str, Reward]
    settings: ServerSettings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    batchers: dict[str, MicroBatcher] = field(default_factory=dict)
    decoder: ThreadPoolExecutor | None = None  # PNG/JPEG decoding, float conversion; one thread per core
    slots: Budget = field(init=False)  # score requests in flight (max_inflight_requests)
    bodies: Budget = field(init=False)  # bytes of their bodies, read and parsed: half the memory budget
    pixels: Budget = field(init=False)  # bytes of their decoded pixels: the other half
    fingerprints: dict[str, str] = field(init=False)  # by reward name, computed once at start

    def __post_init__(self) -> None:
        self.fingerprints = {name: fingerprint(name, reward) for name, reward in self.rewards.items()}
        self.slots = Budget(self.settings.max_inflight_requests)
        self.bodies = Budget(self.settings.max_inflight_decoded_bytes // 2)
        self.pixels = Budget(self.settings.max_inflight_decoded_bytes // 2)


STATE = web.AppKey("rlgen_state", ServerState)
