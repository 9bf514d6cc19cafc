"""Typed schema of ``rlgen serve-reward``: the ``server:`` section and the hosted ``reward:`` set.

``conf/serve_reward.yaml`` extends :class:`ServeRewardConfig` (registered as ``_schema_serve_reward``), so
a misspelt ``server.*`` key or a wrong type fails at compose time with its full name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlgen_cli.errors import require
from rlgen_cli.schema.run import DataConfig, RewardConfig


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    """Interface to bind; the default keeps the server private to this machine (0.0.0.0 = every interface)."""
    port: int = 8765
    """Port of the first worker; worker i listens on port + i."""
    token: str | None = None
    """If set, clients must send ``Authorization: Bearer <token>`` (every route but /healthz)."""
    max_batch: int = 64
    """Most images merged into one micro-batch / one Reward.score call."""
    max_wait_ms: float = 10.0
    """How long a request waits for concurrent requests to share its micro-batch."""
    max_request_mb: float = 64.0
    """Largest request body in MiB (larger → 413)."""
    max_image_pixels: int = 16777216
    """Largest H×W of one image (default 4096²; larger → 413)."""
    max_image_side: int = 65500
    """Largest H or W of one image (default: the largest JPEG side; larger → 413)."""
    max_decoded_mb: float = 256.0
    """Largest decoded size of a request's images together, Σ C·H·W bytes of uint8, in MiB (larger → 413)."""
    max_request_items: int = 250000
    """Most list elements + map entries + containers in one request body, counted while parsing (→ 413)."""
    max_metadata_depth: int = 32
    """Deepest nesting of lists/maps in one sample's metadata (deeper → 413)."""
    workers: int = 1
    """Server processes, each on its own port (port, port+1, …); clients balance across them."""
    devices: list[str] = field(default_factory=list)
    """Devices given round-robin to the workers (cuda:0, 1, cpu) via CUDA_VISIBLE_DEVICES; [] = inherit."""
    shutdown_timeout_s: float = 30.0
    """On SIGINT/SIGTERM, how long to wait for in-flight requests before closing."""
    max_inflight_requests: int = 64
    """Most score requests handled at once; more wait up to admission_wait_s, then 503 + Retry-After."""
    max_inflight_decoded_mb: float = 1024.0
    """Memory all requests in flight may hold, MiB: 2× body + decoded pixels (5× for float rewards) (→ 503)."""
    admission_wait_s: float = 5.0
    """How long a request waits for room under the two in-flight budgets before its 503."""
    max_connections: int = 256
    """Most open connections per server process; one more gets 503 and is closed."""
    header_timeout_s: float = 15.0
    """Longest wait for a request head after connecting or after the previous reply (idle keep-alive too)."""
    body_timeout_s: float = 60.0
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
