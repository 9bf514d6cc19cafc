"""``PickleScanner``: a Flow-GRPO pickle body walked as it arrives runs the parser's opcode count however
it is split, walks the chunk/segment headers of the files of its top-level ``images`` list only, and a
PNG/JPEG chunk flood is refused within the bytes that pass the cap — on a real loopback server, before
the rest of the body has been sent."""

from __future__ import annotations

import io
import json
import pickle
import random
import socket
import struct
import time
import zlib

import pytest
from PIL import Image

from rlgen_cli.rewards import build_reward
from rlgen_cli.rewards.remote.wire import WireError
from rlgen_cli.server import plain_pickle
from rlgen_cli.server.pickle_scan import PickleScanner
from tests.server.helpers import MeanReward


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


FLOOD = _flooded_png(_chunk(b"prIv") * 200_000)  # 2.4 MB: 200 000 empty private chunks (cap: 16 384)


def _value(rng: random.Random, depth: int = 0):
    """A random plain value using every opcode pickle writes for plain data (ints of each width, long
    ints, floats, str/bytes of each length class, tuples of 0–4, nested lists and dicts, repeats)."""
    shared = ["shared"]
    leaves = [None, True, False, 5, -7, 300, 70_000, -(2**31), 2**40, -(2**70), 1.5, "s", "x" * 300,
              b"b", b"c" * 300, (), (1,), (1, "a"), (1, 2, 3), (1, 2, 3, 4), shared]  # fmt: skip
    roll = rng.random()
    if depth > 2 or roll < 0.5:
        return rng.choice(leaves)
    n = rng.choice([0, 1, 3, 17])
    if roll < 0.75:
        return [_value(rng, depth + 1) for _ in range(n)]
    return {f"k{i}": _value(rng, depth + 1) for i in range(n)}


def _request(rng: random.Random, images: list[bytes], protocol: int) -> bytes:
    metadata = [{"prompt": "a dog", "extra": _value(rng)} for _ in images]
    return pickle.dumps({"images": images, "meta_datas": metadata, "only_strict": False}, protocol=protocol)


def _feed(scanner: PickleScanner, body: bytes, rng: random.Random) -> int:
    """Feed ``body`` in random pieces (1 byte to 64 KiB); returns the bytes fed when it stopped."""
    pos = 0
    while pos < len(body):
        step = rng.choice([1, 2, 3, 7, 100, 4096, 65536])
        scanner.feed(body[pos : pos + step])
        pos += step
    return pos


def _parser_opcodes(body: bytes) -> int:
    machine = plain_pickle._Machine(memoryview(body), 10**6, 64)
    machine.run()
    return machine.ops


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_opcodes_and_images_match_the_parsers_for_every_split(protocol):
    rng = random.Random(protocol)
    for n in (1, 2, 5):
        body = _request(rng, [_file("JPEG"), _file("PNG")] * n, protocol)
        scanner = PickleScanner(10**6)
        _feed(scanner, body, rng)
        assert scanner.done and scanner.ops == _parser_opcodes(body) and scanner.images == 2 * n


def test_the_opcode_budget_is_the_parsers():
    body = b"\x80\x04" + b"N0" * 1_000 + b"N."  # 2 003 opcodes that build no item
    with pytest.raises(WireError, match="more than 800 opcodes") as caught:
        _feed(PickleScanner(100), body, random.Random(1))
    with pytest.raises(WireError) as parsed:
        plain_pickle.load_plain(body, 100, 64)
    assert caught.value.status == parsed.value.status == 413 and str(caught.value) == str(parsed.value)


def test_a_file_sent_twice_keeps_the_index_of_the_files_after_it():
    png = _file("PNG")
    body = pickle.dumps({"images": [png, png, FLOOD]})  # the second png is a memo reference
    with pytest.raises(WireError, match=r"images\[2\] has more than 16384 PNG chunks"):
        _feed(PickleScanner(250_000), body, random.Random(2))


@pytest.mark.parametrize(
    ("image", "cap"),
    [
        (FLOOD, "MAX_IMAGE_CHUNKS"),
        (_flooded_png(b"".join(_chunk(b"tEXt", b"k%09d\0" % i) for i in range(20_000))), "MAX_TEXT_BYTES"),
        (_file("JPEG")[:2] + b"\xff\xfe\x00\x02" * 100_000 + _file("JPEG")[2:], "MAX_IMAGE_CHUNKS"),
    ],
)
def test_a_flood_is_refused_soon_after_its_cap(image, cap):
    body = pickle.dumps({"images": [_file("PNG"), image], "meta_datas": [{}, {}]})
    scanner = PickleScanner(250_000)
    fed = 0
    with pytest.raises(WireError) as caught:
        for start in range(0, len(body), 4096):
            fed = start + 4096
            scanner.feed(body[start:fed])
    assert caught.value.status == 413 and cap in str(caught.value) and "images[1]" in str(caught.value)
    # within the piece past the cap: 16 384 chunks of 12 bytes (segments of 4), 64 KiB of text in
    # 23-byte chunks (plus the first image and the pickle's own bytes)
    assert fed <= {"MAX_IMAGE_CHUNKS": 210_000, "MAX_TEXT_BYTES": 150_000}[cap]
    assert fed < len(body) // 2


def test_only_files_of_the_top_level_images_list_are_walked():
    payload = {
        "images": [_file("PNG")],
        "meta_datas": [{"images": [FLOOD], "raw": FLOOD}],
        "prompts": ["p"],
    }
    for protocol in (3, 4, 5):
        scanner = PickleScanner(250_000)
        _feed(scanner, pickle.dumps(payload, protocol=protocol), random.Random(protocol))
        assert scanner.done and scanner.images == 1


@pytest.mark.parametrize(
    "body",
    [
        pickle.dumps({"images": [b"x"], "prompts": {1, 2}}),  # a set: not plain data
        b"\x80\x04\x8b" + struct.pack("<i", -5) + FLOOD,  # LONG4 of a negative length
        b"\x80\x04a" + FLOOD,  # APPEND on an empty stack
        b"\x80\x02cos\nsystem\n" + FLOOD,  # GLOBAL
    ],
)
def test_a_body_the_parser_refuses_is_left_to_it(body):
    scanner = PickleScanner(250_000)
    _feed(scanner, body, random.Random(0))
    assert scanner.done


# ------------------------------------------------------------------------------------ loopback server
def _reply_to_a_partial_body(port: int, body: bytes, sent: int, wait_s: float) -> bytes:
    """POST ``body``'s first ``sent`` bytes under its full Content-Length, then read for ``wait_s``."""
    head = (
        f"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(head + body[:sent])
        reply, deadline = b"", time.monotonic() + wait_s
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            reply += chunk
    return reply


def test_a_flooded_request_is_refused_before_the_rest_of_its_body_arrives(serve):
    server = serve({"mean": MeanReward()}, flowgrpo_protocol=True, body_timeout_s=60)
    body = pickle.dumps({"images": [_file("PNG"), FLOOD]})
    reply = _reply_to_a_partial_body(server.port, body, sent=400_000, wait_s=20)  # 1/6 of the body
    status = reply.split(b"\r\n", 1)[0]
    assert b" 413 " in status, reply[:300]
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert "images[1]" in error and "MAX_IMAGE_CHUNKS" in error


def test_a_valid_request_is_scored_as_before(serve):
    server = serve({"brightness": build_reward("brightness")}, flowgrpo_protocol=True)  # image-only
    image = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 255, 255)).save(image, format="PNG")
    import requests

    session = requests.Session()
    session.trust_env = False
    reply = session.post(server.url, data=pickle.dumps({"images": [image.getvalue()]}), timeout=60)
    assert reply.status_code == 200 and plain_pickle.load_plain(reply.content, 100, 4)["outputs"] == [1.0]


def test_random_bodies_end_the_walk_or_a_413_and_nothing_else():
    """Random bytes, opcode soups and pieces of a valid request: the walk raises no other error."""
    import pickletools

    rng = random.Random(38)
    opcodes = [op.code.encode("latin-1") for op in pickletools.opcodes]
    valid = _request(rng, [_file("PNG"), _file("JPEG")], 4)
    for i in range(600):
        kind = i % 3
        if kind == 0:
            body = rng.randbytes(rng.randrange(1, 300))
        elif kind == 1:
            body = b"\x80\x04" + b"".join(
                rng.choice(opcodes) + rng.randbytes(rng.randrange(0, 9)) for _ in range(60)
            )
        else:
            at = rng.randrange(2, len(valid) - 1)
            body = valid[:at] + rng.randbytes(rng.randrange(1, 12)) + valid[at:]
        try:
            _feed(PickleScanner(1_000), body, rng)
        except WireError as err:
            assert err.status == 413, (i, err)
