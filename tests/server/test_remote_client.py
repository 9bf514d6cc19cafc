"""The ``remote`` client against real loopback servers: balancing, failover, retries, failure accounting."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from aiohttp import web

from rlgen_cli.errors import UserError
from rlgen_cli.rewards import RewardBatch, build_mix
from rlgen_cli.rewards.remote import RemoteReward, RemoteRewardError, RequestRefusedError
from rlgen_cli.rewards.remote.transport import EndpointPool, parse_endpoints
from rlgen_cli.server.app import ServerSettings, build_app
from rlgen_cli.server.runner import BackgroundServer
from tests.server.helpers import MeanReward, constant_images

VALUES = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
FAST = {"backoff_s": 0.01, "health_interval_s": 60.0}


def _batch(values: list[float] = VALUES) -> RewardBatch:
    return RewardBatch(prompts=[f"p{i}" for i in range(len(values))], images=constant_images(values))


def _expected(values: list[float] = VALUES) -> torch.Tensor:
    return torch.tensor([round(v * 255) / 255 for v in values])


def _dead_url() -> str:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_parse_endpoints():
    assert parse_endpoints(["h:1", "http://h:1/"]) == ["http://h:1"]
    assert parse_endpoints(hosts=["a", "b"], ports=[1, 2], suffix="/v1") == [
        "http://a:1/v1",
        "http://a:2/v1",
        "http://b:1/v1",
        "http://b:2/v1",
    ]
    assert parse_endpoints(ports=8765) == ["http://127.0.0.1:8765"]
    with pytest.raises(UserError, match="no reward endpoints"):
        parse_endpoints()
    with pytest.raises(UserError, match="needs reward=NAME"):
        RemoteReward(endpoints=["h:1"])


def test_balances_across_two_servers_and_works_in_a_mix(serve):
    rewards = [MeanReward(), MeanReward()]
    servers = [serve({"mean": r}) for r in rewards]
    client = RemoteReward("mean", endpoints=[s.url for s in servers], batch_size=2, **FAST)
    result = client.score(_batch())
    assert torch.allclose(result.scores, _expected()) and result.details["tag"] == [f"p{i}" for i in range(8)]
    assert all(r.calls for r in rewards)  # both servers did work
    stats = client.stats()
    assert stats["ok"] == 4 and stats.get("failures", 0) == 0
    assert all(e["requests"] >= 1 for e in stats["endpoints"].values())
    mix = build_mix({"remote": 2.0}, remote={"reward": "mean", "endpoints": [servers[0].url]})
    assert torch.allclose(mix.score(_batch()).scores, 2 * _expected())


def test_fails_over_when_a_server_stops(serve):
    first, second = MeanReward(), MeanReward()
    servers = [serve({"mean": first}), serve({"mean": second})]
    client = RemoteReward("mean", endpoints=[s.url for s in servers], batch_size=2, **FAST)
    client.score(_batch())  # both endpoints are now known healthy
    servers[0].stop()
    before = len(second.calls)
    assert torch.allclose(client.score(_batch()).scores, _expected())
    stats = client.stats()
    assert stats["connection_errors"] >= 1 and stats["failovers"] >= 1 and stats["retries"] >= 1
    assert stats["endpoints"][servers[0].url]["healthy"] is False
    assert len(second.calls) - before == 4  # every chunk ended up on the live server


def test_unknown_endpoint_is_health_checked_before_use(serve):
    server = serve({"mean": MeanReward()})
    client = RemoteReward("mean", endpoints=[_dead_url(), server.url], batch_size=4, **FAST)
    assert torch.allclose(client.score(_batch()).scores, _expected())
    stats = client.stats()
    assert stats["health_failures"] >= 1 and stats.get("connection_errors", 0) == 0


def test_retries_a_500(serve):
    reward = MeanReward(fail_first=1)
    server = serve({"mean": reward})
    client = RemoteReward("mean", endpoints=[server.url], batch_size=8, **FAST)
    assert torch.allclose(client.score(_batch()).scores, _expected())
    stats = client.stats()
    assert stats["http_5xx"] == 1 and stats["retries"] == 1 and stats["ok"] == 1


def test_4xx_is_raised_at_once(serve):
    server = serve({"mean": MeanReward()})
    client = RemoteReward("missing", endpoints=[server.url], on_failure="nan", **FAST)
    with pytest.raises(RequestRefusedError, match="unknown reward 'missing'"):  # even with on_failure="nan"
        client.score(_batch())
    assert client.stats()["http_4xx"] == 1 and client.stats().get("retries", 0) == 0


def test_all_dead_raises_or_gives_counted_nan():
    urls = [_dead_url(), _dead_url()]
    client = RemoteReward("mean", endpoints=urls, batch_size=4, retries=2, **FAST)
    with pytest.raises(RemoteRewardError, match="no score after 3 attempts"):
        client.score(_batch())
    lenient = RemoteReward("mean", endpoints=urls, batch_size=4, retries=1, on_failure="nan", **FAST)
    result = lenient.score(_batch())
    assert torch.isnan(result.scores).all()
    stats = lenient.stats()
    assert stats["nan_samples"] == 8 and stats["failed_samples"] == 8 and stats["health_failures"] >= 2
    with pytest.raises(UserError, match="on_failure"):
        RemoteReward("mean", endpoints=urls, on_failure="zero")


def test_timeout_is_counted(serve):
    server = serve({"mean": MeanReward(sleep_s=0.5)})
    client = RemoteReward("mean", endpoints=[server.url], timeout_s=0.1, retries=0, on_failure="nan", **FAST)
    assert torch.isnan(client.score(_batch([0.5])).scores).all()
    assert client.stats()["timeouts"] == 1 and client.stats()["nan_samples"] == 1


def _json(body: bytes, _ctype: str) -> dict:
    return json.loads(body)


def test_connections_are_kept_alive():
    peers: list[int] = []

    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"n": len(peers)})

    app = web.Application()
    app.router.add_get("/healthz", echo)
    app.router.add_post("/echo", echo)
    with BackgroundServer(app) as server:
        pool = EndpointPool([server.url], backoff_s=0.01)
        for _ in range(6):
            pool.request("/echo", b"{}", {"Content-Type": "application/json"}, _json)
        pool.close()
    assert len(peers) == 7 and len(set(peers)) == 1  # probe + 6 requests on one connection
    assert pool.stats()["ok"] == 6 and pool.stats().get("failures", 0) == 0


class _ClosesIdle(http.server.BaseHTTPRequestHandler):
    """Answers keep-alive style (HTTP/1.1, no ``Connection: close``), then closes the socket anyway."""

    protocol_version = "HTTP/1.1"
    connections: list[int] = []

    def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
        self.do_POST()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True  # like a server whose keep-alive timeout expired

    def setup(self) -> None:
        super().setup()
        self.connections.append(self.client_address[1])

    def log_message(self, *args: object) -> None:
        pass


def test_a_keep_alive_connection_closed_by_the_server_is_replaced_transparently():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ClosesIdle)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        pool = EndpointPool([f"http://127.0.0.1:{server.server_port}"], retries=0, health_path=None)
        for _ in range(3):
            assert pool.request("/x", b"{}", {}, _json) == {"ok": True}
    finally:
        server.shutdown()
        server.server_close()
    stats = pool.stats()
    assert stats["ok"] == 3 and stats.get("failures", 0) == 0 and stats.get("retries", 0) == 0
    assert len(_ClosesIdle.connections) == 3


def test_a_frozen_endpoint_cools_down_after_a_timeout(serve):
    """An endpoint that accepts connections but never answers is skipped once it timed out, like a refused
    one, and its cool-down doubles while it keeps failing (no health path here: nothing else notices)."""
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(64)  # the kernel completes the handshakes; nobody ever reads or answers
    frozen_url = f"http://127.0.0.1:{frozen.getsockname()[1]}"
    server = serve({"mean": MeanReward()})
    timeout_s, cooldown_s = 1.5, 2.0
    pool = EndpointPool(
        [frozen_url, server.url],
        timeout_s=timeout_s,
        retries=1,
        backoff_s=0.0,
        health_path=None,
        health_interval_s=cooldown_s,
    )
    body = json.dumps({"reward": "mean", "images": [], "prompts": []}).encode()

    def call() -> float:
        began = time.monotonic()
        assert pool.request("/v1/score", body, {"Content-Type": "application/json"}, _json)["scores"] == []
        return time.monotonic() - began

    try:
        assert call() >= timeout_s  # the frozen endpoint comes first, times out, the retry fails over
        assert call() < timeout_s / 2  # in cool-down: straight to the healthy endpoint
        assert pool.stats()["timeouts"] == 1 and pool.stats()["endpoints"][frozen_url]["healthy"] is False
        time.sleep(cooldown_s)
        assert call() >= timeout_s  # the cool-down is over: tried once more, times out again
        time.sleep(cooldown_s)
        assert call() < timeout_s / 2  # the second cool-down lasts twice as long
        assert pool.stats()["timeouts"] == 2
    finally:
        pool.close()
        frozen.close()


def test_a_retry_reaches_a_server_that_comes_back_during_the_retries():
    """The only endpoint is down at the first attempt (cool-down 60 s) and up 0.3 s later: the retries
    probe it early instead of finding "no healthy endpoint" until the cool-down ends."""
    url = _dead_url()
    server = BackgroundServer(
        build_app({"mean": MeanReward()}, ServerSettings(max_wait_ms=0)), port=int(url.rsplit(":", 1)[1])
    )
    starter = threading.Timer(0.3, server.start)
    starter.start()
    client = RemoteReward("mean", endpoints=url, retries=3, backoff_s=0.5, health_interval_s=60.0)
    try:
        began = time.monotonic()
        assert torch.allclose(client.score(_batch([0.5])).scores, _expected([0.5]))
        assert time.monotonic() - began < 10
    finally:
        starter.join()
        server.stop()
    stats = client.stats()
    assert stats["health_failures"] >= 1 and stats["early_probes"] >= 1 and stats["ok"] == 1


@contextlib.contextmanager
def _raw_server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A loopback server that reads each request head and lets ``answer`` write whatever it likes."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def handle(conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            with contextlib.suppress(OSError):  # the client hung up: what this test wants
                answer(conn)

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                threading.Thread(target=handle, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


def _trickle(conn: socket.socket) -> None:
    """A valid reply, one byte every 0.1 s: each read waits well within the timeout, the whole does not."""
    body = b'{"scores": [0.5]}'
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    for byte in reply + body:
        conn.sendall(bytes([byte]))
        time.sleep(0.1)


def test_timeout_s_bounds_the_whole_attempt_not_each_read():
    with _raw_server(_trickle) as url:
        pool = EndpointPool([url], timeout_s=0.5, retries=0, health_path=None)
        began = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"timeouts: no complete reply within timeout_s=0.5 s"):
            pool.request("/v1/score", b"{}", {}, _json)
        assert time.monotonic() - began < 2.5  # the trickle takes ≈ 9 s
    assert pool.stats()["timeouts"] == 1


def _declares_a_gigabyte(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{")


def _endless_chunks(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(100_000):  # ≈ 26 MB unless the client stops reading
        conn.sendall(b"100\r\n" + b" " * 256 + b"\r\n")


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (_declares_a_gigabyte, "the reply declares 1000000000 bytes, above the client's cap of 4096 bytes"),
        (_endless_chunks, "the reply goes on past the client's cap of 4096 bytes"),
    ],
)
def test_a_reply_above_the_cap_is_refused_as_a_bad_reply(answer, message):
    with _raw_server(answer) as url:
        pool = EndpointPool([url], retries=0, health_path=None, max_reply_bytes=4096)
        with pytest.raises(RemoteRewardError, match=f"bad_replies: {message}.*not a reward server"):
            pool.request("/v1/score", b"{}", {}, _json)
    assert pool.stats()["bad_replies"] == 1


def test_a_408_is_retried_like_a_timeout_without_a_cool_down():
    """A server's 408 (it gave up waiting for the body: a slow link) is worth another attempt, not a
    refusal of the request."""
    calls: list[int] = []

    async def score(_request: web.Request) -> web.Response:
        calls.append(1)
        if len(calls) == 1:
            return web.json_response({"error": "the body did not arrive within 60 s"}, status=408)
        return web.json_response({"scores": [0.5], "details": {}})

    app = web.Application()
    app.router.add_post("/v1/score", score)
    with BackgroundServer(app) as server:
        pool = EndpointPool([server.url], retries=1, backoff_s=0.0, health_path=None, health_interval_s=60)
        assert pool.request("/v1/score", b"{}", {}, _json) == {"scores": [0.5], "details": {}}
    stats = pool.stats()
    assert stats["timeouts"] == 1 and stats["retries"] == 1 and stats.get("http_4xx", 0) == 0
    assert stats["endpoints"][server.url]["healthy"] is True  # no cool-down: the retry went there at once
