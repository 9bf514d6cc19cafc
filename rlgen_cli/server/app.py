"""The aiohttp reward server: ``POST /v1/score``, ``GET /healthz``, ``GET /v1/rewards``, ``GET /metrics``.

``build_app(rewards, settings)`` returns an :class:`aiohttp.web.Application` that hosts several named
rewards. Score requests follow :mod:`~rlgen_cli.rewards.remote.wire` (JSON with base64 PNG/JPEG; msgpack with PNG/JPEG
bytes or raw uint8 pixels); concurrent requests for one reward are micro-batched
(:mod:`rlgen_cli.server.batcher`).

The cost of a request is bounded before it is paid: the body size (``max_request_mb``), the items its
parsing may build (``max_request_items``, counted while parsing, :mod:`rlgen_cli.server.limits`), the
nesting of its metadata (``max_metadata_depth``), each image's pixels and sides, and the decoded size of
all its images together (``max_decoded_mb``, summed from raw shapes and PNG/JPEG headers before anything
is decoded), and the structure of each PNG/JPEG file (chunk count, ancillary bytes, text), pre-scanned
before Pillow sees it; each answers 413 naming its key or cap. A body's items are counted as it
arrives, and a msgpack body's PNG/JPEG files have their chunk/segment headers walked as they arrive, so
an oversized one is refused before the rest of it is read. Parsing and PNG/JPEG decoding run
in a thread pool (one thread per core), so the event loop — and ``/healthz`` — keeps answering during a
large request; raw pixels are validated and viewed in place.

Across requests, :mod:`rlgen_cli.server.admission` bounds what all requests in flight may hold together
(``max_inflight_requests``, ``max_inflight_decoded_mb``): a request that does not fit waits at most
``admission_wait_s``, then gets 503 with ``Retry-After``. Connections are bounded by
:mod:`rlgen_cli.server.connections` (``max_connections``, ``header_timeout_s``); a body that does not
arrive within ``body_timeout_s`` gets 408. ``Expect: 100-continue`` is answered 401/403/413 before any
``100 Continue`` when the token or the declared size already fails.

Every client mistake is a JSON ``{"error": "..."}`` with a 4xx status that names the problem; a reward
failure is 422 (the reward rejected the input) or 500. A client that disconnects before sending its whole
body is logged at INFO and counted as ``rlgen_errors_total{kind="disconnect"}``. With ``token`` set, every
route except ``/healthz`` needs ``Authorization: Bearer <token>``. Shutting down (``AppRunner.cleanup``)
stops accepting connections, lets in-flight requests finish, then drains the batch queues.

With ``flowgrpo_protocol`` on, ``POST /`` (the only hosted reward) and ``POST /<reward>`` also speak
Flow-GRPO's pickle protocol (:mod:`rlgen_cli.server.flowgrpo`), under the same limits and admission; the
body's opcodes and its images' chunk/segment headers are walked as it arrives
(:mod:`rlgen_cli.server.pickle_scan`), then it is read by :mod:`rlgen_cli.server.plain_pickle`, which
builds plain data only and never runs code.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.base import Reward, accepts_uint8
from rlgen_cli.rewards.remote import wire
from rlgen_cli.server import flowgrpo, limits
from rlgen_cli.server.admission import Budget
from rlgen_cli.server.batcher import MicroBatcher, ScoringError
from rlgen_cli.server.metrics import ServerMetrics
from rlgen_cli.server.pickle_scan import PickleScanner

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


class ApiError(Exception):
    """A request the server refuses: HTTP ``status``, a message naming the problem, a metrics ``kind``;
    ``close`` ends the connection after the reply (its framing can no longer be trusted); ``headers``
    are added to the reply (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "validation",
        close: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.close = status, message, kind, close
        self.headers = headers or {}


class ClientDisconnected(Exception):
    """The client hung up before its whole request body arrived: nothing to answer, nothing broken."""


_DISCONNECTED = 499  # the metrics' status label of a request whose client went away (nginx's convention)
_KNOWN_ENCODINGS = frozenset(("gzip", "deflate", "br", "identity"))  # named back in errors; nothing else is
_INLINE_PARSE_BYTES = 4096  # smaller bodies parse on the event loop (≤ ~2 ms, no thread hand-off)


def _wire_error(err: wire.WireError) -> ApiError:
    return ApiError(err.status, str(err), "too_large" if err.status == 413 else "validation")


@dataclass
class ServerState:
    """What the handlers share: rewards, settings, metrics, one batcher per reward, the decode pool."""

    rewards: dict[str, Reward]
    settings: ServerSettings
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    batchers: dict[str, MicroBatcher] = field(default_factory=dict)
    decoder: ThreadPoolExecutor | None = None  # PNG/JPEG decoding, float conversion; one thread per core
    slots: Budget = field(init=False)  # score requests in flight (max_inflight_requests)
    bodies: Budget = field(init=False)  # bytes of their bodies, read and parsed: half the memory budget
    pixels: Budget = field(init=False)  # bytes of their decoded pixels: the other half

    def __post_init__(self) -> None:
        self.slots = Budget(self.settings.max_inflight_requests)
        self.bodies = Budget(self.settings.max_inflight_decoded_bytes // 2)
        self.pixels = Budget(self.settings.max_inflight_decoded_bytes // 2)


STATE = web.AppKey("rlgen_state", ServerState)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


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
    except ClientDisconnected as err:
        logger.info(
            "client %s disconnected during %s %s: %s", request.remote, request.method, request.path, err
        )
        metrics.errors.inc(kind="disconnect")
        response = web.Response(status=_DISCONNECTED)
    except ApiError as err:
        metrics.errors.inc(kind=err.kind)
        response = _error(err.status, err.message, err.headers)
        if err.close:
            response.force_close()
        if err.kind == "timeout":  # a slow client: answer, then close now instead of reading on
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
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


def _check_token(request: web.Request) -> None:
    """Raise 401/403 unless the request carries the server's bearer token (no-op without a token)."""
    token = request.app[STATE].settings.token
    if token is None or request.path == "/healthz":
        return
    header = request.headers.get("Authorization", "")
    if not header.startswith("Bearer "):
        raise ApiError(401, "missing bearer token: send 'Authorization: Bearer <token>'", kind="auth")
    # aiohttp decodes header bytes as UTF-8 with surrogate escapes; encode them back the same way
    sent = header[len("Bearer ") :].encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(sent, token.encode()):
        raise ApiError(403, "wrong bearer token: use the server's token (server.token)", kind="auth")


@web.middleware
async def _authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Require ``Authorization: Bearer <token>`` on every route but ``/healthz`` when a token is set."""
    _check_token(request)
    return await handler(request)


def _check_declared_size(request: web.Request) -> None:
    """413 when the declared ``Content-Length`` is above ``max_request_mb``."""
    limit = request.app[STATE].settings.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(
            413,
            f"the declared Content-Length is above server.max_request_mb ({limit} bytes); send fewer "
            "images per request (client batch_size)",  # no header value is echoed, not even this one
            kind="too_large",
        )


async def _expect_continue(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: refuse a request whose token or declared size already fails before
    asking for its body; else answer ``100 Continue`` as aiohttp does."""
    try:
        _check_token(request)
        _check_declared_size(request)
    except ApiError as err:
        metrics = request.app[STATE].metrics
        metrics.errors.inc(kind=err.kind)
        metrics.requests.inc(route=_route(request), status=str(err.status))
        response = _error(err.status, err.message)
        response.force_close()  # the client may send the body anyway: never read it as a request
        return response
    if request.headers.get("Expect", "").lower() != "100-continue":
        raise web.HTTPExpectationFailed(text="only 'Expect: 100-continue' is understood")
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the reply proper has not started
    return None


def _identity(request: web.Request) -> bool:
    """Whether the body is sent as it is (no ``Content-Encoding``): its length is then the declared one."""
    return request.headers.get("Content-Encoding", "identity").strip().lower() == "identity"


Counter = limits.JsonItemCounter | limits.MsgpackScanner | PickleScanner
_SCAN_SLICE = 64 * 1024  # bytes a counter walks between yields to the event loop


async def _count(counter: Counter, chunk: bytes) -> None:
    """Feed ``chunk`` to ``counter`` in slices, letting other requests (``/healthz``) run in between."""
    if len(chunk) <= _SCAN_SLICE:
        counter.feed(chunk)
        return
    view = memoryview(chunk)
    for start in range(0, len(view), _SCAN_SLICE):
        counter.feed(view[start : start + _SCAN_SLICE])
        await asyncio.sleep(0)


async def _receive_declared(request: web.Request, declared: int, counter: Counter | None) -> memoryview:
    """Read a body of ``declared`` bytes into one buffer allocated up front: no growing buffer's
    reallocations (each a transient second copy) while many bodies arrive at once. Its pages are touched
    only as bytes arrive, and ``counter`` walks each chunk as it comes, so a body it refuses costs only
    the bytes read until then."""
    buffer = np.empty(declared, dtype=np.uint8)
    filled = 0
    while chunk := await request.content.readany():
        buffer[filled : filled + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)  # framing: never past
        filled += len(chunk)
        if counter is not None:
            await _count(counter, chunk)
    if filled != declared:
        raise ClientDisconnected(f"the body ended after {filled} of its {declared} bytes")
    return memoryview(buffer)


async def _receive(request: web.Request, counter: Counter | None) -> bytearray | memoryview:
    """Read the body chunk by chunk, up to ``max_request_mb``, feeding ``counter`` as it arrives (JSON
    stays a ``bytearray``: ``json.loads`` takes no memoryview)."""
    limit = request.app[STATE].settings.max_request_bytes
    json_counter = isinstance(counter, limits.JsonItemCounter)
    if not json_counter and request.content_length is not None and _identity(request):
        return await _receive_declared(request, request.content_length, counter)
    body = bytearray()
    while chunk := await request.content.readany():
        body += chunk
        if len(body) > limit:  # a chunked body declares no length
            raise ApiError(
                413,
                f"request body is above server.max_request_mb ({limit} bytes); send fewer images per "
                "request (client batch_size)",
                kind="too_large",
                close=True,
            )
        if counter is not None:
            await _count(counter, chunk)
    return body


async def _read_body(request: web.Request, counter: Counter | None = None) -> bytearray | memoryview:
    """The request body, after checking its declared length, within ``body_timeout_s``.

    Raises:
        ApiError: 413 above ``max_request_mb`` or, from ``counter``, ``max_request_items``; 408 when the
            body takes longer than ``body_timeout_s``; 400 for a body that cannot be decoded (a bad
            ``Content-Encoding`` or chunked framing).
        ClientDisconnected: The client hung up before the whole body arrived.
    """
    _check_declared_size(request)
    timeout_s = request.app[STATE].settings.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive(request, counter)
    except TimeoutError as err:
        raise ApiError(
            408,
            f"request body not received within server.body_timeout_s={timeout_s:g} s; send it faster or "
            "raise server.body_timeout_s",
            kind="timeout",
            close=True,
        ) from err
    except wire.WireError as err:
        raise _wire_error(err) from err
    except ConnectionResetError as err:
        raise ClientDisconnected(f"{err} after the headers, before the whole body") from err
    except web.RequestPayloadError as err:
        request.content.feed_eof()  # nothing more to read: aiohttp would re-raise the error after the reply
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        named = encoding if encoding in _KNOWN_ENCODINGS else "not gzip, deflate, br or identity"
        raise ApiError(
            400,
            f"request body could not be read (Content-Encoding: {named}): its chunked framing or encoding "
            "is invalid",
            close=True,
        ) from err


async def _read_payload(request: web.Request, state: ServerState) -> tuple[dict[str, Any], bool]:
    """Read and parse the body (bounded, see :mod:`limits`); returns it and whether it was msgpack.

    A body's items are counted while it arrives (and a msgpack body's PNG/JPEG files have their
    chunk/segment headers walked), so an oversized one is refused before the rest is read; a body above
    ``_INLINE_PARSE_BYTES`` is parsed in the decode pool, so the event loop keeps serving.
    """
    binary = request.content_type == wire.MSGPACK_TYPE
    max_items = state.settings.max_request_items
    counter = limits.MsgpackScanner(max_items) if binary else limits.JsonItemCounter(max_items)
    body = await _read_body(request, counter)
    try:
        if len(body) <= _INLINE_PARSE_BYTES:
            payload = limits.parse_body(body, binary, max_items, counted=True)
        else:
            loop = asyncio.get_running_loop()
            payload = await loop.run_in_executor(
                state.decoder, limits.parse_body, body, binary, max_items, True
            )
    except wire.WireError as err:
        raise _wire_error(err) from err
    return payload, binary


def _check_list(payload: dict[str, Any], key: str, item_type: type | tuple[type, ...], required: bool) -> Any:
    """Return ``payload[key]`` after checking it is a list of ``item_type`` (or absent when optional)."""
    value = payload.get(key)
    if key not in payload and required:
        raise ApiError(400, f"missing field {key!r}: a list is required")
    if value is None and not required:
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
    if "reward" not in payload:
        raise ApiError(400, "missing field 'reward': give the name of a hosted reward (GET /v1/rewards)")
    name = payload["reward"]
    if not isinstance(name, str):
        raise ApiError(
            400, f"field 'reward' must be a string (a hosted reward's name), got {type(name).__name__}"
        )
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
    if metadata is not None:
        try:
            limits.check_depth(metadata, state.settings.max_metadata_depth, "metadata")
        except wire.WireError as err:
            raise _wire_error(err) from err
    return name, images, prompts, metadata


def _checked_entry(data: Any, index: int, settings: ServerSettings) -> tuple[Any, int]:
    """Validate one ``images`` entry without decoding it: ``(raw view | (file bytes, header), C·H·W)``;
    a PNG/JPEG's chunk/segment headers are pre-scanned against the structure caps."""
    max_pixels, max_side = settings.max_image_pixels, settings.max_image_side
    if isinstance(data, dict):
        view = wire.decode_raw_image(data, index, max_pixels, max_side)
        return view, view.nbytes
    if isinstance(data, str):
        data = wire.b64_to_bytes(data, index)
    header = wire.read_image_header(data, index)
    wire.check_image_size(index, header.height, header.width, max_pixels, max_side)
    limits.scan_image_structure(data, header.format, index)
    return (data, header), header.nbytes


Checked = list[tuple[Any, int]]  # per entry: (raw view | (file bytes, header), C·H·W)


def _check_all(raw: list[Any], settings: ServerSettings) -> tuple[Checked, int]:
    """Check every entry's size (raw shapes, PNG/JPEG headers and structure) and sum it against
    ``max_decoded_mb`` before anything is decoded; returns the entries and their decoded bytes."""
    checked = [_checked_entry(data, i, settings) for i, data in enumerate(raw)]
    total = sum(nbytes for _, nbytes in checked)
    if total > settings.max_decoded_bytes:
        raise wire.WireError(
            f"the request's {len(raw)} images decode to {total} bytes (Σ C·H·W), above "
            f"server.max_decoded_mb={settings.max_decoded_mb:g} ({settings.max_decoded_bytes} bytes); send "
            "fewer or smaller images per request (client batch_size) or raise server.max_decoded_mb",
            status=413,
        )
    return checked, total


def _decode_checked(checked: Checked) -> list[np.ndarray]:
    """Turn every checked entry into ``(C, H, W)`` uint8 pixels; the batcher converts to float once per
    batch."""
    out = []
    for i, (entry, _) in enumerate(checked):
        if isinstance(entry, np.ndarray):
            out.append(entry)
        else:
            out.append(wire.decode_image_file(*entry, i).transpose(2, 0, 1))
    return out


async def _in_pool(state: ServerState, inline: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` here when ``inline``, else in the decode pool; a WireError becomes its ApiError."""
    try:
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(state.decoder, fn, *args)
    except wire.WireError as err:
        raise _wire_error(err) from err


async def _admit(state: ServerState, budget: Budget, amount: int, what: str) -> None:
    """Take ``amount`` of ``budget`` within ``admission_wait_s``, else 503 with ``Retry-After``."""
    wait_s = state.settings.admission_wait_s
    if not await budget.acquire(amount, wait_s):
        raise ApiError(
            503,
            f"the server is busy: {what} stayed full for server.admission_wait_s={wait_s:g} s; retry later "
            "or on another endpoint",
            kind="busy",
            headers={"Retry-After": "1"},
        )


def _pixel_cost(decoded_bytes: int, reward: Reward) -> int:
    """What a request's pixels hold at most: the uint8 arrays and, for a reward that takes float pixels,
    their float32 copy (4 bytes each)."""
    return decoded_bytes * (1 if accepts_uint8(reward) else 5)


def _reply(body: dict[str, Any], binary: bool) -> web.Response:
    if binary:
        import msgpack

        return web.Response(body=msgpack.packb(body, use_bin_type=True), content_type=wire.MSGPACK_TYPE)
    return web.json_response(body)


@dataclass
class _ScoreJob:
    """A parsed score request, whatever its protocol: the reward, its images (not yet checked), prompts,
    metadata, and how to answer it from the scores and details."""

    reward: str
    raw: list[Any]
    prompts: list[str]
    metadata: list[dict] | None
    respond: Callable[[list[float], dict[str, list]], web.Response]


async def _native_job(request: web.Request, state: ServerState) -> _ScoreJob:
    """Read a ``/v1/score`` request (JSON or msgpack); the reply uses its format, NaN sent as null."""
    payload, binary = await _read_payload(request, state)
    name, raw, prompts, metadata = _validate(payload, state, binary)

    def respond(scores: list[float], details: dict[str, list]) -> web.Response:
        return _reply({"scores": [wire.nan_to_none(s) for s in scores], "details": details}, binary)

    return _ScoreJob(name, raw, prompts, metadata, respond)


def _flowgrpo_reward(request: web.Request, state: ServerState) -> str:
    """The reward a Flow-GRPO request names by its path: ``/<reward>``, or ``/`` when only one is hosted."""
    hosted = sorted(state.batchers)
    name = request.match_info.get("reward")
    if name is None:
        if len(hosted) == 1:
            return hosted[0]
        raise ApiError(
            404,
            f"this server hosts several rewards ({', '.join(hosted)}); POST Flow-GRPO requests to "
            "/<reward>, e.g. http://HOST:PORT/" + hosted[0],
            "not_found",
        )
    if name not in state.batchers:
        raise ApiError(404, f"unknown reward {name!r}; this server hosts: {', '.join(hosted)}", "not_found")
    return name


async def _flowgrpo_job(request: web.Request, state: ServerState) -> _ScoreJob:
    """Read a Flow-GRPO pickle request (plain data only, never run); the reply is a pickle too."""
    name = _flowgrpo_reward(request, state)
    settings = state.settings
    body = await _read_body(request, PickleScanner(settings.max_request_items))  # walked as it arrives
    inline = len(body) <= _INLINE_PARSE_BYTES
    args = (body, settings.max_request_items, settings.max_metadata_depth)
    parsed = await _in_pool(state, inline, flowgrpo.parse_request, *args)

    def respond(scores: list[float], details: dict[str, list]) -> web.Response:
        body = flowgrpo.reply_body(scores, details, parsed.only_strict)
        return web.Response(body=body, content_type=flowgrpo.PICKLE_TYPE)

    return _ScoreJob(name, parsed.images, parsed.prompts, parsed.metadata, respond)


JobReader = Callable[[web.Request, ServerState], Awaitable[_ScoreJob]]


async def _score_with(request: web.Request, read_job: JobReader) -> web.Response:
    """Admit, read (``read_job``), check sizes, admit the pixels, decode, batch, score, reply."""
    state = request.app[STATE]
    await _admit(
        state, state.slots, 1, f"server.max_inflight_requests={state.settings.max_inflight_requests}"
    )
    body_cost = pixel_cost = 0
    state.metrics.in_flight.inc()
    try:
        # Bodies and pixels are two halves of the budget: a request holding its body's share waits only
        # for pixel shares, whose holders never wait, so requests cannot block each other for good.
        declared = request.content_length if _identity(request) else None  # encoded: inflates past it
        budget_key = f"server.max_inflight_decoded_mb={state.settings.max_inflight_decoded_mb:g}"
        cost = 2 * (state.settings.max_request_bytes if declared is None else declared)  # body + parse
        await _admit(state, state.bodies, cost, budget_key + " (request bodies: half of it)")
        body_cost = cost
        job = await read_job(request, state)
        name, raw = job.reward, job.raw
        if not job.prompts:
            return job.respond([], {})
        inline = all(isinstance(data, dict) for data in raw)  # raw pixels: cheap checks and views
        checked, decoded = await _in_pool(state, inline, _check_all, raw, state.settings)
        cost = _pixel_cost(decoded, state.rewards[name])
        await _admit(state, state.pixels, cost, budget_key + " (decoded pixels: half of it)")
        pixel_cost = cost
        images = await _in_pool(state, inline, _decode_checked, checked)
        del checked, raw
        job.raw = []  # the bodies' strings and bytes are decoded: let them go before scoring
        try:
            scored = await state.batchers[name].submit(images, job.prompts, job.metadata)
        except ScoringError as err:
            raise ApiError(err.status, str(err), kind="scoring") from err
        n_bad = sum(not math.isfinite(s) for s in scored.scores)
        if n_bad:
            state.metrics.nan_scores.inc(n_bad, reward=name)
            logger.warning("reward %r returned %d non-finite scores (sent as null)", name, n_bad)
        return job.respond(scored.scores, scored.details)
    finally:
        state.metrics.in_flight.dec()
        state.bodies.release(body_cost)
        state.pixels.release(pixel_cost)
        state.slots.release(1)


async def score(request: web.Request) -> web.Response:
    """``POST /v1/score``: rlgen's own wire (:mod:`~rlgen_cli.rewards.remote.wire`)."""
    return await _score_with(request, _native_job)


async def score_flowgrpo(request: web.Request) -> web.Response:
    """``POST /`` and ``POST /<reward>`` with ``flowgrpo_protocol``: Flow-GRPO's pickle protocol."""
    return await _score_with(request, _flowgrpo_job)


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: liveness and readiness (no auth): ``rlgen serve-reward`` listens only after every
    hosted reward's model has loaded (``runner.load_models``), so ``ok`` means a score will not wait on one."""
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
                "max_image_side": settings.max_image_side,
                "max_decoded_mb": settings.max_decoded_mb,
                "max_request_items": settings.max_request_items,
                "max_metadata_depth": settings.max_metadata_depth,
                "max_inflight_requests": settings.max_inflight_requests,
                "max_inflight_decoded_mb": settings.max_inflight_decoded_mb,
                "max_connections": settings.max_connections,
            },
            "wire_formats": list(wire.FORMATS),
            "flowgrpo_protocol": settings.flowgrpo_protocol,
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
    # aiohttp's own limit is a backstop for chunked bodies; _read_body checks Content-Length first.
    app = web.Application(client_max_size=settings.max_request_bytes, middlewares=[_observe, _authorize])
    app[STATE] = ServerState(rewards=dict(rewards), settings=settings)
    app.cleanup_ctx.append(_batchers)
    app.router.add_post("/v1/score", score, expect_handler=_expect_continue)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/rewards", list_rewards)
    app.router.add_get("/metrics", metrics)
    if settings.flowgrpo_protocol:
        app.router.add_post("/", score_flowgrpo, expect_handler=_expect_continue)
        app.router.add_post("/{reward}", score_flowgrpo, expect_handler=_expect_continue)
    return app
