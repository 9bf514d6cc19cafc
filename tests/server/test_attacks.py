"""Attacks on a real reward-server process: each request's cost is bounded before it is paid.

A worker process (``python -m rlgen_cli.server.runner``, what ``rlgen serve-reward`` runs) on 127.0.0.1
gets requests that are cheap to send and were expensive to handle: a JSON body of millions of empty
strings (the item count used to run a regex over every string), and small PNGs followed by floods of
empty private or ``tEXt`` chunks (Pillow walked them all in Python and kept them). Each must be refused
with 413 naming its cap while the server's peak RSS grows by at most ``RSS_BOUND_MB`` and ``/healthz``
answers within ``HEALTHZ_MS`` of its idle worst throughout (measured as in ``test_limits.py``), at every
body size: each is refused while it arrives. The default versions use bodies of a few MiB; the full-size
ones (60 MiB bodies) are ``slow``.
"""

from __future__ import annotations

import http.client as httpclient
import io
import json
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator

import msgpack
import pytest
from PIL import Image

from tests.server.helpers import http
from tests.server.test_limits import STARTUP_S, HealthPoller, PeakRss, _free_port, idle_healthz_worst_ms

MIB = 1024 * 1024
RSS_BOUND_MB = 64
HEALTHZ_MS = 100


def start_worker(
    tmp_path, settings: dict, log_level: str = "WARNING"
) -> tuple[subprocess.Popen, int, object]:
    """A reward-server worker process hosting ``brightness``; returns it, its port and its log path."""
    port = _free_port()
    spec = tmp_path / f"worker{port}.json"
    settings = {"port": port, "max_wait_ms": 0, "shutdown_timeout_s": 1} | settings
    spec.write_text(json.dumps({"rewards": {"brightness": {}}, "settings": settings, "log_level": log_level}))
    log = tmp_path / f"worker{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlgen_cli.server.runner", str(spec)], stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200:
                return proc, port, log
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, int]]:
    """A worker with the default limits."""
    proc, port, _ = start_worker(tmp_path_factory.mktemp("attacks"), {})
    try:
        yield proc, port
    finally:
        proc.kill()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------------ attack bodies
def _empty_strings(body_mb: float) -> bytes:
    """``{"reward": ..., "images": [], "prompts": ["", "", ...]}`` of about ``body_mb`` MiB."""
    n = int(body_mb * MIB) // 3
    return b'{"reward": "brightness", "images": [], "prompts": [' + b'"",' * n + b'""]}'


def _chunk(kind: bytes, data: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def _flooded_png(extra: Iterator[bytes]) -> bytes:
    """A valid 16×16 PNG with the chunks ``extra`` after its image data, before IEND."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 90, 90)).save(buffer, format="PNG")
    png = buffer.getvalue()
    assert png.endswith(_chunk(b"IEND"))
    return png[: -len(_chunk(b"IEND"))] + b"".join(extra) + _chunk(b"IEND")


def _private_chunk_flood(body_mb: float) -> bytes:
    """Empty private ancillary chunks (``prIv``, 12 bytes each) after the image data."""
    one = _chunk(b"prIv")
    return _flooded_png(one for _ in range(int(body_mb * MIB) // len(one)))


def _text_key_flood(body_mb: float) -> bytes:
    """``tEXt`` chunks with distinct keys and empty values (Pillow's text limit counts only values)."""
    n = int(body_mb * MIB) // 22
    return _flooded_png(_chunk(b"tEXt", b"k%09d\0" % i) for i in range(n))


def _png_request(png: bytes) -> tuple[bytes, str]:
    payload = {"reward": "brightness", "images": [png], "prompts": ["p"]}
    return msgpack.packb(payload, use_bin_type=True), "application/msgpack"


def _post(port: int, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST /v1/score; the reply decoded (JSON error or msgpack scores)."""
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/score", body=body, headers={"Content-Type": ctype} | (headers or {}))
        response = conn.getresponse()
        data, reply_type = response.read(), response.getheader("Content-Type", "")
    finally:
        conn.close()
    return response.status, msgpack.unpackb(data) if "msgpack" in reply_type else json.loads(data)


ATTACKS = {
    "json_empty_strings": (lambda mb: (_empty_strings(mb), "application/json"), "server.max_request_items"),
    "png_private_chunks": (lambda mb: _png_request(_private_chunk_flood(mb)), "MAX_IMAGE_CHUNKS"),
    "png_text_keys": (lambda mb: _png_request(_text_key_flood(mb)), "MAX_TEXT_BYTES"),
}


def _attack(
    worker: tuple[subprocess.Popen, int], case: str, body_mb: float, rss_bound_mb: float, healthz_ms: float
) -> None:
    proc, port = worker
    build, cap = ATTACKS[case]
    body, ctype = build(body_mb)
    with HealthPoller(port) as health, PeakRss(proc.pid) as rss:
        began = time.perf_counter()
        status, reply = _post(port, body, ctype)
        elapsed_ms = (time.perf_counter() - began) * 1000
        time.sleep(0.1)  # the poller sees the server after the refusal too
    print(
        f"\n{case}: body {len(body) / MIB:.1f} MiB answered {status} in {elapsed_ms:.0f} ms; peak RSS "
        f"+{rss.growth_mb:.1f} MB; /healthz worst {health.worst_ms:.0f} ms over {health.answers} answers"
    )
    assert status == 413 and cap in reply["error"], reply
    assert rss.growth_mb <= rss_bound_mb
    assert health.answers >= 1 and health.worst_ms <= healthz_ms + idle_healthz_worst_ms(
        port, elapsed_ms / 1000
    )
    assert proc.poll() is None and http("GET", f"http://127.0.0.1:{port}/healthz")[0] == 200


@pytest.mark.parametrize("case", list(ATTACKS))
def test_an_attack_body_is_refused_naming_its_cap_with_bounded_memory_and_a_live_healthz(worker, case):
    _attack(worker, case, body_mb=6, rss_bound_mb=RSS_BOUND_MB, healthz_ms=HEALTHZ_MS)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ATTACKS))
def test_full_size_attack_bodies_are_refused_with_bounded_memory(worker, case):
    # Every body is refused while it arrives: the JSON item counter and the msgpack scanner (items, and
    # the chunk headers of each PNG/JPEG file) stop at the cap, so neither the rest of the body nor a
    # parsed copy of it is ever held (before the scanner: +121 / +125 MB, /healthz up to 189 ms).
    body_mb = 62 if case.startswith("json") else 60
    _attack(worker, case, body_mb=body_mb, rss_bound_mb=RSS_BOUND_MB, healthz_ms=HEALTHZ_MS)
