"""The reward server's settings: where it listens, how it batches, and what any one request and all
requests together may cost (``server:`` in serve_reward.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.remote import wire

__all__ = ["ServerSettings"]


@dataclass
class ServerSettings:
    """How the reward server listens, batches and limits requests (``server:`` in serve_reward.yaml).

    Attributes:
        host: Interface to bind; 127.0.0.1 keeps the server private to this machine.
        port: TCP port of the first worker (worker i listens on ``port + i``); 0 = any free port.
        token: If set, clients must send ``Authorization: Bearer <token>``.
        max_batch: Most images merged into one micro-batch / one ``Reward.score`` call.
        max_wait_ms: How long a request waits for others to share its micro-batch.
        max_request_mb: Largest request body in MiB.
        max_image_pixels: Largest ``H × W`` of one image.
        max_image_side: Largest ``H`` or ``W`` of one image (65 500: the largest JPEG side).
        max_decoded_mb: Largest decoded size of a request's images together, ``Σ C·H·W`` bytes of uint8
            pixels, in MiB (the float batch a reward gets is 4× that).
        max_request_items: Most list elements, map entries and containers a request body may hold.
        max_metadata_depth: Deepest nesting of lists/maps inside one sample's metadata.
        workers: Server processes; each listens on its own port (see ``server/runner.py``).
        devices: Devices given round-robin to the workers (``cuda:0``, ``1``, ``cpu``); empty = inherit.
        shutdown_timeout_s: How long a shutdown waits for in-flight requests.
        max_inflight_requests: Most score requests handled at once (the rest wait, then 503).
        max_inflight_decoded_mb: Memory all requests in flight may hold together, in MiB: each counts
            twice its body and its decoded pixels (five times for a reward taking float pixels); see
            :mod:`rlgen_cli.server.admission`.
        admission_wait_s: How long a request waits for room under those two budgets before its 503.
        max_connections: Most open connections; one more gets 503 and is closed.
        header_timeout_s: Longest a connection may take to send a request head (after connecting or
            after its previous reply, so also the idle keep-alive time).
        body_timeout_s: Longest a request may take to send its body (408 after).
        flowgrpo_protocol: Also answer Flow-GRPO's pickle requests on ``POST /`` and ``POST /<reward>``
            (:mod:`rlgen_cli.server.flowgrpo`); off, those paths are 404.
    """

    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    max_batch: int = 64
    max_wait_ms: float = 10.0
    max_request_mb: float = 64.0
    max_image_pixels: int = 4096 * 4096
    max_image_side: int = wire.MAX_SIDE
    max_decoded_mb: float = 256.0
    max_request_items: int = 250_000
    max_metadata_depth: int = 32
    workers: int = 1
    devices: list[str] = field(default_factory=list)
    shutdown_timeout_s: float = 30.0
    max_inflight_requests: int = 64
    max_inflight_decoded_mb: float = 1024.0
    admission_wait_s: float = 5.0
    max_connections: int = 256
    header_timeout_s: float = 15.0
    body_timeout_s: float = 60.0
    flowgrpo_protocol: bool = False

    def __post_init__(self) -> None:
        """Check ranges; raise :class:`UserError` naming the ``server.`` key to fix."""
        checks = [
            (0 <= self.port <= 65535, f"server.port={self.port} is not a TCP port (0–65535)"),
            (self.max_batch >= 1, f"server.max_batch must be ≥ 1, got {self.max_batch}"),
            (self.max_wait_ms >= 0, f"server.max_wait_ms must be ≥ 0, got {self.max_wait_ms}"),
            (self.max_request_mb > 0, f"server.max_request_mb must be > 0, got {self.max_request_mb}"),
            (self.max_image_pixels >= 1, f"server.max_image_pixels must be ≥ 1, got {self.max_image_pixels}"),
            (self.max_image_side >= 1, f"server.max_image_side must be ≥ 1, got {self.max_image_side}"),
            (self.max_decoded_mb > 0, f"server.max_decoded_mb must be > 0, got {self.max_decoded_mb}"),
            (
                self.max_request_items >= 1,
                f"server.max_request_items must be ≥ 1, got {self.max_request_items}",
            ),
            (
                self.max_metadata_depth >= 1,
                f"server.max_metadata_depth must be ≥ 1, got {self.max_metadata_depth}",
            ),
            (self.workers >= 1, f"server.workers must be ≥ 1, got {self.workers}"),
            (
                self.max_inflight_requests >= 1,
                f"server.max_inflight_requests must be ≥ 1, got {self.max_inflight_requests}",
            ),
            (
                self.max_inflight_decoded_mb > 0,
                f"server.max_inflight_decoded_mb must be > 0, got {self.max_inflight_decoded_mb}",
            ),
            (self.admission_wait_s >= 0, f"server.admission_wait_s must be ≥ 0, got {self.admission_wait_s}"),
            (self.max_connections >= 1, f"server.max_connections must be ≥ 1, got {self.max_connections}"),
            (self.header_timeout_s > 0, f"server.header_timeout_s must be > 0, got {self.header_timeout_s}"),
            (self.body_timeout_s > 0, f"server.body_timeout_s must be > 0, got {self.body_timeout_s}"),
            (self.token != "", "server.token is empty; give a secret or null for no auth"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)

    @property
    def max_request_bytes(self) -> int:
        """``max_request_mb`` in bytes."""
        return int(self.max_request_mb * 1024 * 1024)

    @property
    def max_decoded_bytes(self) -> int:
        """``max_decoded_mb`` in bytes."""
        return int(self.max_decoded_mb * 1024 * 1024)

    @property
    def max_inflight_decoded_bytes(self) -> int:
        """``max_inflight_decoded_mb`` in bytes."""
        return int(self.max_inflight_decoded_mb * 1024 * 1024)
