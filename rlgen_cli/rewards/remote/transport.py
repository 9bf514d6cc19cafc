"""Client-side HTTP transport shared by the remote rewards: endpoints, balancing, health, retries, counters.

:class:`EndpointPool` sends one request at a time per call (callers use threads for parallelism) with:

* **balancing** — each request goes to the healthy endpoint with the fewest requests in flight
  (ties: the fewest requests so far), so concurrent chunks spread over every server;
* **health checks** — lazy: an endpoint is probed (``GET health_path``) before its first use, after
  ``health_interval_s`` without a successful request, and when its cool-down after a failure ends;
* **retries with failover** — a connection error, timeout, 5xx/429 or malformed reply is retried up to
  ``retries`` times with exponential backoff, each time on an endpoint not yet tried in this call when
  one is left;
* **cool-down** — a refused connection, a timeout (a frozen server that accepts connections but never
  answers), a 503 or a failed health check takes the endpoint out of rotation for ``health_interval_s``,
  doubled after each further consecutive failure (up to ``max(health_interval_s, 300 s)``) and reset by a
  success, so a dead or frozen endpoint costs a timeout now and then, not on every call. A 503 with
  ``Retry-After`` (a busy reward server) takes it out for that long instead (at most 30 s), and when no
  other endpoint is left to fail over to, the next attempt waits for it;
* **no silent failures** — every failure is logged and counted (:meth:`EndpointPool.stats`); a 4xx
  reply (a client or configuration mistake) is raised at once with the server's message.

Connections are kept alive: each endpoint keeps its idle HTTP/1.1 connections (``http.client``, one
per thread in use, no event loop) and a request reuses one when it can, so a steady stream of requests
pays no TCP handshake or server-side connection setup. A reused connection that the server has closed
meanwhile is replaced by a fresh one once, transparently; every other failure is handled as above.
Proxy environment variables are ignored (the endpoints are addressed directly).
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.remote.wire import WireError

logger = logging.getLogger(__name__)

__all__ = ["EndpointPool", "RemoteRewardError", "RequestRefusedError", "parse_endpoints"]

T = TypeVar("T")
_MAX_IDLE = 64  # idle keep-alive connections kept per endpoint
_MAX_BACKOFF_S = 30.0  # longest wait before a retry (doubling backoff, or a server's Retry-After)
_MAX_COOLDOWN_S = 300.0  # cap of the doubling cool-down (unless health_interval_s is longer)
# Errors of a reused keep-alive connection that the server closed while it sat idle: retried once, fresh.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class RemoteRewardError(RuntimeError):
    """A remote score could not be obtained (every attempt failed, or the server refused the request)."""


class RequestRefusedError(RemoteRewardError):
    """The server answered 4xx: a client or configuration mistake that no retry (and no NaN) can hide."""


def _seconds(value: str | None) -> float | None:
    """A ``Retry-After`` in delay-seconds form (an HTTP date is ignored), capped at the longest backoff."""
    try:
        return min(max(float(value), 0.0), _MAX_BACKOFF_S) if value else None
    except ValueError:
        return None


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str | int):
        return [value]
    return list(value)


def parse_endpoints(
    endpoints: str | Sequence[str] | None = None,
    hosts: str | Sequence[str] | None = None,
    ports: int | Sequence[int] | None = None,
    suffix: str = "",
) -> list[str]:
    """Expand the configured endpoints into base URLs.

    Args:
        endpoints: Full URLs (``http://h:p`` or ``http://h:p/v1``); ``http://`` is added when missing.
        hosts: Hosts combined with every port (default ``127.0.0.1`` when only ports are given).
        ports: Ports combined with every host.
        suffix: Path appended to each host × port URL (``/v1`` for OpenAI-compatible servers).

    Returns:
        Distinct base URLs without a trailing slash, in order.

    Raises:
        UserError: If nothing is configured.
    """
    urls = [u if "://" in u else f"http://{u}" for u in map(str, _as_list(endpoints))]
    host_list, port_list = _as_list(hosts), _as_list(ports)
    if host_list and not port_list:
        raise UserError(f"hosts={host_list} given without ports; add ports=[...] or use full endpoint URLs")
    urls += [f"http://{h}:{p}{suffix}" for h in (host_list or ["127.0.0.1"]) for p in port_list]
    urls = list(dict.fromkeys(u.rstrip("/") for u in urls))
    if not urls:
        raise UserError(
            "no reward endpoints: give endpoints=[http://host:port] or hosts=[...] and ports=[...]"
        )
    return urls


class _Connections:
    """Idle keep-alive connections to one base URL (``http`` or ``https``, with an optional path prefix)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"endpoint {url!r} is not an http(s)://host[:port] URL")
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port
        self.prefix = parts.path.rstrip("/")
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _new(self, timeout: float) -> http.client.HTTPConnection:
        factory = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return factory(self.host, self.port, timeout=timeout)

    def _take(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection (``reused=True``) or a new one, with its socket timeout set."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            return self._new(timeout), False
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, True

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def exchange(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str], timeout: float
    ) -> tuple[int, bytes, str, float | None]:
        """One HTTP exchange on a kept-alive connection; returns ``(status, body, content_type,
        retry_after_s)`` (the reply's ``Retry-After`` in seconds, when it gives one).

        Raises:
            OSError, http.client.HTTPException: On connection failures and timeouts (the connection is
                dropped). A reused connection found closed by the server is retried once on a new one.
        """
        conn, reused = self._take(timeout)
        while True:
            try:
                conn.request(method, self.prefix + path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except _STALE:
                conn.close()
                if not reused:
                    raise
                conn, reused = self._new(timeout), False  # the server closed it while idle: once more, fresh
                continue
            except BaseException:
                conn.close()
                raise
            if response.will_close:
                conn.close()
            else:
                self._give_back(conn)
            retry_after = _seconds(response.getheader("Retry-After"))
            return response.status, data, response.getheader("Content-Type", ""), retry_after

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


@dataclass
class _Endpoint:
    url: str
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    healthy: bool = False
    checked_at: float | None = None  # last successful probe or request
    retry_at: float = 0.0  # end of the cool-down after a failure
    down_streak: int = 0  # consecutive failures that took it out of rotation; 0 after a success
    connections: _Connections | None = None


class EndpointPool:
    """Balanced, health-checked, retrying access to a set of equivalent HTTP endpoints.

    Attributes:
        urls: Base URLs.
        timeout_s: Per-attempt timeout.
        retries: Extra attempts after the first.
        backoff_s: First backoff; doubles on each retry (capped at 30 s).
        health_path: Probe path (``/healthz``), or ``None`` to skip probes (cool-down only).
        health_interval_s: First cool-down after a failure (doubling while failures repeat), and the idle
            time after which a probe is repeated.
    """

    def __init__(
        self,
        urls: Sequence[str],
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        health_path: str | None = "/healthz",
        health_interval_s: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not urls:
            raise UserError("an endpoint pool needs at least one URL")
        if retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise UserError(
                f"need retries ≥ 0, timeout_s > 0, backoff_s ≥ 0; got {retries}, {timeout_s}, {backoff_s}"
            )
        self.urls = list(urls)
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.health_path, self.health_interval_s = health_path, health_interval_s
        self.headers = dict(headers or {})
        self._endpoints = [_Endpoint(url, connections=_Connections(url)) for url in self.urls]
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    # ----------------------------------------------------------------- counters
    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to counter ``key`` (thread-safe)."""
        with self._lock:
            self._counts[key] += n

    def stats(self) -> dict[str, Any]:
        """A snapshot of every counter, plus per-endpoint requests, failures, health and load."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["endpoints"] = {
                e.url: {
                    "requests": e.requests,
                    "failures": e.failures,
                    "healthy": e.healthy,
                    "in_flight": e.in_flight,
                }
                for e in self._endpoints
            }
        return out

    def close(self) -> None:
        """Close the idle keep-alive connections (new ones open on the next request)."""
        for endpoint in self._endpoints:
            endpoint.connections.close()

    # ---------------------------------------------------------------- transport
    def _http(
        self,
        method: str,
        endpoint: _Endpoint,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
    ) -> tuple[int, bytes, str, float | None]:
        """One HTTP exchange on a kept-alive connection; ``(status, body, content_type, retry_after_s)``."""
        return endpoint.connections.exchange(method, path, body, self.headers | headers, timeout)

    def _probe(self, endpoint: _Endpoint) -> bool:
        """``GET health_path``; True when it answers 2xx."""
        self.count("health_checks")
        try:
            status, _, _, _ = self._http(
                "GET", endpoint, self.health_path, None, {}, min(self.timeout_s, 5.0)
            )
        except (OSError, http.client.HTTPException) as err:
            status, reason = 0, str(err)
        else:
            reason = f"HTTP {status}"
        if 200 <= status < 300:
            return True
        self.count("health_failures")
        logger.warning("health check of %s failed: %s", endpoint.url, reason)
        return False

    def _needs_probe(self, endpoint: _Endpoint, now: float) -> bool:
        if self.health_path is None:
            return False
        return (
            not endpoint.healthy
            or endpoint.checked_at is None
            or now - endpoint.checked_at > self.health_interval_s
        )

    def _acquire(self, exclude: set[str]) -> _Endpoint | None:
        """Reserve the least-loaded usable endpoint (probing it first if due); None when none is usable."""
        skipped: set[str] = set()
        while True:
            with self._lock:
                now = time.monotonic()
                usable = [
                    e for e in self._endpoints if (e.healthy or now >= e.retry_at) and e.url not in skipped
                ]
                fresh = [e for e in usable if e.url not in exclude] or usable
                if not fresh:
                    return None
                endpoint = min(fresh, key=lambda e: (e.in_flight, e.requests))
                endpoint.in_flight += 1
                probe = self._needs_probe(endpoint, now)
            if not probe or self._probe(endpoint):
                with self._lock:
                    endpoint.healthy, endpoint.checked_at = True, time.monotonic()
                return endpoint
            self._release(endpoint, ok=False, down=True)
            skipped.add(endpoint.url)

    def _other_usable(self, tried: set[str]) -> bool:
        """Whether an endpoint not tried in this call is in rotation now (somewhere to fail over to)."""
        with self._lock:
            now = time.monotonic()
            return any(e.url not in tried and (e.healthy or now >= e.retry_at) for e in self._endpoints)

    def _cooldown_s(self, streak: int) -> float:
        """Cool-down after the ``streak``-th consecutive failure: ``health_interval_s`` doubling, capped."""
        cap = max(self.health_interval_s, _MAX_COOLDOWN_S)
        return min(self.health_interval_s * 2.0 ** min(streak - 1, 32), cap)

    def _release(
        self, endpoint: _Endpoint, ok: bool, down: bool = False, retry_after: float | None = None
    ) -> None:
        with self._lock:
            endpoint.in_flight -= 1
            if ok:
                endpoint.healthy, endpoint.checked_at = True, time.monotonic()
                endpoint.down_streak = 0
            elif down and retry_after is not None:  # busy, not broken: out for as long as it asked
                endpoint.healthy = False
                endpoint.retry_at = time.monotonic() + retry_after
            elif down:
                endpoint.down_streak += 1
                endpoint.healthy = False
                endpoint.retry_at = time.monotonic() + self._cooldown_s(endpoint.down_streak)

    def _failure(self, endpoint: _Endpoint, kind: str, detail: str) -> str:
        """Count and log one failed attempt; returns the message for the final error."""
        self.count("failures")
        self.count(kind)
        with self._lock:
            endpoint.failures += 1
        message = f"{endpoint.url}: {kind}: {detail}"
        logger.warning("remote reward attempt failed on %s", message)
        return message

    def _attempt(
        self,
        endpoint: _Endpoint,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        parse: Callable,
    ) -> tuple[bool, Any, float | None]:
        """One attempt on a reserved endpoint: ``(True, result, None)`` or ``(False, error message,
        Retry-After of a 503 or None)``.

        The endpoint is always released; a connection failure, a timeout or a 503 puts it in cool-down
        (a 503's ``Retry-After`` long when it gives one).

        Raises:
            RequestRefusedError: On a 4xx reply (retrying cannot help).
        """
        ok = down = False
        retry_after = None
        try:
            try:
                status, data, ctype, retry_after = self._http(
                    method, endpoint, path, body, headers, self.timeout_s
                )
            except TimeoutError as err:
                down = True  # frozen or overloaded: the next calls should not wait for it again
                return False, self._failure(endpoint, "timeouts", str(err) or "timed out"), None
            except (OSError, http.client.HTTPException) as err:
                down = True
                if isinstance(getattr(err, "reason", None), TimeoutError):
                    return False, self._failure(endpoint, "timeouts", str(err)), None
                message = self._failure(endpoint, "connection_errors", f"{type(err).__name__}: {err}")
                return False, message, None
            if 200 <= status < 300:
                try:
                    result = parse(data, ctype)
                except WireError as err:
                    return False, self._failure(endpoint, "bad_replies", str(err)), None
                ok = True
                self.count("ok")
                return True, result, None
            detail = f"HTTP {status}: {data[:500].decode('utf-8', 'replace')}"
            if status >= 500 or status == 429:
                down = status == 503
                if not down:
                    retry_after = None
                return False, self._failure(endpoint, "http_5xx", detail), retry_after
            self._failure(endpoint, "http_4xx", detail)
            raise RequestRefusedError(
                f"reward server {endpoint.url}{path} refused the request ({detail}); fix the request or config"
            )
        finally:
            self._release(endpoint, ok=ok, down=down, retry_after=retry_after if down else None)

    def request(
        self,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        parse: Callable[[bytes, str], T],
        method: str = "POST",
    ) -> T:
        """Send one request with balancing, retries and failover; return ``parse(body, content_type)``.

        Args:
            path: Path appended to the endpoint's base URL.
            body: Request body.
            headers: Extra headers.
            parse: Turns a 2xx reply into the result; raises :class:`WireError` for a malformed reply.
            method: HTTP method.

        Returns:
            The parsed reply of the first successful attempt.

        Raises:
            RequestRefusedError: On a 4xx reply.
            RemoteRewardError: When every attempt failed.
        """
        tried: set[str] = set()
        errors: list[str] = []
        retry_after: float | None = None
        self.count("requests")
        for attempt in range(self.retries + 1):
            if attempt:
                self.count("retries")
                delay = min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S)
                if retry_after is not None and not self._other_usable(tried):
                    delay = max(delay, retry_after)  # the busy server said when; nowhere else to go
                time.sleep(delay)
            endpoint = self._acquire(tried)
            if endpoint is None:
                self.count("no_endpoint")
                errors.append("no healthy endpoint (all failed their health check or are cooling down)")
                continue
            if tried and endpoint.url not in tried:
                self.count("failovers")
            tried.add(endpoint.url)
            with self._lock:
                endpoint.requests += 1
            ok, outcome, retry_after = self._attempt(endpoint, method, path, body, headers, parse)
            if ok:
                return outcome
            errors.append(outcome)
        raise RemoteRewardError(
            f"no score after {self.retries + 1} attempts on {sorted(tried) or self.urls}: {'; '.join(errors[-3:])}. "
            "Check that the reward servers are running and reachable."
        )
