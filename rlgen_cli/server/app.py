"""The aiohttp reward server: ``POST /v1/score``, ``GET /healthz``, ``GET /v1/rewards``, ``GET /metrics``.

``build_app(rewards, settings)`` returns an :class:`aiohttp.web.Application` that hosts several named
rewards. Score requests follow :mod:`rlgen_cli.server.wire` (JSON with base64 PNG/JPEG; msgpack with PNG/JPEG
bytes or raw uint8 pixels); concurrent requests for one reward are micro-batched
(:mod:`rlgen_cli.server.batcher`). Raw pixels are validated and viewed in place on the event loop; only
PNG/JPEG decoding goes to a decode thread pool (one thread per core). Every
client mistake is a JSON ``{"error": "..."}`` with a 4xx status that names the problem; a reward failure
is 422 (the reward rejected the input) or 500. With ``token`` set, every route except ``/healthz`` needs
``Authorization: Bearer <token>``. Shutting down (``AppRunner.cleanup``) stops accepting connections,
lets in-flight requests finish, then drains the batch queues.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from rlgen_cli.rewards.base import Reward
from rlgen_cli.schema.errors import UserError
from rlgen_cli.server import wire
from rlgen_cli.server.batcher import MicroBatcher, ScoringError
from rlgen_cli.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

__all__ = ["ApiError", "ServerSettings", "ServerState", "build_app"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
        workers: Server processes; each listens on its own port (see ``server/runner.py``).
        devices: Devices given round-robin to the workers (``cuda:0``, ``1``, ``cpu``); empty = inherit.
        shutdown_timeout_s: How long a shutdown waits for in-flight requests.
    """

    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    max_batch: int = 64
    max_wait_ms: float = 10.0
    max_request_mb: float = 64.0
    max_image_pixels: int = 4096 * 4096
    workers: int = 1
    devices: list[str] = field(default_factory=list)
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        """Check ranges; raise :class:`UserError` naming the ``server.`` key to fix."""
        checks = [
            (0 <= self.port <= 65535, f"server.port={self.port} is not a TCP port (0–65535)"),
            (self.max_batch >= 1, f"server.max_batch must be ≥ 1, got {self.max_batch}"),
            (self.max_wait_ms >= 0, f"server.max_wait_ms must be ≥ 0, got {self.max_wait_ms}"),
            (self.max_request_mb > 0, f"server.max_request_mb must be > 0, got {self.max_request_mb}"),
            (self.max_image_pixels >= 1, f"server.max_image_pixels must be ≥ 1, got {self.max_image_pixels}"),
            (self.workers >= 1, f"server.workers must be ≥ 1, got {self.workers}"),
            (self.token != "", "server.token is empty; give a secret or null for no auth"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)

    @property
    def max_request_bytes(self) -> int:
        """``max_request_mb`` in bytes."""
        return int(self.max_request_mb * 1024 * 1024)


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, a message naming the problem, a metrics ``kind``."""

    def __init__(self, status: int, message: str, kind: str = "validation") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class ServerState:
    """What the handlers share: rewards, settings, metrics, one batcher per reward, the decode pool."""

    rewards: dict[str, Reward]
    settings: ServerSettings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    batchers: dict[str, MicroBatcher] = field(default_factory=dict)
    decoder: ThreadPoolExecutor | None = None  # PNG/JPEG decoding, float conversion; one thread per core


STATE = web.AppKey("rlgen_state", ServerState)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _route(request: web.Request) -> str:
    """The matched route's path (a bounded label set), or ``other``."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "other"


@web.middleware
async def _observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost middleware: turn every error into JSON, count requests and time them."""
    metrics = request.app[STATE].metrics
    began = time.perf_counter()
    try:
        response = await handler(request)
    except ApiError as err:
        metrics.errors.inc(kind=err.kind)
        response = _error(err.status, err.message)
    except web.HTTPException as err:  # aiohttp's own: unknown route, wrong method, body too large
        kind = "too_large" if err.status == 413 else "http"
        metrics.errors.inc(kind=kind)
        detail = err.text if err.text and not err.text.startswith(f"{err.status}:") else ""
        response = _error(err.status, f"{err.reason} ({request.method} {request.path}) {detail}".strip())
    except Exception as err:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        metrics.errors.inc(kind="internal")
        response = _error(500, f"internal server error: {type(err).__name__}: {err}")
    route = _route(request)
    metrics.requests.inc(route=route, status=str(response.status))
    metrics.latency.observe(time.perf_counter() - began, route=route)
    return response


@web.middleware
async def _authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Require ``Authorization: Bearer <token>`` on every route but ``/healthz`` when a token is set."""
    token = request.app[STATE].settings.token
    if token is None or request.path == "/healthz":
        return await handler(request)
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        raise ApiError(401, "missing bearer token: send 'Authorization: Bearer <token>'", kind="auth")
    if not hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode()):
        raise ApiError(403, "wrong bearer token: use the server's token (server.token)", kind="auth")
    return await handler(request)


async def _read_payload(request: web.Request) -> tuple[dict[str, Any], bool]:
    """Read and parse the body; returns the payload and whether it was msgpack."""
    limit = request.app[STATE].settings.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(
            413,
            f"request body is {request.content_length} bytes, above server.max_request_mb "
            f"({limit} bytes); send fewer images per request (client batch_size)",
            kind="too_large",
        )
    binary = request.content_type == wire.MSGPACK_TYPE
    body = await request.read()
    try:
        if binary:
            import msgpack

            payload = msgpack.unpackb(body, raw=False)
        else:
            payload = json.loads(body)
    except Exception as err:
        fmt = "msgpack" if binary else "JSON"
        raise ApiError(400, f"request body is not valid {fmt}: {err}") from err
    if not isinstance(payload, dict):
        raise ApiError(400, f"request body must be an object, got {type(payload).__name__}")
    return payload, binary


def _check_list(payload: dict[str, Any], key: str, item_type: type | tuple[type, ...], required: bool) -> Any:
    """Return ``payload[key]`` after checking it is a list of ``item_type`` (or absent when optional)."""
    value = payload.get(key)
    if value is None:
        if required:
            raise ApiError(400, f"missing field {key!r}: a list is required")
        return None
    if not isinstance(value, list):
        raise ApiError(400, f"field {key!r} must be a list, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, item_type):
            names = " or ".join(
                t.__name__ for t in (item_type if isinstance(item_type, tuple) else (item_type,))
            )
            raise ApiError(400, f"{key}[{i}] has type {type(item).__name__}; expected {names}")
    return value


def _validate(payload: dict[str, Any], state: ServerState, binary: bool) -> tuple[str, list, list, Any]:
    """Check the fields of a score request; returns ``(reward, raw_images, prompts, metadata)``."""
    name = payload.get("reward")
    if not isinstance(name, str):
        raise ApiError(400, "missing field 'reward': give the name of a hosted reward (GET /v1/rewards)")
    if name not in state.batchers:
        raise ApiError(
            404,
            f"unknown reward {name!r}; this server hosts: {', '.join(sorted(state.batchers))}",
            "not_found",
        )
    images = _check_list(payload, "images", (bytes, dict) if binary else str, required=True)
    prompts = _check_list(payload, "prompts", str, required=True)
    metadata = _check_list(payload, "metadata", dict, required=False)
    if len(images) != len(prompts):
        raise ApiError(
            400, f"images has {len(images)} entries but prompts has {len(prompts)}; send one per image"
        )
    if metadata is not None and len(metadata) != len(prompts):
        raise ApiError(
            400, f"metadata has {len(metadata)} entries but prompts has {len(prompts)}; send one per image"
        )
    return name, images, prompts, metadata


def _decode_one(data: Any, index: int, max_pixels: int) -> np.ndarray:
    """One ``images`` entry → ``(3, H, W)`` uint8 array (a view for raw pixels, decoded for PNG/JPEG)."""
    if isinstance(data, dict):
        return wire.decode_raw_image(data, index, max_pixels)
    if isinstance(data, str):
        data = wire.b64_to_bytes(data, index)
    return wire.decode_image_array(data, index, max_pixels).transpose(2, 0, 1)


def _decode_all(raw: list[Any], max_pixels: int) -> list[np.ndarray]:
    """Turn every entry into ``(3, H, W)`` uint8 pixels; the batcher converts to float once per batch."""
    return [_decode_one(data, i, max_pixels) for i, data in enumerate(raw)]


async def _decode(raw: list[Any], state: ServerState) -> list[np.ndarray]:
    """Decode a request's images: raw pixels inline (cheap checks and views), PNG/JPEG in the decode pool."""
    max_pixels = state.settings.max_image_pixels
    try:
        if all(isinstance(data, dict) for data in raw):
            return _decode_all(raw, max_pixels)
        return await asyncio.get_running_loop().run_in_executor(state.decoder, _decode_all, raw, max_pixels)
    except wire.WireError as err:
        raise ApiError(err.status, str(err), "too_large" if err.status == 413 else "validation") from err


def _reply(body: dict[str, Any], binary: bool) -> web.Response:
    if binary:
        import msgpack

        return web.Response(body=msgpack.packb(body, use_bin_type=True), content_type=wire.MSGPACK_TYPE)
    return web.json_response(body)


async def score(request: web.Request) -> web.Response:
    """``POST /v1/score``: validate, decode, micro-batch, score, reply."""
    state = request.app[STATE]
    state.metrics.in_flight.inc()
    try:
        payload, binary = await _read_payload(request)
        name, raw, prompts, metadata = _validate(payload, state, binary)
        if not prompts:
            return _reply({"scores": [], "details": {}}, binary)
        images = await _decode(raw, state)
        try:
            scored = await state.batchers[name].submit(images, prompts, metadata)
        except ScoringError as err:
            raise ApiError(err.status, str(err), kind="scoring") from err
        scores = [wire.nan_to_none(s) for s in scored.scores]
        n_bad = sum(s is None for s in scores)
        if n_bad:
            state.metrics.nan_scores.inc(n_bad, reward=name)
            logger.warning("reward %r returned %d non-finite scores (sent as null)", name, n_bad)
        return _reply({"scores": scores, "details": scored.details}, binary)
    finally:
        state.metrics.in_flight.dec()


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: liveness (no auth)."""
    return web.json_response({"status": "ok", "rewards": len(request.app[STATE].rewards)})


def reward_meta(reward: Reward) -> dict[str, Any]:
    """Describe a reward for ``/v1/rewards``: its class, docstring summary and any ``meta`` it defines."""
    doc = (type(reward).__doc__ or "").strip().splitlines()
    meta = {"class": f"{type(reward).__module__}.{type(reward).__qualname__}", "doc": doc[0] if doc else ""}
    meta.update(wire.to_jsonable(dict(getattr(reward, "meta", {}) or {})))
    return meta


async def list_rewards(request: web.Request) -> web.Response:
    """``GET /v1/rewards``: hosted reward names, their meta, and the server limits."""
    state = request.app[STATE]
    settings = state.settings
    return web.json_response(
        {
            "rewards": [{"name": n, "meta": reward_meta(r)} for n, r in sorted(state.rewards.items())],
            "limits": {
                "max_batch": settings.max_batch,
                "max_request_mb": settings.max_request_mb,
                "max_image_pixels": settings.max_image_pixels,
            },
            "wire_formats": list(wire.FORMATS),
        }
    )


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format."""
    text = request.app[STATE].metrics.render()
    return web.Response(text=text, content_type="text/plain", headers={"X-Format": "prometheus-0.0.4"})


async def _batchers(app: web.Application) -> AsyncIterator[None]:
    """Start the decode pool and one batcher per reward; after in-flight requests finished, stop them."""
    state = app[STATE]
    state.decoder = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="rlgen-decode")
    for name, reward in state.rewards.items():
        settings = state.settings
        batcher = MicroBatcher(
            name, reward, settings.max_batch, settings.max_wait_ms, state.metrics, pool=state.decoder
        )
        batcher.start()
        state.batchers[name] = batcher
    yield
    await asyncio.gather(*(batcher.close() for batcher in state.batchers.values()))
    state.decoder.shutdown(wait=True)
    logger.info("reward batchers drained and stopped")


def build_app(rewards: dict[str, Reward], settings: ServerSettings | None = None) -> web.Application:
    """Build the reward-server application.

    Args:
        rewards: Rewards to host, by the name clients send in ``"reward"``.
        settings: Limits, batching and auth; defaults to :class:`ServerSettings()`.

    Returns:
        The application; run it with :func:`rlgen_cli.server.runner.serve` or an ``AppRunner``.

    Raises:
        UserError: If ``rewards`` is empty.
    """
    if not rewards:
        raise UserError("the reward server needs at least one reward; set reward.weights")
    settings = settings or ServerSettings()
    # aiohttp's own limit is a backstop for chunked bodies; _read_payload checks Content-Length first.
    app = web.Application(client_max_size=settings.max_request_bytes, middlewares=[_observe, _authorize])
    app[STATE] = ServerState(rewards=dict(rewards), settings=settings)
    app.cleanup_ctx.append(_batchers)
    app.router.add_post("/v1/score", score)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/rewards", list_rewards)
    app.router.add_get("/metrics", metrics)
    return app
