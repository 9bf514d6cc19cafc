"""Client mistakes get a 4xx that names them, never a 500 (which the client would retry), and only PNG,
JPEG and raw pixels are decoded: every other image format Pillow knows is refused before Pillow opens it."""

from __future__ import annotations

import base64
import gzip
import http.client as httpclient
import io
import json
import logging
import socket
import struct
import time
import zlib

import msgpack
import numpy as np
import pytest
from PIL import EpsImagePlugin, Image

from rlgen_cli.rewards import build_reward
from tests.server.helpers import MeanReward, http, metric

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/score", body=body, headers=headers)
        response = conn.getresponse()
        data, ctype = response.read(), response.getheader("Content-Type", "")
    finally:
        conn.close()
    return response.status, json.loads(data) if ctype.startswith("application/json") else msgpack.unpackb(
        data
    )


def _score_files(port: int, files: list[bytes], reward: str = "mean") -> tuple[int, dict]:
    payload = {"reward": reward, "images": files, "prompts": ["p"] * len(files)}
    return _post(
        port, msgpack.packb(payload, use_bin_type=True), {"Content-Type": "application/msgpack"} | AUTH
    )


# ------------------------------------------------------------------------------------- formats
OTHER_FORMATS = ["BMP", "GIF", "TIFF", "WEBP", "ICO", "PPM", "TGA", "PCX", "SGI", "IM", "DDS", "QOI", "EPS",
                 "JPEG2000", "MSP", "XBM", "SPIDER", "PDF", "ICNS"]  # fmt: skip


def _other_format(fmt: str) -> bytes:
    rgb = Image.new("RGB", (8, 8), (10, 200, 30))
    image = rgb.convert("1") if fmt in ("MSP", "XBM") else rgb.convert("L") if fmt == "SPIDER" else rgb
    return _encoded(image, fmt)


def test_only_png_jpeg_and_raw_pixels_are_decoded(serve, monkeypatch):
    ghostscript_calls: list[object] = []
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", lambda *a, **k: ghostscript_calls.append(a))
    opened: list[object] = []
    real_open = Image.open

    def spy_open(fp, mode="r", formats=None):
        opened.append(formats)
        return real_open(fp, mode, formats)

    monkeypatch.setattr(Image, "open", spy_open)
    reward = MeanReward()
    server = serve({"mean": reward}, token=TOKEN)
    for fmt in OTHER_FORMATS:
        status, reply = _score_files(server.port, [_other_format(fmt)])
        assert status == 415 and "only PNG and JPEG" in reply["error"], (fmt, status, reply)
        payload = {
            "reward": "mean",
            "images": [base64.b64encode(_other_format(fmt)).decode()],
            "prompts": ["p"],
        }
        status, reply = http("POST", server.url + "/v1/score", payload, AUTH)
        assert status == 415 and "images[0]" in reply["error"], (fmt, reply)
    assert "EPS (PostScript)" in _score_files(server.port, [_other_format("EPS")])[1]["error"]
    assert ghostscript_calls == [] and reward.calls == []
    assert all(formats is not None and set(formats) <= {"PNG", "JPEG"} for formats in opened), opened
    # PNG and JPEG still decode, each to the channels it carries (palette → RGB, 1-bit → grey)
    grey = Image.new("L", (4, 4), 51)  # 51 / 255 = 0.2
    files = {
        _encoded(grey, "PNG"): 0.2,
        _encoded(grey.convert("LA"), "PNG"): 0.6,  # (0.2 + 1.0) / 2: the alpha channel is kept
        _encoded(grey.convert("RGB"), "JPEG"): 0.2,
        _encoded(grey.convert("RGBA"), "PNG"): 0.4,
        _encoded(grey.convert("P"), "PNG"): 0.2,
        _encoded(Image.new("1", (4, 4), 1), "PNG"): 1.0,
    }
    status, reply = _score_files(server.port, list(files))
    assert status == 200, reply
    assert reply["scores"] == pytest.approx(list(files.values()), abs=0.005)
    sixteen_bit = _encoded(Image.fromarray(np.full((4, 4), 1000, dtype=np.uint16)), "PNG")
    status, reply = _score_files(server.port, [sixteen_bit])
    assert status == 200 and reply["scores"] == pytest.approx([(1000 >> 8) / 255]), reply  # its high byte


# ---------------------------------------------------------------------------- client mistakes
def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose IHDR (with a valid CRC) claims ``width × height``; the pixel data stays 8×8."""
    png = bytearray(_encoded(Image.new("RGB", (8, 8)), "PNG"))
    ihdr = png[12:29]
    ihdr[4:12] = struct.pack(">II", width, height)
    png[12:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(png)


def _raw_socket(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        return sock.recv(65536)


_JSON = {"Content-Type": "application/json"} | AUTH
_GZIP = _JSON | {"Content-Encoding": "gzip"}
_WIDE_RAW = {"shape": [1, 1, 70_000], "dtype": "uint8", "data": bytes(70_000)}


def _wide_png() -> bytes:  # 70 000 pixels, far below the pixel limit, one side above JPEG's
    return _encoded(Image.new("L", (70_000, 1)), "PNG")


MISTAKES = {  # name: (send(port) -> (status, reply), expected status, a fragment of the error)
    "side_above_65500_png": (lambda port: _score_files(port, [_wide_png()], "jpeg"), 413, "server.max_image_side=65500"),
    "side_above_65500_raw": (lambda port: _score_files(port, [_WIDE_RAW], "jpeg"), 413, "server.max_image_side=65500"),
    "png_header_above_pillows_bomb_limit": (
        lambda port: _score_files(port, [_png_claiming(100_000, 100_000)], "jpeg"), 413, "server.max_image_pixels="
    ),
    "reward_of_the_wrong_type": (
        lambda port: _post(port, json.dumps({"reward": 3, "images": [], "prompts": []}).encode(), _JSON),
        400,
        "field 'reward' must be a string (a hosted reward's name), got int",
    ),
    "unknown_fields_kwargs_and_misspelt_metadata": (
        lambda port: _post(port, json.dumps({"reward": "jpeg", "images": [], "prompts": [], "kwargs": {"quality": 5},
                                             "metdata": []}).encode(), _JSON),
        400,
        "unknown fields ['kwargs', 'metdata'] (did you mean 'metdata' → 'metadata'?); a score request has only "
        "reward, images, prompts, metadata (metadata optional); reward settings live on the server",
    ),
    "unknown_field_in_msgpack": (
        lambda port: _post(port, msgpack.packb({"reward": "jpeg", "images": [], "prompts": [], "image": b""}),
                           {"Content-Type": "application/msgpack"} | AUTH),
        400,
        "unknown fields ['image'] (did you mean 'image' → 'images'?); a score request has only reward,",
    ),
    "gzip_content_encoding_with_garbage": (
        lambda port: _post(port, b"this is not gzip" * 8, _GZIP), 400, "(Content-Encoding: gzip)"
    ),
    "non_ascii_authorization": (
        lambda port: _raw_exchange(port, b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                   b"Authorization: Bearer s3cr\xc3\xa9t\xff\r\n\r\n{}"),
        403,
        "wrong bearer token",
    ),
}  # fmt: skip


def _raw_exchange(port: int, request: bytes) -> tuple[int, dict]:
    """Send raw request bytes (headers no client library would encode) and parse the JSON reply."""
    reply = _raw_socket(port, request)
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_client_mistakes_are_4xx_naming_the_problem(serve, caplog, mistake):
    caplog.set_level(logging.WARNING)
    server = serve({"jpeg": build_reward("jpeg_compressibility")}, token=TOKEN)
    send, expected, fragment = MISTAKES[mistake]
    status, reply = send(server.port)
    assert (status, fragment in reply.get("error", "")) == (expected, True), reply
    status, text = http("GET", server.url + "/metrics", headers=AUTH)
    assert metric(text, 'rlgen_errors_total{kind="internal"}') == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    if mistake.startswith("gzip"):  # a well-formed gzip body is read as usual
        body = gzip.compress(json.dumps({"reward": "jpeg", "images": [], "prompts": []}).encode())
        assert _post(server.port, body, _GZIP) == (200, {"scores": [], "details": {}})


def test_a_size_above_pillows_bomb_limit_is_413_even_when_the_server_limits_allow_it(serve):
    server = serve({"mean": MeanReward()}, token=TOKEN, max_image_pixels=10**9, max_decoded_mb=10**4)
    status, reply = _score_files(server.port, [_png_claiming(30_000, 30_000)])  # 9·10⁸ > Pillow's 1.8·10⁸
    assert status == 413 and "decompression-bomb limit" in reply["error"], reply


def test_a_client_that_disconnects_mid_body_is_logged_as_a_disconnect(serve, caplog):
    server = serve({"mean": MeanReward()})
    caplog.set_level(logging.INFO, logger="rlgen_cli.server")
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"reward": "mean", "ima'
            )
            time.sleep(0.1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = http("GET", server.url + "/metrics")[1]
        if metric(text, 'rlgen_errors_total{kind="disconnect"}') == 3:
            break
        time.sleep(0.05)
    assert metric(text, 'rlgen_errors_total{kind="disconnect"}') == 3
    assert metric(text, 'rlgen_errors_total{kind="internal"}') == 0
    server_records = [r for r in caplog.records if r.name.startswith("rlgen_cli.server")]
    disconnects = [r for r in server_records if "disconnected" in r.getMessage()]
    assert len(disconnects) == 3 and all(r.levelno == logging.INFO for r in disconnects)
    assert all(r.exc_info is None and r.levelno < logging.WARNING for r in server_records)
    assert http("GET", server.url + "/healthz")[0] == 200
