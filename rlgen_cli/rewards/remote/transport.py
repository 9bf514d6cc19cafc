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
* **early probes** — when every endpoint is cooling down, an attempt probes the one whose cool-down ends
  first instead of giving up, so the retries reach a server that came back meanwhile;
* **deadlines** — ``timeout_s`` bounds a whole attempt (connect, send, the entire reply: each socket
  operation gets what is left of it), and a reply body above ``max_reply_bytes`` is a bad reply;
* **pinning** — with ``pin_header`` (the reward fingerprint), the first 2xx reply pins its value and a
  reply carrying another raises :class:`FingerprintMismatchError`: two configs are never mixed;
* **no silent failures** — every failure is logged and counted (:meth:`EndpointPool.stats`); a 4xx
  reply (a client or configuration mistake) is raised at once with the server's message, except a 408
  (the server timed out reading the body), which is retried like a timeout.

Connections are kept alive: each endpoint keeps its idle HTTP/1.1 connections (``http.client``, one
per thread in use, no event loop) and a request reuses one when it can, so a steady stream of requests
pays no TCP handshake or server-side connection setup. A reused connection that the server has closed
meanwhile is replaced by a fresh one once, transparently; every other failure is handled as above.
Proxy environment variables are ignored (the endpoints are addressed directly).
"""

from __future__ import annotations

import functools
import http.client
import io
import logging
import math
import socket
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast

from rlgen_cli.errors import UserError
from rlgen_cli.rewards.remote.wire import WireError

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_REPLY_BYTES", "EndpointPool", "FingerprintMismatchError", "RemoteRewardError", "ReplyTooLargeError",
    "RequestRefusedError", "parse_endpoints",
]  # fmt: skip

T = TypeVar("T")
_MAX_IDLE = 64  # idle keep-alive connections kept per endpoint
_MAX_BACKOFF_S = 30.0  # longest wait before a retry (doubling backoff, or a server's Retry-After)
_MAX_COOLDOWN_S = 300.0  # cap of the doubling cool-down (unless health_interval_s is longer)
MAX_REPLY_BYTES = 64 << 20  # a reward server's reply holds scores and details: far below this
# Errors of a reused keep-alive connection that the server closed while it sat idle: retried once, fresh.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class RemoteRewardError(RuntimeError):
    """A remote score could not be obtained (every attempt failed, or the server refused the request)."""


class RequestRefusedError(RemoteRewardError):
    """The server answered 4xx: a client or configuration mistake that no retry (and no NaN) can hide."""


class FingerprintMismatchError(RequestRefusedError):
    """An endpoint's reply carries another reward fingerprint than the one pinned at first contact: the
    endpoints host the same reward name with other settings (or another rlgen version)."""


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


def _too_slow(timeout_s: float) -> TimeoutError:
    return TimeoutError(f"no complete reply within timeout_s={timeout_s:g} s")


def _left(deadline: float, timeout_s: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic()``), or TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _too_slow(timeout_s)
    return left


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each given what is left of its connection's deadline as timeout, so a server
    that trickles its reply a byte at a time cannot hold a request past ``timeout_s``."""

    def __init__(self, sock: socket.socket, owner: _DeadlineHTTP) -> None:
        super().__init__()
        self._sock, self._owner = sock, owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        timeout_s = self._owner.timeout_s
        self._sock.settimeout(_left(self._owner.deadline, timeout_s))
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError as err:
            raise _too_slow(timeout_s) from err


class _DeadlineResponse(http.client.HTTPResponse):
    """An HTTP response read through a :class:`_DeadlineReader`."""

    def __init__(self, sock: socket.socket, *args: Any, owner: _DeadlineHTTP, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        plain, self.fp = self.fp, io.BufferedReader(_DeadlineReader(sock, owner))
        plain.close()  # the socket's own reader: closing it lets the connection close the socket


class _DeadlineHTTP(http.client.HTTPConnection):
    """An HTTP connection whose sends and reads share one deadline per exchange (set by
    :meth:`_Connections.exchange`): ``timeout_s`` bounds the whole attempt, not each socket operation."""

    deadline = math.inf
    timeout_s = math.inf

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        response = functools.partial(_DeadlineResponse, owner=self)
        self.response_class = cast("type[http.client.HTTPResponse]", response)

    def send(self, data: Any) -> None:
        if self.sock is not None:  # else send() connects first, with timeout = what is left
            self.sock.settimeout(_left(self.deadline, self.timeout_s))
        super().send(data)


class _DeadlineHTTPS(_DeadlineHTTP, http.client.HTTPSConnection):
    """:class:`_DeadlineHTTP` over TLS."""


class ReplyTooLargeError(http.client.HTTPException):
    """A reply body above the client's cap (:data:`MAX_REPLY_BYTES`): not a reward server's answer."""


class _Reply(NamedTuple):
    """One HTTP reply: status, body and headers."""

    status: int
    body: bytes
    headers: http.client.HTTPMessage

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "")

    @property
    def retry_after(self) -> float | None:
        """The ``Retry-After`` in seconds, when it gives one (capped, see :func:`_seconds`)."""
        return _seconds(self.headers.get("Retry-After"))


def _read_capped(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    """The reply body, refused when it declares or turns out to hold more than ``max_bytes``."""
    declared = response.length  # None when chunked or delimited by the connection's end
    if declared is not None and declared > max_bytes:
        raise ReplyTooLargeError(
            f"the reply declares {declared} bytes, above the client's cap of {max_bytes} bytes for a "
            "reward-server reply: this endpoint is not a reward server, or not the one configured"
        )
    data = response.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ReplyTooLargeError(
            f"the reply goes on past the client's cap of {max_bytes} bytes for a reward-server reply: this "
            "endpoint is not a reward server, or not the one configured"
        )
    return data


class _Connections:
    """Idle keep-alive connections to one base URL (``http`` or ``https``, with an optional path prefix)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"endpoint {url!r} is not an http(s)://host[:port] URL")
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port
        self.prefix = parts.path.rstrip("/")
        self._idle: list[_DeadlineHTTP] = []
        self._lock = threading.Lock()

    def _new(self, deadline: float, timeout_s: float) -> _DeadlineHTTP:
        factory = _DeadlineHTTPS if self.https else _DeadlineHTTP
        conn = factory(self.host, self.port, timeout=_left(deadline, timeout_s))
        conn.deadline, conn.timeout_s = deadline, timeout_s
        return conn

    def _take(self, deadline: float, timeout_s: float) -> tuple[_DeadlineHTTP, bool]:
        """An idle connection (``reused=True``) or a new one, bound to ``deadline``."""
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            return self._new(deadline, timeout_s), False
        conn.deadline, conn.timeout_s = deadline, timeout_s
        conn.timeout = _left(deadline, timeout_s)  # should it reconnect
        return conn, True

    def _give_back(self, conn: _DeadlineHTTP) -> None:
        with self._lock:
            if len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def exchange(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
        max_reply_bytes: int = MAX_REPLY_BYTES,
    ) -> _Reply:
        """One HTTP exchange on a kept-alive connection, all of it (connect, send, reply) within
        ``timeout`` seconds, the reply body at most ``max_reply_bytes``.

        Raises:
            TimeoutError: When the exchange did not finish within ``timeout``.
            ReplyTooLargeError: For a reply body above ``max_reply_bytes``.
            OSError, http.client.HTTPException: On connection failures (the connection is dropped). A
                reused connection found closed by the server is retried once on a new one.
        """
        deadline = time.monotonic() + timeout
        conn, reused = self._take(deadline, timeout)
        while True:
            try:
                conn.request(method, self.prefix + path, body=body, headers=headers)
                response = conn.getresponse()
                data = _read_capped(response, max_reply_bytes)
            except _STALE:
                conn.close()
                if not reused:
                    raise
                conn, reused = self._new(deadline, timeout), False  # closed while idle: once more, fresh
                continue
            except BaseException:
                conn.close()
                raise
            if response.will_close:
                conn.close()
            else:
                self._give_back(conn)
            return _Reply(response.status, data, response.headers)

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
        timeout_s: Per-attempt timeout: connecting, sending and reading the whole reply.
        retries: Extra attempts after the first.
        backoff_s: First backoff; doubles on each retry (capped at 30 s).
        health_path: Probe path (``/healthz``), or ``None`` to skip probes (cool-down only).
        health_interval_s: First cool-down after a failure (doubling while failures repeat), and the idle
            time after which a probe is repeated.
        max_reply_bytes: Largest reply body read; a larger one is a bad reply (:data:`MAX_REPLY_BYTES`).
        pin_header: A reply header every endpoint must agree on (the reward fingerprint): the first 2xx
            reply pins its value, and a 2xx reply with another raises :class:`FingerprintMismatchError`.
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
        max_reply_bytes: int = MAX_REPLY_BYTES,
        pin_header: str | None = None,
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
        self.max_reply_bytes, self.pin_header = max_reply_bytes, pin_header
        self._pinned: tuple[str | None, str] | None = None  # (header value, the endpoint that sent it)
        self._endpoints = [_Endpoint(url, connections=_Connections(url)) for url in self.urls]
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    # ----------------------------------------------------------------- counters
    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to counter ``key`` (thread-safe)."""
        with self._lock:
            self._counts[key] += n

    def stats(self) -> dict[str, Any]:
        """A snapshot of every counter, plus per-endpoint requests, failures, health and load, and the
        pinned ``pin_header`` value (``pinned``) once a reply pinned it."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            if self._pinned is not None:
                out["pinned"] = self._pinned[0]
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
    ) -> _Reply:
        """One HTTP exchange on a kept-alive connection, within ``timeout`` and the reply cap."""
        return endpoint.connections.exchange(
            method, path, body, self.headers | headers, timeout, self.max_reply_bytes
        )

    def _probe(self, endpoint: _Endpoint) -> bool:
        """``GET health_path``; True when it answers 2xx."""
        self.count("health_checks")
        try:
            timeout = min(self.timeout_s, 5.0)
            status = self._http("GET", endpoint, self.health_path, None, {}, timeout).status
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

    def _pick(self, exclude: set[str], skipped: set[str], early: bool) -> tuple[_Endpoint, bool, bool] | None:
        """Under the lock: ``(endpoint, probe it first, picked early)``. The least-loaded endpoint in
        rotation (one not yet tried when one is left); with ``early`` and none in rotation, the one whose
        cool-down ends first, probed now. None when there is nothing to try."""
        now = time.monotonic()
        candidates = [e for e in self._endpoints if e.url not in skipped]
        usable = [e for e in candidates if e.healthy or now >= e.retry_at]
        fresh = [e for e in usable if e.url not in exclude] or usable
        if fresh:
            endpoint = min(fresh, key=lambda e: (e.in_flight, e.requests))
            return endpoint, self._needs_probe(endpoint, now), False
        if early and candidates:
            self._counts["early_probes"] += 1
            return min(candidates, key=lambda e: e.retry_at), self.health_path is not None, True
        return None

    def _acquire(self, exclude: set[str]) -> _Endpoint | None:
        """Reserve the least-loaded usable endpoint (probing it first if due); None when none is usable.

        When every endpoint is cooling down, the one whose cool-down ends first is probed at once (once
        per call), so a retry reaches a server that came back within the retries instead of finding "no
        healthy endpoint" until its cool-down (``health_interval_s``, doubling) is over.
        """
        skipped: set[str] = set()
        early = True
        while True:
            with self._lock:
                picked = self._pick(exclude, skipped, early)
                if picked is None:
                    return None
                endpoint, probe, picked_early = picked
                early = early and not picked_early
                endpoint.in_flight += 1
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

    def _check_pin(self, endpoint: _Endpoint, reply: _Reply) -> None:
        """Pin ``pin_header`` of the first 2xx reply; refuse a later one that differs, naming both."""
        if self.pin_header is None:
            return
        value = reply.headers.get(self.pin_header)
        with self._lock:
            if self._pinned is None:
                self._pinned = (value, endpoint.url)
                return
            pinned, first = self._pinned
        if value == pinned:
            return
        self._failure(endpoint, "fingerprint_mismatches", f"{self.pin_header}: {value} (pinned {pinned})")

        def shown(v: str | None) -> str:
            return repr(v) if v else "none (not an rlgen server, or an older one)"

        raise FingerprintMismatchError(
            f"{endpoint.url} serves {shown(value)} but {first} served {shown(pinned)} ({self.pin_header}): "
            "the endpoints host this reward with other settings or another rlgen version, and their scores "
            "must not be mixed. Serve the same reward.kwargs with the same rlgen on every endpoint (GET "
            "/v1/rewards shows each one's config), or give this client the endpoints of one of them"
        )

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
                reply = self._http(method, endpoint, path, body, headers, self.timeout_s)
            except ReplyTooLargeError as err:
                return False, self._failure(endpoint, "bad_replies", str(err)), None
            except TimeoutError as err:
                down = True  # frozen or overloaded: the next calls should not wait for it again
                return False, self._failure(endpoint, "timeouts", str(err) or "timed out"), None
            except (OSError, http.client.HTTPException) as err:
                down = True
                if isinstance(getattr(err, "reason", None), TimeoutError):
                    return False, self._failure(endpoint, "timeouts", str(err)), None
                message = self._failure(endpoint, "connection_errors", f"{type(err).__name__}: {err}")
                return False, message, None
            status, retry_after = reply.status, reply.retry_after
            if 200 <= status < 300:
                self._check_pin(endpoint, reply)
                try:
                    result = parse(reply.body, reply.content_type)
                except WireError as err:
                    return False, self._failure(endpoint, "bad_replies", str(err)), None
                ok = True
                self.count("ok")
                return True, result, None
            detail = f"HTTP {status}: {reply.body[:500].decode('utf-8', 'replace')}"
            if status == 408:  # the server gave up waiting for our body (a slow link): retried, no cool-down
                return False, self._failure(endpoint, "timeouts", detail), None
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
