"""``MsgpackScanner``: a msgpack body walked as it arrives counts what the parser counts, however it is
split, and refuses a PNG/JPEG chunk flood after the bytes that pass the cap, not after the whole body."""

from __future__ import annotations

import io
import random
import struct
import zlib

import msgpack
import pytest
from PIL import Image

from rlgen_cli.rewards.remote.wire import WireError
from rlgen_cli.server import limits


def _file(fmt: str, side: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (90, 90, 90)).save(buffer, format=fmt)
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes = b"") -> bytes:
    crc = struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return struct.pack(">I", len(data)) + kind + data + crc


def _flooded_png(extra: bytes) -> bytes:
    png = _file("PNG")
    return png[: -len(_chunk(b"IEND"))] + extra + _chunk(b"IEND")


def _value(rng: random.Random, depth: int = 0):
    """A random msgpack value using every token kind (fix and sized ints, floats, str/bin of each length
    class, ext, nested maps and arrays of each header size)."""
    leaves = [None, True, False, 5, -7, 200, -200, 70_000, -70_000, 2**40, -(2**40), 2**63, 1.5,
              "s", "x" * 40, "y" * 300, "z" * 70_000, b"b", b"c" * 300, b"d" * 70_000,
              msgpack.ExtType(3, b"e" * 5), msgpack.ExtType(4, b"f" * 300)]  # fmt: skip
    roll = rng.random()
    if depth > 2 or roll < 0.5:
        return rng.choice(leaves)
    n = rng.choice([0, 3, 17])
    if roll < 0.75:
        return [_value(rng, depth + 1) for _ in range(n)]
    return {f"k{i}": _value(rng, depth + 1) for i in range(n)}


def _parser_count(body: bytes) -> int:
    counter = limits._ItemCounter(10**9)
    msgpack.unpackb(body, list_hook=counter, object_hook=counter, raw=False, strict_map_key=False)
    return counter.count


def _feed(scanner: limits.MsgpackScanner, body: bytes, rng: random.Random) -> int:
    """Feed ``body`` in random pieces (1 byte to 64 KiB); returns the bytes fed when it stopped."""
    pos = 0
    while pos < len(body):
        step = rng.choice([1, 2, 3, 7, 100, 4096, 65536])
        scanner.feed(body[pos : pos + step])
        pos += step
    return pos


def test_counts_match_the_parsers_for_every_split():
    rng = random.Random(36)
    for _ in range(30):
        payload = {
            "reward": "r",
            "images": [
                _file("PNG"),
                _file("JPEG"),
                {"shape": [3, 2, 2], "dtype": "uint8", "data": bytes(12)},
            ],
            "prompts": ["p"] * 3,
            "metadata": [_value(rng) for _ in range(3)],
        }
        body = msgpack.packb(payload, use_bin_type=True)
        expected = _parser_count(body)
        scanner = limits.MsgpackScanner(expected)
        _feed(scanner, body, rng)
        assert scanner.count == expected and scanner.done
        with pytest.raises(WireError, match="server.max_request_items"):
            _feed(limits.MsgpackScanner(expected - 1), body, rng)


@pytest.mark.parametrize(
    ("image", "cap"),
    [
        (_flooded_png(_chunk(b"prIv") * 200_000), "MAX_IMAGE_CHUNKS"),
        (_flooded_png(b"".join(_chunk(b"tEXt", b"k%09d\0" % i) for i in range(20_000))), "MAX_TEXT_BYTES"),
        (_flooded_png(_chunk(b"prIv", bytes(1 << 20)) * 3), "MAX_ANCILLARY_BYTES"),
        (_file("JPEG")[:2] + b"\xff\xfe\x00\x02" * 100_000 + _file("JPEG")[2:], "MAX_IMAGE_CHUNKS"),
    ],
)
def test_a_flood_is_refused_soon_after_its_cap(image, cap):
    body = msgpack.packb({"reward": "r", "images": [_file("PNG"), image], "prompts": ["a", "b"]})
    scanner = limits.MsgpackScanner(250_000)
    fed = 0
    with pytest.raises(WireError) as caught:
        for start in range(0, len(body), 4096):
            fed = start + 4096
            scanner.feed(body[start:fed])
    assert caught.value.status == 413 and cap in str(caught.value) and "images[1]" in str(caught.value)
    # refused within the piece that passed the cap: 16 384 chunks of 12 bytes (segments of 4), 64 KiB of
    # text in 23-byte chunks, 1 MiB + 1 of ancillary data (plus the first image and the headers)
    assert (
        fed <= {"MAX_IMAGE_CHUNKS": 210_000, "MAX_TEXT_BYTES": 150_000, "MAX_ANCILLARY_BYTES": 1_060_000}[cap]
    )
    assert fed < len(body) // 2


def test_files_under_the_caps_pass():
    jpeg = _file("JPEG")
    app1 = jpeg[:2] + b"\xff\xe1\xff\xff" + bytes(65533) + jpeg[2:]  # one 64 KiB APP1 segment
    images = [_file("PNG", 512), _file("JPEG", 512), app1, _flooded_png(_chunk(b"prIv") * 16_000)]
    scanner = limits.MsgpackScanner(250_000)
    _feed(scanner, msgpack.packb({"images": images}), random.Random(2))
    assert scanner.done


def test_only_files_of_the_top_level_images_list_are_walked():
    # raw pixels (and any other binary) that happen to start like a PNG followed by a chunk flood
    fake = _flooded_png(_chunk(b"prIv") * 20_000)
    payload = {
        "reward": "r",
        "images": [{"shape": [1, 1, len(fake)], "dtype": "uint8", "data": fake}],
        "prompts": ["p"],
        "metadata": [{"images": [fake]}],
        "other": [fake],
    }
    scanner = limits.MsgpackScanner(250_000)
    _feed(scanner, msgpack.packb(payload), random.Random(1))
    assert scanner.done


def test_a_body_that_is_not_msgpack_is_left_to_the_parser():
    scanner = limits.MsgpackScanner(10)
    scanner.feed(b"\x93\x01\xc1" + b"\xdd\xff\xff\xff\xff" * 3)  # 0xc1 is never used in msgpack
    assert scanner.done and scanner.count == 4  # the array header (3 + 1), then the walk stopped
