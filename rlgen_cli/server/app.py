"""The aiohttp reward server: ``POST /v1/score``, ``GET /healthz``, ``GET /v1/rewards``, ``GET /metrics``.

``build_app(rewards, settings)`` returns an :class:`aiohttp.web.Application` that hosts several named
rewards. Score requests follow :mod:`~rlgen_cli.rewards.remote.wire` (JSON with base64 PNG/JPEG; msgpack with PNG/JPEG
bytes or raw uint8 pixels); concurrent requests for one reward are micro-batched
(:mod:`rlgen_cli.server.batcher`). This module assembles the application: routes, the middlewares that
authorise, count and turn every error into JSON, ``Expect: 100-continue``, the batchers' lifetime. A score
request's way from admission to reply is :mod:`rlgen_cli.server.pipeline`; it reads the body under the
limits with :mod:`rlgen_cli.server.body` and checks fields and images before decoding with
:mod:`rlgen_cli.server.payload`.

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

``GET /v1/rewards`` lists each reward's fingerprint and the settings it hashes
(:mod:`rlgen_cli.server.fingerprint`); every score reply carries the fingerprint in a header, which the
clients pin. Every client mistake is a JSON ``{"error": "..."}`` with a 4xx status that names the problem
(an unknown request field included); a reward
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
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.base import Reward
from rlgen_cli.rewards.remote import wire
from rlgen_cli.server.batcher import MicroBatcher
from rlgen_cli.server.body import check_declared_size
from rlgen_cli.server.fingerprint import describe
from rlgen_cli.server.pipeline import score, score_flowgrpo
from rlgen_cli.server.refusal import ApiError, ClientDisconnected
from rlgen_cli.server.settings import ServerSettings
from rlgen_cli.server.state import STATE, ServerState

logger = logging.getLogger(__name__)

__all__ = ["ServerSettings", "build_app"]  # the settings build_app takes, re-exported

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_DISCONNECTED = 499  # the metrics' status label of a request whose client went away (nginx's convention)


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


async def _expect_continue(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: refuse a request whose token or declared size already fails before
    asking for its body; else answer ``100 Continue`` as aiohttp does."""
    try:
        _check_token(request)
        check_declared_size(request)
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
    """``GET /v1/rewards``: hosted reward names, their fingerprints, the settings those hash (``config``),
    their meta, and the server limits."""
    state = request.app[STATE]
    settings = state.settings
    return web.json_response(
        {
            "rewards": [
                {
                    "name": n,
                    "fingerprint": state.fingerprints[n],
                    "config": describe(r),
                    "meta": reward_meta(r),
                }
                for n, r in sorted(state.rewards.items())
            ],
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
