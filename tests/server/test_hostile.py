"""Hostile and malformed requests against a real loopback reward server.

Several hundred generated requests (bad JSON, wrong types, huge bodies, bad base64, undecodable or oversized
images, malformed raw-pixel entries — wrong shape, dtype or byte count, above the pixel limit —, wrong
lengths, unknown rewards, bad auth, wrong content types and methods, deeply nested JSON) must
each get a 4xx JSON ``{"error": ...}``; afterwards the server is healthy, has logged no internal error, and
still scores a valid request correctly. Malformed HTTP (below the application) is checked separately: the
server answers or closes, and stays healthy.
"""

from __future__ import annotations

import base64
import http.client as httpclient
import io
import json
import random
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import pytest
from PIL import Image

from rlgen_cli.server.app import ServerSettings, build_app
from rlgen_cli.server.runner import BackgroundServer
from tests.server.helpers import MeanReward, constant_images, http, metric

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"Content-Type": "application/json"} | AUTH
MAX_MB = 1.0
MAX_PIXELS = 64 * 64


@dataclass
class Case:
    """One hostile request and the 4xx statuses it may get."""

    name: str
    body: bytes | None
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    method: str = "POST"
    path: str = "/v1/score"
    statuses: tuple[int, ...] = (400,)
    chunked: bool = False


# ------------------------------------------------------------------------------------------ payloads
def _png(size: int = 8, value: int = 128) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (value, value, value)).save(buffer, format="PNG")
    return buffer.getvalue()


def _jpeg(size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (10, 200, 30)).save(buffer, format="JPEG")
    return buffer.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose IHDR (with a valid CRC) claims ``width × height``; the pixel data stays 8×8."""
    png = bytearray(_png())
    ihdr = png[12:29]  # b"IHDR" + 13 bytes of header data
    ihdr[4:12] = struct.pack(">II", width, height)
    png[12:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(png)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _valid(n: int = 1) -> dict:
    return {"reward": "mean", "images": [_b64(_png())] * n, "prompts": ["p"] * n}


def _body(payload: object) -> bytes:
    return json.dumps(payload).encode()


def _with(**fields: object) -> bytes:
    payload = _valid()
    for key, value in fields.items():
        if value is _MISSING:
            payload.pop(key)
        else:
            payload[key] = value
    return _body(payload)


_MISSING = object()


# ------------------------------------------------------------------------------------------- cases
def _bad_json(rng: random.Random) -> Iterator[Case]:
    fixed = [b"", b"{", b"}", b"{]", b"nul", b"{'reward': 'mean'}", b'{"reward": "mean",}', b"\xff\xfe\x00",
             b"\x00" * 16, b"null", b"[]", b"42", b'"mean"', b"true", b"[{}]", b"{}", b'{"reward"}',
             b'{"reward": "mean" "images": []}', b"NaN", b'{"reward": NaN}', b"\xc3\x28", b" " * 64]  # fmt: skip
    for i, body in enumerate(fixed):
        yield Case(f"bad_json/{i}", body)
    valid = _body(_valid(2))
    for i, cut in enumerate(sorted(rng.sample(range(1, len(valid)), 30))):
        yield Case(f"truncated/{i}@{cut}", valid[:cut])
    for i in range(20):
        yield Case(f"random_bytes/{i}", rng.randbytes(rng.randint(1, 512)))


def _wrong_types() -> Iterator[Case]:
    scalars = [1, 1.5, True, "text", {}]
    bad = {
        "reward": [1, 1.5, True, None, [], {}, ["mean"], {"name": "mean"}, _MISSING],
        "images": [*scalars, None, _MISSING, [1], [None], [[]], [{}], [True], [1.5]],
        "prompts": [*scalars, None, _MISSING, [1], [None], [[]], [{}], [True]],
        "metadata": [1, 1.5, True, "text", {}, [1], ["x"], [None], [[]], [True]],
    }
    for key, values in bad.items():
        for i, value in enumerate(values):
            yield Case(f"wrong_type/{key}/{i}", _with(**{key: value}))


def _bad_base64() -> Iterator[Case]:
    png = _b64(_png())
    values = ["!!!", "abc", "a===", "====", "=", " ", "\n", png + "\n", " " + png, png[:-2], png[:-1] + "*",
              "ü" * 8, "data:image/png;base64," + png, png.replace("A", "-"), "\x00" * 8, "YWJj\x00"]  # fmt: skip
    for i, value in enumerate(values):
        yield Case(f"bad_base64/{i}", _with(images=[value]))


def _bad_images() -> Iterator[Case]:
    png, jpeg = _png(), _jpeg()
    undecodable = [b"", b"hello", b"\x89PNG\r\n\x1a\n", png[:20], png[:40], png[:-24],
                   png[:-30] + b"\x00" * 30, jpeg[:2], jpeg[:30], jpeg[: len(jpeg) // 2], b"GIF89a",
                   b"<svg xmlns='http://www.w3.org/2000/svg'/>", bytes(range(256)), b"\x00" * 1024]  # fmt: skip
    for i, data in enumerate(undecodable):  # 415 when it is not even PNG/JPEG, else 400
        yield Case(f"undecodable/{i}", _with(images=[_b64(data)]), statuses=(400, 415))
    yield Case(
        "undecodable/third_of_three",
        _with(images=[_b64(png), _b64(png), "AAAA"], prompts=["a"] * 3),
        statuses=(415,),
    )
    too_big = [_png(65), _png_claiming(MAX_PIXELS + 1, 1), _png_claiming(1, 10**7)]
    for i, data in enumerate(too_big):
        yield Case(f"too_many_pixels/{i}", _with(images=[_b64(data)]), statuses=(413,))
    # above Pillow's own decompression-bomb limit too: the header is read before Pillow sees the file
    bomb = _with(images=[_b64(_png_claiming(100_000, 100_000))])
    yield Case("too_many_pixels/bomb", bomb, statuses=(413,))


RAW_TYPE = {"Content-Type": "application/msgpack"} | AUTH


def _raw_entry(
    shape: object = (3, 8, 8), dtype: object = "uint8", data: object = None, **extra: object
) -> dict:
    """A raw-pixel ``images`` entry; ``data`` defaults to the right byte count for a valid ``shape``."""
    if data is None:
        data = bytes(128 for _ in range(3 * 8 * 8)) if shape == (3, 8, 8) else b""
    entry = {"shape": list(shape) if isinstance(shape, tuple) else shape, "dtype": dtype, "data": data}
    return entry | extra


def _packed(images: list, prompts: list | None = None, reward: str = "mean", **fields: object) -> bytes:
    payload = {
        "reward": reward,
        "images": images,
        "prompts": ["p"] * len(images) if prompts is None else prompts,
    }
    return msgpack.packb(payload | fields, use_bin_type=True)


def _bad_raw() -> Iterator[Case]:
    """Raw-pixel msgpack requests that break the format: each a 400, 413 or 404 naming the problem."""
    good, png = _raw_entry(), _png()
    not_maps = [1, 1.5, True, "text", None, [1, 2], [good]]
    for i, value in enumerate(not_maps):
        yield Case(f"raw/not_a_map/{i}", _packed([value]), dict(RAW_TYPE))
    keys = [{}, {k: v for k, v in good.items() if k != "shape"}, {k: v for k, v in good.items() if k != "dtype"},
            {k: v for k, v in good.items() if k != "data"}, good | {"layout": "CHW"}, good | {"shape ": [3, 8, 8]},
            {"Shape": [3, 8, 8], "dtype": "uint8", "data": good["data"]}]  # fmt: skip
    for i, entry in enumerate(keys):
        yield Case(f"raw/keys/{i}", _packed([entry]), dict(RAW_TYPE))
    byte_keys = msgpack.packb(
        {
            "reward": "mean",
            "images": [{b"shape": [3, 8, 8], b"dtype": b"uint8", b"data": good["data"]}],
            "prompts": ["p"],
        },
        use_bin_type=True,
    )
    yield Case("raw/keys/bytes", byte_keys, dict(RAW_TYPE))
    shapes = [[], [8, 8], [3, 8], [3, 8, 8, 1], [1, 3, 8, 8], "3x8x8", None, 192, {"c": 3}, [3, 8, -8], [3, 0, 8],
              [0, 8, 8], [3, 8.0, 8], [3, True, 8], [True, 8, 8], [3, "8", 8], [3, None, 8], [5, 8, 8], [6, 8, 8],
              [8, 8, 3], [-3, 8, 8], [3, [8], 8], [3, 2**63, -1]]  # fmt: skip
    for i, shape in enumerate(shapes):
        yield Case(f"raw/shape/{i}", _packed([_raw_entry(shape, data=good["data"])]), dict(RAW_TYPE))
    dtypes = ["float32", "float16", "int8", "uint16", "UINT8", "uint8 ", "|u1", "u1", "", None, 8, ["uint8"],
              b"uint8", {"name": "uint8"}, "bool", "object"]  # fmt: skip
    for i, dtype in enumerate(dtypes):
        yield Case(f"raw/dtype/{i}", _packed([_raw_entry(dtype=dtype)]), dict(RAW_TYPE))
    datas = ["A" * 192, 192, None, [0] * 192, {"bytes": 1}, True, 1.5]
    for i, data in enumerate(datas):
        entry = good | {"data": data}
        yield Case(f"raw/data_type/{i}", _packed([entry]), dict(RAW_TYPE))
    lengths = [((3, 8, 8), 191), ((3, 8, 8), 193), ((3, 8, 8), 0), ((3, 8, 8), 384), ((3, 8, 8), 64),
               ((1, 8, 8), 192), ((1, 8, 8), 63), ((3, 1, 1), 1), ((3, 64, 64), 3 * 64 * 64 - 1),
               ((1, 64, 64), 3 * 64 * 64), ((3, 16, 4), 3 * 4 * 16 + 3)]  # fmt: skip
    for i, (shape, n_bytes) in enumerate(lengths):
        entry = _raw_entry(shape, data=bytes(n_bytes))
        yield Case(f"raw/byte_count/{i}", _packed([entry]), dict(RAW_TYPE))
    too_big = [((3, 65, 65), 3 * 65 * 65), ((1, 1, MAX_PIXELS + 1), MAX_PIXELS + 1), ((3, 10**6, 10**6), 192),
               ((1, 2**40, 1), 0), ((3, 2**62, 2**62), 192), ((3, 1, 2**63), 0)]  # fmt: skip
    for i, (shape, n_bytes) in enumerate(too_big):
        entry = _raw_entry(shape, data=bytes(n_bytes))
        yield Case(f"raw/too_many_pixels/{i}", _packed([entry]), dict(RAW_TYPE), statuses=(413,))
    mixed = [[good, _raw_entry(data=bytes(191))], [png, _raw_entry(dtype="float32")], [good, png[:20]],
             [good, good, "AAAA"], [good, None], [png, good, {}]]  # fmt: skip
    for i, images in enumerate(mixed):
        yield Case(f"raw/mixed/{i}", _packed(images), dict(RAW_TYPE))
    for i, (n_img, n_prompt) in enumerate([(2, 1), (1, 2), (0, 1), (1, 0), (3, 5)]):
        yield Case(f"raw/lengths/{i}", _packed([good] * n_img, ["p"] * n_prompt), dict(RAW_TYPE))
    yield Case("raw/metadata_length", _packed([good], metadata=[{}, {}]), dict(RAW_TYPE))
    yield Case("raw/unknown_reward", _packed([good], reward="nope"), dict(RAW_TYPE), statuses=(404,))
    yield Case(
        "raw/in_json", _with(images=[{"shape": [3, 8, 8], "dtype": "uint8", "data": _b64(good["data"])}])
    )
    yield Case("raw/json_content_type", _packed([good]))
    yield Case("raw/no_auth", _packed([good]), {"Content-Type": "application/msgpack"}, statuses=(401,))
    limit = int(MAX_MB * 1024 * 1024)
    huge = _packed([_raw_entry((3, 600, 600), data=bytes(3 * 600 * 600))])
    assert len(huge) > limit
    yield Case("raw/huge_body", huge, dict(RAW_TYPE), statuses=(413,))
    yield Case("raw/huge_body_chunked", huge, dict(RAW_TYPE), statuses=(413,), chunked=True)
    yield Case("raw/nested_shape", _packed([_raw_entry([[[[3]]], 8, 8], data=good["data"])]), dict(RAW_TYPE))


def _wrong_lengths() -> Iterator[Case]:
    img = _b64(_png())
    shapes = [(2, 1, None), (1, 2, None), (0, 1, None), (1, 0, None), (3, 3, 2), (2, 2, 3), (1, 1, 0),
              (5, 4, None), (4, 5, 5), (0, 0, 1)]  # fmt: skip
    for n_img, n_prompt, n_meta in shapes:
        payload = {"reward": "mean", "images": [img] * n_img, "prompts": ["p"] * n_prompt}
        if n_meta is not None:
            payload["metadata"] = [{}] * n_meta
        yield Case(f"lengths/{n_img}-{n_prompt}-{n_meta}", _body(payload))


def _unknown_rewards() -> Iterator[Case]:
    names = ["", "MEAN", "mean ", " mean", "../mean", "mean\x00", "ümlaut", "x" * 10_000, "jpeg_compressibility",
             "%s%s%n", "<script>alert(1)</script>", "mean;DROP TABLE", "\ud800", "mean/..", "__proto__"]  # fmt: skip
    for i, name in enumerate(names):
        yield Case(f"unknown_reward/{i}", _with(reward=name), statuses=(404,))


def _bad_auth() -> Iterator[Case]:
    body = _body(_valid())
    plain = {"Content-Type": "application/json"}
    no_bearer = [None, "Basic dXNlcjpwYXNz", f"bearer {TOKEN}", f"Token {TOKEN}", TOKEN, "Bearer", ""]
    wrong = ["Bearer ", "Bearer wrong", f"Bearer {TOKEN}x", f"Bearer  {TOKEN}", f"Bearer {TOKEN.upper()}",
             f"Bearer {TOKEN[:-1]}", "Bearer " + "A" * 4000, f"Bearer {TOKEN}\tx"]  # fmt: skip
    for i, value in enumerate(no_bearer + wrong):
        headers = plain | ({} if value is None else {"Authorization": value})
        yield Case(f"auth/score/{i}", body, headers, statuses=(401, 403))
    for path in ("/v1/rewards", "/metrics", f"/v1/rewards?token={TOKEN}"):
        yield Case(f"auth/get{path}", None, {}, "GET", path, statuses=(401,))
        yield Case(
            f"auth/get_wrong{path}", None, {"Authorization": "Bearer no"}, "GET", path, statuses=(403,)
        )


def _wrong_content_types() -> Iterator[Case]:
    json_body, pack = _body(_valid()), msgpack.packb(_valid(), use_bin_type=True)
    str_images = msgpack.packb(_valid(), use_bin_type=True)  # base64 strings where msgpack wants bytes
    cases = [
        ("msgpack_type_json_body", "application/msgpack", json_body),
        ("json_type_msgpack_body", "application/json", pack),
        ("msgpack_str_images", "application/msgpack", str_images),
        ("msgpack_list", "application/msgpack", msgpack.packb([1, 2, 3])),
        ("msgpack_garbage", "application/msgpack", b"\xc1\xc1\xc1"),
        ("msgpack_truncated", "application/msgpack", pack[: len(pack) // 2]),
        ("text_plain_garbage", "text/plain", b"reward=mean"),
        ("form_urlencoded", "application/x-www-form-urlencoded", b"reward=mean&images=AAAA&prompts=p"),
        ("multipart", "multipart/form-data; boundary=xx", b'--xx\r\nContent-Disposition: form-data; name="reward"'
         b"\r\n\r\nmean\r\n--xx--\r\n"),
        ("xml", "application/xml", b"<score reward='mean'/>"),
        ("octet_stream_png", "application/octet-stream", _png()),
        ("image_png", "image/png", _png()),
    ]  # fmt: skip
    for name, ctype, body in cases:
        yield Case(f"content_type/{name}", body, {"Content-Type": ctype} | AUTH)
    yield Case("content_type/none_garbage", b"\x00garbage", dict(AUTH))


def _huge_bodies() -> Iterator[Case]:
    limit = int(MAX_MB * 1024 * 1024)
    big_image = _with(images=["A" * (limit + 100)])
    many_prompts = _body({"reward": "mean", "images": [], "prompts": ["p" * 64] * (limit // 64)})
    yield Case("huge/one_image", big_image, statuses=(413,))
    yield Case("huge/many_prompts", many_prompts, statuses=(413,))
    yield Case("huge/zeros", b"\x00" * (limit * 2), statuses=(413,))
    yield Case("huge/chunked_json", big_image, statuses=(413,), chunked=True)
    yield Case("huge/chunked_zeros", b"0" * (limit + 1), statuses=(413,), chunked=True)
    yield Case(
        "huge/msgpack", b"\x00" * (limit + 1), {"Content-Type": "application/msgpack"} | AUTH, statuses=(413,)
    )


def _deeply_nested() -> Iterator[Case]:
    for depth in (10_000, 100_000):
        yield Case(f"nested/array/{depth}", b"[" * depth + b"]" * depth)
        yield Case(f"nested/object/{depth}", b'{"a":' * depth + b"1" + b"}" * depth)
        yield Case(
            f"nested/images/{depth}",
            b'{"reward":"mean","prompts":["p"],"images":' + b"[" * depth + b"]" * depth + b"}",
        )
        nested_meta = b'[{"a":' * depth + b"1" + b"}]" * depth
        yield Case(f"nested/metadata/{depth}", _body(_valid())[:-1] + b', "metadata": ' + nested_meta + b"}")
        msgpack_headers = {"Content-Type": "application/msgpack"} | AUTH
        yield Case(f"nested/msgpack/{depth}", b"\x91" * depth + b"\xc0", msgpack_headers)
    yield Case("nested/prompts/500", _with(prompts=json.loads("[" * 500 + "]" * 500)))


def _wrong_routes() -> Iterator[Case]:
    body = _body(_valid())
    for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS"):
        yield Case(f"method/{method}", body if method != "GET" else None, dict(JSON), method, statuses=(405,))
    yield Case("method/post_healthz", body, dict(JSON), "POST", "/healthz", statuses=(405,))
    yield Case("method/post_metrics", body, dict(JSON), "POST", "/metrics", statuses=(405,))
    for path in (
        "/",
        "/v1",
        "/v1/score/",
        "/V1/score",
        "/v2/score",
        "/v1/score%00",
        "/admin",
        "/v1/rewards/mean",
        "/.env",
        "/v1//score",
    ):
        yield Case(f"path/{path}", body, dict(JSON), "POST", path, statuses=(404, 405))


def hostile_cases() -> list[Case]:
    """Every hostile request, generated deterministically (seeded)."""
    rng = random.Random(1234)
    groups = [_bad_json(rng), _wrong_types(), _bad_base64(), _bad_images(), _bad_raw(), _wrong_lengths(),
              _unknown_rewards(), _bad_auth(), _wrong_content_types(), _huge_bodies(), _deeply_nested(),
              _wrong_routes()]  # fmt: skip
    return [case for group in groups for case in group]


# ------------------------------------------------------------------------------------------ transport
def _send(port: int, case: Case) -> tuple[int, str, bytes]:
    """Send one case with ``http.client`` (exact bytes and headers); returns status, content type, body."""
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        if case.chunked:
            conn.putrequest(case.method, case.path)
            for key, value in (case.headers | {"Transfer-Encoding": "chunked"}).items():
                conn.putheader(key, value)
            conn.endheaders()
            for start in range(0, len(case.body or b""), 65536):
                chunk = case.body[start : start + 65536]
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
        else:
            conn.request(case.method, case.path, body=case.body, headers=case.headers)
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def _problem(case: Case, status: int, ctype: str, body: bytes) -> str | None:
    """Why the reply to ``case`` is not the expected 4xx JSON error, or None."""
    if status not in case.statuses:
        return f"status {status}, expected {case.statuses}: {body[:200]!r}"
    if not ctype.startswith("application/json"):
        return f"content type {ctype!r}: {body[:200]!r}"
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not a JSON error: {body[:200]!r}"
    return None if isinstance(error, str) and error else f"empty error message: {body[:200]!r}"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, MeanReward]]:
    reward = MeanReward()
    settings = ServerSettings(
        port=0, token=TOKEN, max_wait_ms=0, max_request_mb=MAX_MB, max_image_pixels=MAX_PIXELS
    )
    with BackgroundServer(build_app({"mean": reward}, settings), shutdown_timeout_s=10) as running:
        yield running, reward


def _score_valid(server: BackgroundServer) -> None:
    """A valid request still scores correctly: the mean of constant images."""
    values = [0.2, 0.6]
    images = constant_images(values)
    payload = {
        "reward": "mean",
        "images": [_b64(_png(8, round(v * 255))) for v in values],
        "prompts": ["a", "b"],
    }
    status, reply = http("POST", server.url + "/v1/score", payload, AUTH)
    assert status == 200, reply
    assert reply["scores"] == pytest.approx(images.mean(dim=(1, 2, 3)).tolist(), abs=1e-6)
    # and the same images as raw pixels (one of them single-channel, as the format allows)
    raw = [_raw_entry((3, 8, 8), data=bytes([round(values[0] * 255)] * 192)),
           _raw_entry((1, 8, 8), data=bytes([round(values[1] * 255)] * 64))]  # fmt: skip
    status, _, body = _send(server.port, Case("valid_raw", _packed(raw), dict(RAW_TYPE)))
    assert status == 200, body
    assert msgpack.unpackb(body)["scores"] == pytest.approx(images.mean(dim=(1, 2, 3)).tolist(), abs=1e-6)


def test_hostile_requests_get_4xx_json_errors_and_the_server_stays_healthy(server):
    running, reward = server
    cases = hostile_cases()
    assert len(cases) >= 200 and len({c.name for c in cases}) == len(cases)
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=4) as pool:
        replies = list(pool.map(lambda case: _send(running.port, case), cases))
    elapsed = time.perf_counter() - began
    problems = [
        f"{case.name}: {why}" for case, reply in zip(cases, replies) if (why := _problem(case, *reply))
    ]
    assert not problems, f"{len(problems)} of {len(cases)} hostile requests were mishandled:\n" + "\n".join(
        problems[:40]
    )
    assert reward.calls == [], "no hostile request may reach the reward"
    assert elapsed < 25, f"{len(cases)} hostile requests took {elapsed:.1f}s"
    status, health = http("GET", running.url + "/healthz")
    assert status == 200 and health["status"] == "ok"
    _score_valid(running)
    status, text = http("GET", running.url + "/metrics", headers=AUTH)
    assert status == 200
    assert metric(text, 'rlgen_errors_total{kind="internal"}') == 0
    errors = sum(
        metric(text, f'rlgen_errors_total{{kind="{kind}"}}')
        for kind in ("validation", "auth", "not_found", "too_large", "http", "scoring")
    )
    assert errors >= len(cases)


RAW = [
    b"GARBAGE\r\n\r\n",
    b"\x00\x01\x02\x03\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n",
    b"POST /v1/score HTTP/9.9\r\nHost: x\r\n\r\n",
    b'POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"reward":',  # then hang up
    b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nabcdefg",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\n",  # unterminated headers, then hang up
]


def _raw(port: int, data: bytes) -> bytes:
    """Write raw bytes, half-close, and read whatever comes back (b'' if the server just closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
    return b"".join(chunks)


def test_raw_errors_name_the_problem(server):
    running, _ = server
    cases = [
        ([_raw_entry(data=bytes(191))], 400, "declares shape [3, 8, 8] × uint8 = 192 bytes but data has 191 bytes"),
        ([_raw_entry(), _raw_entry(dtype="float32")], 400, "images[1].dtype='float32' is not supported"),
        ([_raw_entry([8, 8, 3])], 400, "has C=8"),
        ([_raw_entry([3, 8])], 400, "images[0].shape must be [C, H, W]"),
        ([_raw_entry() | {"layout": "HWC"}], 400, "unexpected ['layout']"),
        ([{"shape": [3, 8, 8], "dtype": "uint8"}], 400, "missing ['data']"),
        ([_raw_entry(data="text")], 400, "images[0].data must be bytes"),
        ([_raw_entry([3, 65, 65], data=bytes(3 * 65 * 65))], 413, "max_image_pixels"),
        ([7], 400, "images[0] has type int; expected bytes or dict"),
    ]  # fmt: skip
    for images, status, fragment in cases:
        got, _, body = _send(running.port, Case("raw", _packed(images), dict(RAW_TYPE)))
        error = json.loads(body)["error"]
        assert (got, fragment in error) == (status, True), (images, error)


def test_malformed_http_is_refused_below_the_app_and_the_server_stays_healthy(server):
    running, _ = server
    for data in RAW:
        reply = _raw(running.port, data)
        # aiohttp's HTTP parser answers these before the app (plain text), or the server just closes.
        status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.") else None
        assert status is None or 400 <= status < 500, (data[:60], reply[:200])
    assert http("GET", running.url + "/healthz")[0] == 200
    _score_valid(running)
