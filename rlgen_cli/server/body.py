"""Reading a score request's body under the server's limits.

The declared ``Content-Length`` is checked before a byte is read; the body then arrives chunk by chunk
within ``body_timeout_s``, each chunk fed to a counter (JSON items, msgpack items and image headers,
pickle opcodes) so an oversized body is refused before the rest of it is read. A body of known length is
read into one buffer allocated up front. :func:`read_payload` then parses rlgen's own wire (JSON or
msgpack), in the decode pool above :data:`INLINE_PARSE_BYTES`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from aiohttp import web

from rlgen_cli.rewards.remote import wire
from rlgen_cli.server import limits
from rlgen_cli.server.pickle_scan import PickleScanner
from rlgen_cli.server.refusal import ApiError, ClientDisconnected, wire_error
from rlgen_cli.server.state import STATE, ServerState

__all__ = ["INLINE_PARSE_BYTES", "Counter", "check_declared_size", "is_identity", "read_body", "read_payload"]

KNOWN_ENCODINGS = frozenset(("gzip", "deflate", "br", "identity"))  # named back in errors; nothing else is
INLINE_PARSE_BYTES = 4096  # smaller bodies parse on the event loop (≤ ~2 ms, no thread hand-off)


def check_declared_size(request: web.Request) -> None:
    """413 when the declared ``Content-Length`` is above ``max_request_mb``."""
    limit = request.app[STATE].settings.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(
            413,
            f"the declared Content-Length is above server.max_request_mb ({limit} bytes); send fewer "
            "images per request (client batch_size)",  # no header value is echoed, not even this one
            kind="too_large",
        )


def is_identity(request: web.Request) -> bool:
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
    if not json_counter and request.content_length is not None and is_identity(request):
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


async def read_body(request: web.Request, counter: Counter | None = None) -> bytearray | memoryview:
    """The request body, after checking its declared length, within ``body_timeout_s``.

    Raises:
        ApiError: 413 above ``max_request_mb`` or, from ``counter``, ``max_request_items``; 408 when the
            body takes longer than ``body_timeout_s``; 400 for a body that cannot be decoded (a bad
            ``Content-Encoding`` or chunked framing).
        ClientDisconnected: The client hung up before the whole body arrived.
    """
    check_declared_size(request)
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
        raise wire_error(err) from err
    except ConnectionResetError as err:
        raise ClientDisconnected(f"{err} after the headers, before the whole body") from err
    except web.RequestPayloadError as err:
        request.content.feed_eof()  # nothing more to read: aiohttp would re-raise the error after the reply
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        named = encoding if encoding in KNOWN_ENCODINGS else "not gzip, deflate, br or identity"
        raise ApiError(
            400,
            f"request body could not be read (Content-Encoding: {named}): its chunked framing or encoding "
            "is invalid",
            close=True,
        ) from err


async def read_payload(request: web.Request, state: ServerState) -> tuple[dict[str, Any], bool]:
    """Read and parse the body (bounded, see :mod:`limits`); returns it and whether it was msgpack.

    A body's items are counted while it arrives (and a msgpack body's PNG/JPEG files have their
    chunk/segment headers walked), so an oversized one is refused before the rest is read; a body above
    ``INLINE_PARSE_BYTES`` is parsed in the decode pool, so the event loop keeps serving.
    """
    binary = request.content_type == wire.MSGPACK_TYPE
    max_items = state.settings.max_request_items
    counter = limits.MsgpackScanner(max_items) if binary else limits.JsonItemCounter(max_items)
    body = await read_body(request, counter)
    try:
        if len(body) <= INLINE_PARSE_BYTES:
            payload = limits.parse_body(body, binary, max_items, counted=True)
        else:
            loop = asyncio.get_running_loop()
            payload = await loop.run_in_executor(
                state.decoder, limits.parse_body, body, binary, max_items, True
            )
    except wire.WireError as err:
        raise wire_error(err) from err
    return payload, binary
