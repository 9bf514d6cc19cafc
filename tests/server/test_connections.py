"""Connection-level limits of a real reward-server process on 127.0.0.1.

Idle, slow-header and slow-body connections are closed after ``header_timeout_s`` / ``body_timeout_s``;
one connection above ``max_connections`` gets 503 and is closed; ``Expect: 100-continue`` is answered
413/401/403 before any ``100 Continue`` when the declared size or the token already fails; and a fuzz of
malformed HTTP carrying the bearer token in its headers leaves the token in no log line and no reply,
with each framing error logged as one INFO line, no traceback.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.server.test_attacks import start_worker

TOKEN = "tok-7f3a9c2e51d84b60"
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 6
CLOSE_WITHIN_S = 4.0  # a timed-out connection is closed within this (timeout + scheduling slack)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, int, object]]:
    settings = {"token": TOKEN, "header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S,
                "max_connections": MAX_CONNECTIONS}  # fmt: skip
    proc, port, log = start_worker(tmp_path_factory.mktemp("connections"), settings, log_level="INFO")
    try:
        yield proc, port, log
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=CLOSE_WITHIN_S + 2)
    return sock


def _read_until_closed(sock: socket.socket, trickle: bytes = b"") -> tuple[bytes, float]:
    """Read (sending one byte of ``trickle`` every 0.2 s) until the server closes; (reply, seconds)."""
    began, chunks = time.monotonic(), []
    sock.settimeout(0.2)
    while time.monotonic() - began < CLOSE_WITHIN_S + 2:
        if trickle:
            try:
                sock.send(trickle[:1])
            except OSError:
                break
            trickle = trickle[1:]
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - began


def test_idle_slow_header_and_slow_body_connections_are_closed(worker):
    _, port, _ = worker
    idle = _connect(port)
    slow_header = _connect(port)
    slow_header.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\n")
    slow_body = _connect(port)
    head = f"POST /v1/score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    slow_body.sendall(head.encode() + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    for name, sock, trickle in (
        ("idle", idle, b""),
        ("slow header", slow_header, b"X-Slow: " + b"a" * 60),
        ("slow body", slow_body, b'"reward"' * 10),
    ):
        with sock:
            reply, seconds = _read_until_closed(sock, trickle)
        assert seconds < CLOSE_WITHIN_S, f"{name} connection still open after {seconds:.1f} s"
        if name == "slow body":
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert b"server.body_timeout_s" in reply


def test_a_connection_above_the_cap_gets_503_and_is_closed(worker):
    _, port, _ = worker
    held = [_connect(port) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # the server has accepted them all
        with _connect(port) as extra:
            reply, seconds = _read_until_closed(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply, reply[:300]
        assert b"server.max_connections=6" in reply and seconds < 1.0
    finally:
        for sock in held:
            sock.close()
        time.sleep(0.5)  # the server has seen them close: the next test starts below the cap


def _expect_reply(port: int, headers: str) -> bytes:
    """Send a request head with ``Expect: 100-continue`` and no body; the first reply the server sends."""
    with _connect(port) as sock:
        sock.sendall(f"POST /v1/score HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n{headers}\r\n".encode())
        sock.settimeout(5)
        return sock.recv(65536)


def test_expect_100_continue_is_refused_before_continue_when_size_or_token_fails(worker):
    _, port, _ = worker
    auth, json_type = f"Authorization: Bearer {TOKEN}\r\n", "Content-Type: application/json\r\n"
    cases = [
        (auth + json_type + "Content-Length: 1000000000000\r\n", b"HTTP/1.1 413"),
        (json_type + "Content-Length: 100\r\n", b"HTTP/1.1 401"),
        ("Authorization: Bearer wrong\r\n" + json_type + "Content-Length: 100\r\n", b"HTTP/1.1 403"),
        (auth + json_type + "Content-Length: 100\r\n", b"HTTP/1.1 100 Continue"),
    ]
    for headers, expected in cases:
        reply = _expect_reply(port, headers)
        assert reply.startswith(expected), (headers, reply[:200])


FUZZ = [
    f"Authorization: Bearer {TOKEN}\x00",
    f"Authorization: Bearer {TOKEN}\x01x",
    f"Authorization: Bearer {TOKEN}\r\n \x7fcontinued",
    f"X-Api-Key: {TOKEN}\x00",
    f"Cookie: session={TOKEN}\x0b",
    f"X-Long: {TOKEN}" + "a" * 20_000,
    f"Content-Length: {TOKEN}",
    f"Transfer-Encoding: chunked\r\nAuthorization: Bearer {TOKEN}\r\n\r\nzz{TOKEN}",
    f"Authorization: Bearer {TOKEN}\r\nContent-Length: 5\r\nContent-Length: 7",
    f"{TOKEN}: value",
    f"Bad Header {TOKEN}",
    f"Host: {TOKEN}\x00",
]


def test_a_fuzz_of_malformed_http_never_logs_or_echoes_the_token(worker):
    proc, port, log = worker
    before = log.read_text()
    replies = []
    for i, header in enumerate(FUZZ):
        request = f"POST /v1/score HTTP/1.1\r\nHost: x\r\n{header}\r\n\r\n".encode("latin-1")
        with _connect(port) as sock:
            sock.sendall(request)
            reply, _ = _read_until_closed(sock)
        replies.append(reply)
        assert reply.startswith(b"HTTP/1.") and reply[9:10] == b"4", (i, reply[:200])
    time.sleep(0.5)  # the last lines reach the log
    lines = log.read_text()[len(before) :].splitlines()
    assert proc.poll() is None
    assert not [line for line in lines if TOKEN in line], "the token reached the log"
    assert not [reply for reply in replies if TOKEN.encode() in reply], "the token reached a reply"
    assert not [line for line in lines if "Traceback" in line or " ERROR " in line], "\n".join(lines[-20:])
    framing = [line for line in lines if "malformed HTTP request" in line]
    assert framing and all(" INFO " in line for line in framing), "\n".join(lines[-20:])
