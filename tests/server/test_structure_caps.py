"""The JSON item counter and the PNG/JPEG structure pre-scan, at their boundaries.

The counter must agree with a byte-by-byte reading of JSON strings and escapes however the body is split
into chunks; the pre-scan must pass real files (PIL's output, with an ICC-sized ancillary chunk and a
little text) and refuse, naming the cap, a file one past each cap.
"""

from __future__ import annotations

import io
import json
import random
import struct
import zlib

import pytest
from PIL import Image

from rlgen_cli.rewards.remote.wire import WireError
from rlgen_cli.server import limits


def _reference_count(body: bytes) -> int:
    """``[``, ``{``, ``,`` outside strings, reading one byte at a time (the definition)."""
    count, in_string, escaped = 0, False, False
    for byte in body:
        char = chr(byte)
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{,":
            count += 1
    return count


def test_the_json_counter_matches_a_byte_by_byte_reading_for_any_chunking():
    rng = random.Random(7)
    pieces = ["", "\\", '"', ",[{", 'x\\"y\\\\', '\\\\\\"', "q", "\\" * 5 + '"', "ü"]
    for _ in range(200):
        payload = {"a": [rng.choice(pieces) for _ in range(rng.randint(0, 40))], "b": [{}, [1, 2]]}
        body = json.dumps(payload, ensure_ascii=rng.random() < 0.5).encode()
        cuts = sorted(rng.sample(range(len(body) + 1), min(len(body) + 1, 6)))
        counter = limits.JsonItemCounter(10**9)
        for start, stop in zip([0, *cuts], [*cuts, len(body)]):
            counter.feed(body[start:stop])
        assert counter.count == _reference_count(body), body


def test_the_json_counter_stops_at_its_limit_naming_the_key():
    counter = limits.JsonItemCounter(1000)
    with pytest.raises(WireError, match="server.max_request_items=1000") as err:
        counter.feed(b"[" + b'"",' * 5000 + b'""]')
    assert err.value.status == 413
    limits.JsonItemCounter(1000).feed(b"[" + b'"a,b",' * 999 + b"1]")  # 1 + 999 commas: fits exactly


def _chunk(kind: bytes, data: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def _png_with(extra: list[bytes]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buffer, format="PNG")
    png = buffer.getvalue()
    return png[: -len(_chunk(b"IEND"))] + b"".join(extra) + _chunk(b"IEND")


def _scan(data: bytes, fmt: str = "PNG") -> None:
    limits.scan_image_structure(data, fmt, 0)


def test_real_png_and_jpeg_files_pass_the_prescan():
    icc = _chunk(b"iCCP", b"icc\0\0" + zlib.compress(bytes(500_000)))
    text = [
        _chunk(b"tEXt", b"Software\0rlgen"),
        _chunk(b"zTXt", b"Comment\0\0" + zlib.compress(b"x" * 60_000)),
    ]
    _scan(_png_with([icc, *text]))
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buffer, format="JPEG", progressive=True, comment=b"c" * 60_000)
    _scan(buffer.getvalue(), "JPEG")


@pytest.mark.parametrize(
    "extra, cap",
    [
        ([_chunk(b"prIv")] * limits.MAX_IMAGE_CHUNKS, "MAX_IMAGE_CHUNKS"),
        ([_chunk(b"prIv", bytes(limits.MAX_ANCILLARY_BYTES + 1))], "MAX_ANCILLARY_BYTES"),
        ([_chunk(b"tEXt", b"k%05d\0" % i) for i in range(limits.MAX_TEXT_BYTES // 7 + 1)], "MAX_TEXT_BYTES"),
        ([_chunk(b"zTXt", b"k\0\0" + zlib.compress(bytes(limits.MAX_TEXT_BYTES)))], "MAX_TEXT_BYTES"),
        ([_chunk(b"iTXt", b"k\0\1\0en\0\0" + zlib.compress(bytes(limits.MAX_TEXT_BYTES)))], "MAX_TEXT_BYTES"),
    ],
    ids=["chunks", "ancillary", "text_keys", "ztxt_inflated", "itxt_inflated"],
)
def test_a_png_one_past_a_cap_is_refused_naming_it(extra, cap):
    with pytest.raises(WireError, match=cap) as err:
        _scan(_png_with(extra))
    assert err.value.status == 413


def test_a_jpeg_past_its_caps_is_refused_naming_them():
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buffer, format="JPEG")
    jpeg = buffer.getvalue()
    comment = b"\xff\xfe\x00\x03c"  # a COM segment of one byte
    floods = {
        "MAX_IMAGE_CHUNKS": jpeg[:2] + comment * limits.MAX_IMAGE_CHUNKS + jpeg[2:],
        "MAX_ANCILLARY_BYTES": jpeg[:2] + (b"\xff\xe1\xff\xff" + bytes(65533)) * 17 + jpeg[2:],
        "MAX_JPEG_SCANS": jpeg[:-2] + b"\xff\xda\x00\x02" * (limits.MAX_JPEG_SCANS + 1) + jpeg[-2:],
    }
    for cap, data in floods.items():
        with pytest.raises(WireError, match=cap):
            _scan(data, "JPEG")
