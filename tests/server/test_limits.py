"""The cost of a request is bounded before it is paid: decoded pixels, parsed items, metadata nesting.

The budget test starts a real reward-server process on 127.0.0.1 (``python -m rlgen_cli.server.runner``,
what ``rlgen serve-reward`` runs) with the default limits and sends requests engineered to cost far more
once decoded than their bodies: each must be refused with 413 naming the limit, within ``REFUSE_MS``, with
the server's peak RSS growing by less than ``RSS_BOUND_MB``, while ``/healthz`` keeps answering. The other
tests check each limit and its boundary on an in-process server.
"""

from __future__ import annotations

import base64
import functools
import http.client as httpclient
import io
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from PIL import Image

from rlgen_cli.errors import UserError
from rlgen_cli.server.app import ServerSettings
from tests.server.helpers import MeanReward, http

REFUSE_MS = 2000  # M: every engineered request is answered 413 within this many milliseconds
RSS_BOUND_MB = 64  # the server's peak RSS grows by less than this while refusing one (measured ≤ 10)
# /healthz answers within this (plus its worst on the idle server) while an engineered request is handled (≤ 24)
HEALTHZ_MS = 100
STARTUP_S = 90  # a fresh interpreter importing torch on a loaded 2-core machine
MIB = 1024 * 1024


# ------------------------------------------------------------------------------ engineered requests
@functools.cache
def _zero_png(side: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side)).save(buffer, format="PNG")
    return buffer.getvalue()


def _png_flood(as_json: bool) -> tuple[bytes, str, float]:
    """48 all-zero 4096² RGB PNGs: ≈ 2.3 MiB of body (3.1 MiB as base64 JSON) that decode to 2.4 GB."""
    png, n = _zero_png(4096), 48
    payload = {"reward": "brightness", "prompts": ["p"] * n}
    if as_json:
        images = [base64.b64encode(png).decode("ascii")] * n
        return json.dumps(payload | {"images": images}).encode(), "application/json", n * 3 * 4096**2 / 1e9
    body = msgpack.packb(payload | {"images": [png] * n}, use_bin_type=True)
    return body, "application/msgpack", n * 3 * 4096**2 / 1e9


def _map_flood_msgpack() -> tuple[bytes, str, float]:
    """A 16 MiB msgpack body whose ``metadata`` is 16 M empty maps (1 byte each, ≈ 72 bytes as dicts)."""
    n = 16 * MIB
    head = msgpack.packb({"reward": "brightness", "images": [], "prompts": []}, use_bin_type=True)
    body = b"\x84" + head[1:] + msgpack.packb("metadata") + b"\xdd" + struct.pack(">I", n) + b"\x80" * n
    return body, "application/msgpack", n * 72 / 1e9


def _map_flood_msgpack_nested() -> tuple[bytes, str, float]:
    """The same 16 M empty maps as 64 lists of 256 Ki: no single list is above the item limit."""
    n_lists, per_list = 64, 256 * 1024
    head = msgpack.packb({"reward": "brightness", "images": [], "prompts": []}, use_bin_type=True)
    one = b"\xdd" + struct.pack(">I", per_list) + b"\x80" * per_list
    body = (
        b"\x84" + head[1:] + msgpack.packb("metadata") + b"\xdc" + struct.pack(">H", n_lists) + one * n_lists
    )
    return body, "application/msgpack", n_lists * per_list * 72 / 1e9


def _map_flood_json() -> tuple[bytes, str, float]:
    """A 15 MiB JSON body whose ``metadata`` is 5 M empty objects (3 bytes each, ≈ 72 bytes as dicts)."""
    n = 5 * MIB
    body = b'{"reward": "brightness", "images": [], "prompts": [], "metadata": [' + b"{}," * (n - 1) + b"{}]}"
    return body, "application/json", n * 72 / 1e9


ENGINEERED = {
    "png_flood_msgpack": (lambda: _png_flood(False), "server.max_decoded_mb"),
    "png_flood_json": (lambda: _png_flood(True), "server.max_decoded_mb"),
    "map_flood_msgpack": (_map_flood_msgpack, "server.max_request_items"),
    "map_flood_msgpack_nested": (_map_flood_msgpack_nested, "server.max_request_items"),
    "map_flood_json": (_map_flood_json, "server.max_request_items"),
}


# ----------------------------------------------------------------------------------- measurement
def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class PeakRss:
    """Peak resident memory of process ``pid`` over a ``with`` block, relative to its start.

    Exact where the kernel lets us reset the high-water mark (``/proc/PID/clear_refs``), else sampled
    every millisecond.
    """

    def __init__(self, pid: int) -> None:
        self.pid, self.growth_mb = pid, 0.0
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        self.before = _status_kib(self.pid, "VmRSS")
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        except OSError:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._samples.append(_status_kib(self.pid, "VmRSS"))
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        if self._sampler is None:
            peak = _status_kib(self.pid, "VmHWM")
        else:
            self._stop.set()
            self._sampler.join()
            peak = max(self._samples, default=self.before)
        self.growth_mb = max(0, peak - self.before) / 1024


class HealthPoller:
    """Polls ``/healthz`` every 20 ms from a thread; ``worst_ms`` is the slowest answer seen."""

    def __init__(self, port: int) -> None:
        self.port, self.worst_ms, self.answers = port, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        conn = httpclient.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self._stop.is_set():
            began = time.perf_counter()
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            self.worst_ms = max(self.worst_ms, (time.perf_counter() - began) * 1000)
            self.answers += 1
            self._stop.wait(0.02)
        conn.close()

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def idle_healthz_worst_ms(port: int, seconds: float) -> float:
    """The slowest ``/healthz`` answer over ``seconds`` with no other request: the machine's own delay in
    scheduling the server and the poller (other processes, a second pytest worker), which a bound on the
    answers during a request adds to what that request may cost."""
    with HealthPoller(port) as idle:
        time.sleep(max(seconds, 0.2))
    return idle.worst_ms


def _post(port: int, body: bytes, ctype: str) -> tuple[int, dict]:
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/score", body=body, headers={"Content-Type": ctype})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, int]]:
    """A reward-server worker process with the default limits on a free loopback port."""
    port = _free_port()
    spec = tmp_path_factory.mktemp("limits") / "worker.json"
    settings = {"port": port, "max_wait_ms": 0, "shutdown_timeout_s": 1}
    spec.write_text(json.dumps({"rewards": {"brightness": {}}, "settings": settings, "log_level": "WARNING"}))
    proc = subprocess.Popen([sys.executable, "-m", "rlgen_cli.server.runner", str(spec)])
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                if http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"server did not start within {STARTUP_S} s"
            time.sleep(0.1)
        yield proc, port
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.parametrize("case", list(ENGINEERED))
def test_a_request_engineered_to_decode_to_gigabytes_is_refused_fast_with_bounded_memory(
    server_process, case
):
    proc, port = server_process
    build, limit_key = ENGINEERED[case]
    body, ctype, decoded_gb = build()
    assert decoded_gb * 1e9 > 20 * len(body)  # N: 2.4 GB (PNGs), 1.2 GB (msgpack maps), 0.38 GB (JSON)
    with HealthPoller(port) as health, PeakRss(proc.pid) as rss:
        began = time.perf_counter()
        status, reply = _post(port, body, ctype)
        elapsed_ms = (time.perf_counter() - began) * 1000
        time.sleep(0.1)  # let the poller see the server after the refusal too
    print(
        f"\n{case}: body {len(body) / MIB:.1f} MiB, decodes to {decoded_gb:.1f} GB; answered {status} in "
        f"{elapsed_ms:.0f} ms; server peak RSS +{rss.growth_mb:.0f} MB; /healthz worst {health.worst_ms:.0f} ms "
        f"over {health.answers} answers"
    )
    assert status == 413 and limit_key in reply["error"], reply
    assert elapsed_ms < REFUSE_MS
    assert rss.growth_mb < RSS_BOUND_MB
    assert health.answers >= 1 and health.worst_ms < HEALTHZ_MS + idle_healthz_worst_ms(
        port, elapsed_ms / 1000
    )
    assert proc.poll() is None and http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200


# ------------------------------------------------------------------------- each limit, in-process
def _png(side: int, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (side, side)).save(buffer, format="PNG")
    return buffer.getvalue()


def _raw(channels: int, side: int) -> dict:
    return {"shape": [channels, side, side], "dtype": "uint8", "data": bytes(channels * side * side)}


def _msgpack(server, payload: dict) -> tuple[int, dict]:
    """POST ``payload`` as msgpack; the reply decoded (msgpack scores or a JSON error)."""
    conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        body = msgpack.packb(payload, use_bin_type=True)
        conn.request("POST", "/v1/score", body=body, headers={"Content-Type": "application/msgpack"})
        response = conn.getresponse()
        data, ctype = response.read(), response.getheader("Content-Type", "")
    finally:
        conn.close()
    return response.status, json.loads(data) if ctype.startswith("application/json") else msgpack.unpackb(
        data
    )


def test_decoded_size_is_summed_over_every_image_from_headers_and_shapes(serve):
    budget = 3 * 16 * 16 + 1 * 16 * 16  # bytes: one RGB and one grey 16² image fit exactly
    server = serve({"mean": MeanReward()}, max_decoded_mb=budget / MIB)
    fits = [[_png(16), _png(16, "L")], [_raw(3, 16), _raw(1, 16)], [_png(16), _raw(1, 16)]]
    for images in fits:
        status, reply = _msgpack(server, {"reward": "mean", "images": images, "prompts": ["p"] * 2})
        assert status == 200, reply
    over = [[_png(16), _png(16, "LA")], [_raw(3, 16), _raw(2, 16)], [_png(16), _png(16, "L"), _raw(1, 1)]]
    for images in over:
        status, reply = _msgpack(server, {"reward": "mean", "images": images, "prompts": ["p"] * len(images)})
        assert status == 413 and "server.max_decoded_mb" in reply["error"], reply
    b64 = [base64.b64encode(_png(16)).decode()] * 2
    status, reply = http(
        "POST", server.url + "/v1/score", {"reward": "mean", "images": b64, "prompts": ["a", "b"]}
    )
    assert status == 413 and "1536 bytes" in reply["error"], reply  # 2 × 3·16·16


def test_items_are_counted_while_parsing_and_text_inside_strings_is_not(serve):
    server = serve({"mean": MeanReward()}, max_request_items=120)
    meta = [{"k": list(range(10))} for _ in range(4)]  # 104 items in msgpack (each container + its length)
    ok = {"reward": "mean", "images": [_raw(1, 2)] * 4, "prompts": ["a, [b], {c}" * 50] * 4, "metadata": meta}
    status, reply = _msgpack(server, ok)
    assert status == 200, reply
    b64 = base64.b64encode(_png(2)).decode()
    status, reply = http("POST", server.url + "/v1/score", ok | {"images": [b64] * 4})
    assert status == 200, reply  # 600 commas and brackets inside the prompts are text, not items
    many = ok | {"metadata": [{"k": list(range(30))} for _ in range(4)]}
    status, reply = _msgpack(server, many)
    assert status == 413 and "server.max_request_items=120" in reply["error"], reply
    status, reply = http("POST", server.url + "/v1/score", many | {"images": [b64] * 4})
    assert status == 413 and "server.max_request_items=120" in reply["error"], reply


def test_metadata_nesting_is_limited(serve):
    server = serve({"mean": MeanReward()}, max_metadata_depth=4)

    def nested(depth: int) -> dict:  # ``depth`` dicts, each inside the previous one
        value: object = 1
        for _ in range(depth):
            value = {"a": value}
        return value

    for depth, status_expected in ((4, 200), (5, 413)):
        payload = {"reward": "mean", "images": [_raw(1, 2)], "prompts": ["p"], "metadata": [nested(depth)]}
        status, reply = _msgpack(server, payload)
        assert status == status_expected, (depth, reply)
    assert "server.max_metadata_depth=4" in reply["error"]


def test_new_limits_are_range_checked():
    for key in ("max_decoded_mb", "max_request_items", "max_metadata_depth", "max_image_side"):
        with pytest.raises(UserError, match=f"server.{key}"):
            ServerSettings(**{key: 0})
