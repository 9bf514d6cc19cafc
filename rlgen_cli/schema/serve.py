"""Typed schema of ``rlgen serve-reward``: the ``server:`` section and the hosted ``reward:`` set.

``conf/serve_reward.yaml`` extends :class:`ServeRewardConfig` (registered as ``_schema_serve_reward``), so
a misspelt ``server.*`` key or a wrong type fails at compose time with its full name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from rlgen_cli.errors import require
from rlgen_cli.schema.ranges import COUNT, NON_NEGATIVE, POSITIVE, Range
from rlgen_cli.schema.run import DataConfig, RewardConfig


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to bind; the default keeps the server private to this machine (0.0.0.0 = every interface)."""
    port: Annotated[int, Range(0, 65535)] = 8765
    """Port of the first worker; worker i listens on port + i."""
    token: str | None = None
    """If set, clients must send ``Authorization: Bearer <token>`` (every route but /healthz)."""
    max_batch: Annotated[int, COUNT] = 64
    """Most images merged into one micro-batch / one Reward.score call."""
    max_wait_ms: Annotated[float, NON_NEGATIVE] = 10.0
    """How long a request waits for concurrent requests to share its micro-batch."""
    max_request_mb: Annotated[float, POSITIVE] = 64.0
    """Largest request body in MiB (larger → 413)."""
    max_image_pixels: Annotated[int, COUNT] = 16777216
    """Largest H×W of one image (default 4096²; larger → 413)."""
    max_image_side: Annotated[int, COUNT] = 65500
    """Largest H or W of one image (default: the largest JPEG side; larger → 413)."""
    max_decoded_mb: Annotated[float, POSITIVE] = 256.0
    """Largest decoded size of a request's images together, Σ C·H·W bytes of uint8, in MiB (larger → 413)."""
    max_request_items: Annotated[int, COUNT] = 250000
    """Most list elements + map entries + containers in one request body, counted while parsing (→ 413)."""
    max_metadata_depth: Annotated[int, COUNT] = 32
    """Deepest nesting of lists/maps in one sample's metadata (deeper → 413)."""
    workers: Annotated[int, COUNT] = 1
    """Server processes, each on its own port (port, port+1, …); clients balance across them."""
    devices: list[str] = field(default_factory=list)
    """Devices given round-robin to the workers (cuda:0, 1, cpu) via CUDA_VISIBLE_DEVICES; [] = inherit."""
    shutdown_timeout_s: Annotated[float, NON_NEGATIVE] = 30.0
    """On SIGINT/SIGTERM, how long to wait for in-flight requests before closing."""
    max_inflight_requests: Annotated[int, COUNT] = 64
    """Most score requests handled at once; more wait up to admission_wait_s, then 503 + Retry-After."""
    max_inflight_decoded_mb: Annotated[float, POSITIVE] = 1024.0
    """Memory all requests in flight may hold, MiB: 2× body + decoded pixels (5× for float rewards) (→ 503)."""
    admission_wait_s: Annotated[float, NON_NEGATIVE] = 5.0
    """How long a request waits for room under the two in-flight budgets before its 503."""
    max_connections: Annotated[int, COUNT] = 256
    """Most open connections per server process; one more gets 503 and is closed."""
    header_timeout_s: Annotated[float, POSITIVE] = 15.0
    """Longest wait for a request head after connecting or after the previous reply (idle keep-alive too)."""
    body_timeout_s: Annotated[float, POSITIVE] = 60.0
    """Longest time a request may take to send its body (→ 408)."""
    flowgrpo_protocol: bool = False
    """Also answer Flow-GRPO's reward clients: a pickle POSTed to / (one hosted reward) or /<reward>,
    read as plain data only (no code runs) under the limits above; the reply is a pickle."""

    def __post_init__(self) -> None:
        require(
            self.workers == 1 or self.port != 0,
            "server.port=0 (any free port) cannot be combined with server.workers > 1; give a fixed port",
        )


@dataclass
class ServeRewardConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Every reward named in reward.weights is hosted (weights themselves are unused by the server)."""
    log_level: str = "INFO"
    """Console log level of the server (DEBUG, INFO, WARNING)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Unused by the server: where a reward config's natural prompts land (train and eval read them)."""
