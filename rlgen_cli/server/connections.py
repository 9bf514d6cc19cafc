"""Connection-level limits of the reward server, below the application.

:class:`ServerRunner` is the ``aiohttp`` runner every server process uses. It adds what aiohttp leaves
open:

* **a cap on open connections** (``server.max_connections``): one more is answered ``503`` with
  ``Retry-After`` and closed at once, before any of its bytes is read;
* **a header timeout** (``server.header_timeout_s``): a connection that has not sent a complete request
  head that long after it opened or after its previous reply (idle keep-alive, or headers trickling in
  a byte at a time) is closed; the body timeout (``server.body_timeout_s``) is the handler's;
* **quiet framing errors**: a request that is not valid HTTP (bad request line, header bytes, chunked
  framing) is answered ``400`` with a fixed JSON message and logged as one INFO line naming only the
  error's class and the peer — never the offending bytes, which may hold a header value such as a
  bearer token. The access log (DEBUG only) names no header either.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger(__name__)

__all__ = ["ServerRunner"]

_ACCESS_LOG_FORMAT = '%a "%r" %s %b %Tf'  # no header fields (aiohttp's default logs Referer and User-Agent)


def _busy_reply(max_connections: int) -> bytes:
    body = json.dumps(
        {"error": f"the server holds server.max_connections={max_connections} open connections; retry"}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Handler(RequestHandler):
    """aiohttp's connection handler, refusing connections above the cap and logging framing errors quietly."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = self._manager
        cap = getattr(manager, "max_connections", None)
        if cap is not None and len(manager.connections) >= cap:
            logger.info("refused a connection: server.max_connections=%d are open", cap)
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(_busy_reply(cap))
            transport.close()
            self._manager = None  # never registered: connection_lost has nothing to undo
            return
        super().connection_made(transport)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        logger.info(
            "malformed HTTP request from %s refused (%s); connection closed",
            request.remote,
            type(exc).__name__,
        )
        response = web.json_response(
            {"error": f"malformed HTTP request ({type(exc).__name__}): check the request line and headers"},
            status=status,
        )
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's server, making :class:`_Handler` connections and knowing the connection cap."""

    max_connections: int | None = None

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class ServerRunner(web.AppRunner):
    """The runner of a reward-server app: the limits of ``app``'s :class:`ServerSettings` per connection.

    Args:
        app: An app from :func:`rlgen_cli.server.app.build_app` (another app runs with aiohttp's defaults).
        kwargs: Passed to :class:`aiohttp.web.AppRunner` (``shutdown_timeout``).
    """

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        from rlgen_cli.server.state import STATE

        state = app.get(STATE)  # None for another aiohttp app (test doubles of foreign servers)
        if state is not None:
            kwargs.setdefault("keepalive_timeout", state.settings.header_timeout_s)
        super().__init__(app, access_log_format=_ACCESS_LOG_FORMAT, **kwargs)
        self._max_connections = None if state is None else state.settings.max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same object, making capped, quiet connection handlers
        server.max_connections = self._max_connections
        return server
