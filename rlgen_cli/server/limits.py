"""Bounded parsing of ``/v1/score`` bodies: the structure a body may build is limited while it is parsed.

A small body can describe a huge object graph (a msgpack empty map is 1 byte, a Python dict about 64),
so the body size alone bounds nothing. Every list element, map entry and container counts as one item:

* **msgpack** is parsed with a hook on every list and map that adds its length, so parsing stops at
  the first container past ``max_items``; no single list or map may even declare more (msgpack's own
  ``max_array_len``/``max_map_len``, checked from the header before allocating);
* **JSON** has no such hooks, so its items are counted while the body arrives, before parsing: every
  ``[``, ``{`` and ``,`` outside strings, by :class:`JsonItemCounter` — a numpy scan of each chunk as
  it is received (linear, no per-string work, a few milliseconds of event loop per chunk), so a body of
  millions of empty strings is refused after its first ``max_items`` items, not after it all arrived.

A **msgpack** body is also walked as it arrives (:class:`MsgpackScanner`: token headers only, nothing
built): its items are counted as the parser counts them, and the files of its ``images`` list have
their chunk/segment headers walked (chunk count, ancillary bytes, ``tEXt`` bytes), so a body past a cap
is refused after the bytes that pass it, not after all of it was read and copied by the parser.

PNG and JPEG files are pre-scanned (:func:`scan_image_structure`: chunk and marker headers only) before
Pillow sees them: Pillow walks every PNG chunk and JPEG segment in Python and keeps text and private
chunks, so a small image followed by millions of empty chunks costs seconds and hundreds of MB. Each file
may hold at most ``MAX_IMAGE_CHUNKS`` chunks/segments, ``MAX_ANCILLARY_BYTES`` of ancillary chunks
(PNG chunks whose type starts lower-case, JPEG APPn/COM segments) and ``MAX_TEXT_BYTES`` of text keys
and values (PNG ``tEXt``/``zTXt``/``iTXt``, compressed text counted once inflated).

:func:`check_depth` bounds how deeply free-form fields (``metadata``) nest. Each function raises a
:class:`~rlgen_cli.rewards.remote.wire.WireError` naming the limit and its ``server.`` key.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlgen_cli.rewards.remote.wire import WireError

__all__ = [
    "MAX_ANCILLARY_BYTES",
    "MAX_IMAGE_CHUNKS",
    "MAX_TEXT_BYTES",
    "JsonItemCounter",
    "MsgpackScanner",
    "check_depth",
    "parse_body",
    "scan_image_structure",
]

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_COMMA, _BRACKET, _BRACE = ord(","), ord("["), ord("{")
_SLICE = 256 * 1024  # bytes scanned per numpy pass: bounds the scan's temporaries to a few MiB

# Per PNG/JPEG file. A 4096² RGB PNG written with libpng's 8 KiB IDAT chunks has ≈ 6 000 chunks; real
# files carry a few KiB of metadata (an ICC profile is the largest, ≤ ~600 KiB).
MAX_IMAGE_CHUNKS = 16_384
MAX_ANCILLARY_BYTES = 1024 * 1024
MAX_TEXT_BYTES = 64 * 1024


def _too_many(limit: int, detail: str) -> WireError:
    return WireError(
        f"request body holds more than {limit} items (list elements, map entries, containers: {detail}), "
        f"above server.max_request_items={limit}; send fewer images or less metadata per request",
        status=413,
    )


class JsonItemCounter:
    """Counts the ``[``, ``{`` and ``,`` outside strings of a JSON body fed chunk by chunk.

    A quote delimits a string unless an odd run of backslashes precedes it (in valid JSON a backslash
    only appears inside strings). The state carried between chunks is whether the scan is inside a string
    and the length of the backslash run the last chunk ended with, so any split of the body gives the same
    count. Each chunk costs a few vectorised passes; nothing is kept per string.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, 0
        self._in_string = False
        self._backslashes = 0  # length of the backslash run at the end of what was fed

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Count ``chunk``; raises a 413 :class:`WireError` as soon as the count passes ``limit``."""
        data = np.frombuffer(chunk, dtype=np.uint8)
        for start in range(0, len(data), _SLICE):
            self._scan(data[start : start + _SLICE])
            if self.count > self.limit:
                raise _too_many(self.limit, f"more than {self.limit} counted before the body ended")

    def _scan(self, data: np.ndarray) -> None:
        quotes = np.flatnonzero(data == _QUOTE)
        delimiters = self._delimiters(data, quotes) if self._backslashes or _BACKSLASH in data else quotes
        marks = np.flatnonzero((data == _COMMA) | (data == _BRACKET) | (data == _BRACE))
        quotes_before = np.searchsorted(delimiters, marks) + self._in_string
        self.count += int(np.count_nonzero(quotes_before % 2 == 0))
        self._in_string ^= bool(len(delimiters) % 2)

    def _delimiters(self, data: np.ndarray, quotes: np.ndarray) -> np.ndarray:
        """The quotes not escaped by an odd run of backslashes; remembers the run this slice ends with."""
        index = np.arange(len(data), dtype=np.int64)
        # last position ≤ i that is not a backslash (-1: every byte of this slice up to i is one)
        last_other = np.maximum.accumulate(np.where(data == _BACKSLASH, -1, index))
        before = quotes - 1
        last = np.where(before >= 0, last_other[np.maximum(before, 0)], -1)
        run = before - last + np.where(last < 0, self._backslashes, 0)  # backslashes right before each quote
        tail_other = int(last_other[-1])
        self._backslashes = self._backslashes + len(data) if tail_other < 0 else len(data) - 1 - tail_other
        return quotes[run % 2 == 0]


class _ItemCounter:
    """msgpack ``list_hook``/``object_hook``: counts every container and its length, raises past ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, 0

    def __call__(self, container: Any) -> Any:
        self.count += len(container) + 1
        if self.count > self.limit:
            raise _too_many(self.limit, f"{self.count} counted before parsing stopped")
        return container


def _parse_msgpack(body: bytes, max_items: int) -> Any:
    import msgpack

    counter = _ItemCounter(max_items)
    return msgpack.unpackb(
        body,
        raw=False,
        list_hook=counter,
        object_hook=counter,
        max_array_len=max_items,
        max_map_len=max_items,
    )


def parse_body(
    body: bytes | bytearray | memoryview, binary: bool, max_items: int, counted: bool = False
) -> dict[str, Any]:
    """Parse a request body (msgpack when ``binary``, else JSON) holding at most ``max_items`` items.

    ``counted``: a JSON body's items were already counted as it arrived (:class:`JsonItemCounter`).

    Raises:
        WireError: 413 above ``max_items``; 400 for a body that is not valid msgpack/JSON or not a map.
    """
    fmt = "msgpack" if binary else "JSON"
    try:
        if binary:
            payload = _parse_msgpack(body, max_items)
        else:
            if not counted:
                JsonItemCounter(max_items).feed(body)
            payload = json.loads(body)
    except WireError:
        raise
    except ValueError as err:
        if "exceeds max_" in str(err):  # msgpack refused a list/map header above max_items
            raise _too_many(max_items, f"one declares {str(err).split()[0]}") from err
        raise WireError(f"request body is not valid {fmt}: {err}") from err
    except Exception as err:  # RecursionError (deep JSON), msgpack's StackError, ...
        raise WireError(f"request body is not valid {fmt}: {type(err).__name__} {err}".rstrip()) from err
    if not isinstance(payload, dict):
        raise WireError(f"request body must be an object, got {type(payload).__name__}")
    return payload


def check_depth(value: Any, limit: int, field: str) -> None:
    """Raise a 413 :class:`WireError` when ``value`` nests lists/maps more than ``limit`` deep.

    ``field`` names the value in the message; ``value`` itself (a list of per-sample entries) is not a
    level: ``[{"a": 1}]`` is 1 deep.
    """
    stack = [(item, 1) for item in value] if isinstance(value, list) else [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        if depth > limit:
            raise WireError(
                f"{field} nests more than {limit} levels deep, above server.max_metadata_depth={limit}; "
                "flatten it",
                status=413,
            )
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children)


# --------------------------------------------------------------------------------- PNG/JPEG structure
_PNG_TEXT = frozenset((b"tEXt", b"zTXt", b"iTXt"))
_JPEG_ANCILLARY = frozenset(range(0xE0, 0xF0)) | {0xFE}  # APP0–APP15, COM
MAX_JPEG_SCANS = 256  # start-of-scan markers per JPEG: a progressive file has about ten


def _structure_error(index: int, what: str, cap: str) -> WireError:
    return WireError(
        f"images[{index}] {what}, above the server's cap of {cap} per image; send the image without "
        "extra metadata chunks (re-encode it: PIL's save writes none)",
        status=413,
    )


def _require_under_cap(index: int, count: int, cap: int, name: str, what: str) -> None:
    """Refuse image ``index`` with a 413 naming ``name`` once ``count`` of ``what`` passes ``cap``."""
    if count > cap:
        raise _structure_error(index, f"has more than {cap} {what}", name)


def _inflated_size(data: bytes, budget: int) -> int:
    """Bytes ``data`` (zlib) inflates to, stopping once past ``budget``; undecodable data counts as 0
    (Pillow then refuses the file)."""
    inflater = zlib.decompressobj()
    try:
        return len(inflater.decompress(data, budget + 1))
    except zlib.error:
        return 0


def _png_text_bytes(kind: bytes, body: bytes, budget: int) -> int:
    """Key + value bytes of one text chunk, compressed text counted once inflated (up to ``budget`` + 1)."""
    key, _, rest = body.partition(b"\0")
    if kind == b"tEXt":
        return len(body)
    if kind == b"zTXt":  # key \0 method compressed-text
        return len(key) + _inflated_size(rest[1:], budget)
    # iTXt: key \0 flag method language \0 translated-key \0 text (compressed when flag == 1)
    flag, texts = rest[:1], rest[2:]
    language, _, texts = texts.partition(b"\0")
    translated, _, text = texts.partition(b"\0")
    fixed = len(key) + len(language) + len(translated)
    return fixed + (_inflated_size(text, budget) if flag == b"\1" else len(text))


def _scan_png(data: bytes, index: int) -> None:
    chunks = ancillary = text = 0
    pos = 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        chunks += 1
        _require_under_cap(index, chunks, MAX_IMAGE_CHUNKS, "MAX_IMAGE_CHUNKS", "PNG chunks")
        if kind[0] & 0x20:  # lower-case first letter: an ancillary chunk
            ancillary += length
            _require_under_cap(
                index, ancillary, MAX_ANCILLARY_BYTES, "MAX_ANCILLARY_BYTES", "bytes of ancillary PNG chunks"
            )
            if kind in _PNG_TEXT:
                text += _png_text_bytes(kind, data[pos + 8 : pos + 8 + length], MAX_TEXT_BYTES - text)
                _require_under_cap(
                    index, text, MAX_TEXT_BYTES, "MAX_TEXT_BYTES", "bytes of PNG text (keys + values)"
                )
        if kind == b"IEND":
            return
        pos += 12 + length


def _scan_jpeg(data: bytes, index: int) -> None:
    segments = ancillary = 0
    pos = 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        segments += 1
        _require_under_cap(
            index, segments, MAX_IMAGE_CHUNKS, "MAX_IMAGE_CHUNKS", "JPEG segments before its image data"
        )
        if marker == 0xDA:  # start of scan: the entropy-coded data (and later scans) follow
            break
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker in _JPEG_ANCILLARY:
            ancillary += length
            _require_under_cap(
                index,
                ancillary,
                MAX_ANCILLARY_BYTES,
                "MAX_ANCILLARY_BYTES",
                "bytes of JPEG APPn/COM segments",
            )
        pos += 2 + length
    # 0xFF inside entropy-coded data is always followed by 0x00, so every FF DA is a real scan
    scans = data.count(b"\xff\xda", pos)
    _require_under_cap(index, scans, MAX_JPEG_SCANS, "MAX_JPEG_SCANS", "JPEG scans")


def scan_image_structure(data: bytes, fmt: str, index: int) -> None:
    """Walk a PNG's chunk headers or a JPEG's segment headers (no pixel data) and refuse, with a 413
    naming the cap, a file with too many chunks or segments, ancillary bytes or text.

    Args:
        data: The file bytes (its header already read: ``fmt`` is ``"PNG"`` or ``"JPEG"``).
        fmt: The format.
        index: Position in the request, used in errors.
    """
    if fmt == "PNG":
        _scan_png(data, index)
    else:
        _scan_jpeg(data, index)


# ------------------------------------------------------------------------ msgpack, scanned as it arrives
def _fixed(size: int) -> tuple[str, int, int]:
    return ("scalar", 0, size)


# first byte → (kind, bytes of the length field, fixed payload bytes); fix* ranges are filled below
_MSGPACK: dict[int, tuple[str, int, int]] = {
    0xC0: _fixed(0), 0xC2: _fixed(0), 0xC3: _fixed(0),
    0xC4: ("bin", 1, 0), 0xC5: ("bin", 2, 0), 0xC6: ("bin", 4, 0),
    0xC7: ("ext", 1, 1), 0xC8: ("ext", 2, 1), 0xC9: ("ext", 4, 1),
    0xCA: _fixed(4), 0xCB: _fixed(8), 0xCC: _fixed(1), 0xCD: _fixed(2), 0xCE: _fixed(4), 0xCF: _fixed(8),
    0xD0: _fixed(1), 0xD1: _fixed(2), 0xD2: _fixed(4), 0xD3: _fixed(8),
    0xD4: _fixed(2), 0xD5: _fixed(3), 0xD6: _fixed(5), 0xD7: _fixed(9), 0xD8: _fixed(17),
    0xD9: ("str", 1, 0), 0xDA: ("str", 2, 0), 0xDB: ("str", 4, 0),
    0xDC: ("array", 2, 0), 0xDD: ("array", 4, 0), 0xDE: ("map", 2, 0), 0xDF: ("map", 4, 0),
}  # fmt: skip
_MSGPACK_SLICE = 16 * 1024  # bytes scanned between yields to the event loop (≤ ~10 ms of tokens)


def _fill_header(buffer: bytearray, data: bytes, pos: int, size: int) -> tuple[int, bytes | None]:
    """Move up to ``size − len(buffer)`` bytes of ``data[pos:]`` into ``buffer`` (a header that may arrive
    split over several slices); the new position, and the whole header once ``buffer`` holds ``size``
    bytes (``buffer`` is then emptied for the next one), else None."""
    piece = data[pos : pos + size - len(buffer)]
    buffer += piece
    pos += len(piece)
    if len(buffer) < size:
        return pos, None
    head = bytes(buffer)
    buffer.clear()
    return pos, head


class _StreamingImageScan:
    """The chunk (PNG) or segment (JPEG) headers of one image file, walked as its bytes arrive: the
    counts of :func:`scan_image_structure` that need no chunk data (chunks/segments, ancillary bytes,
    ``tEXt`` bytes). Compressed text and JPEG scans are left to the full scan after parsing."""

    _HEADER = {"magic": 2, "png_signature": 6, "png": 8, "jpeg": 4}

    def __init__(self, index: int) -> None:
        self.index = index
        self.stage = "magic"
        self.head = bytearray()  # the bytes of the header being read
        self.skip = 0  # bytes of chunk/segment data (and CRC) still to pass over
        self.chunks = self.ancillary = self.text = 0

    def feed(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data) and self.stage != "done":
            if self.skip:
                step = min(self.skip, len(data) - pos)
                self.skip -= step
                pos += step
                continue
            size = self._HEADER[self.stage]
            pos, head = _fill_header(self.head, data, pos, size)
            if head is not None:
                self._header(head)

    def _header(self, head: bytes) -> None:
        if self.stage == "magic":  # not PNG/JPEG: the header check after parsing answers 415
            self.stage = {b"\x89P": "png_signature", b"\xff\xd8": "jpeg"}.get(head, "done")
        elif self.stage == "png_signature":
            self.stage = "png" if head == b"NG\r\n\x1a\n" else "done"
        elif self.stage == "png":
            self._png_chunk(head)
        else:
            self._jpeg_segment(head)

    def _png_chunk(self, head: bytes) -> None:
        length, kind = struct.unpack(">I4s", head)
        self.chunks += 1
        _require_under_cap(self.index, self.chunks, MAX_IMAGE_CHUNKS, "MAX_IMAGE_CHUNKS", "PNG chunks")
        if kind[0] & 0x20:
            self.ancillary += length
            _require_under_cap(
                self.index,
                self.ancillary,
                MAX_ANCILLARY_BYTES,
                "MAX_ANCILLARY_BYTES",
                "bytes of ancillary PNG chunks",
            )
            if kind == b"tEXt":
                self.text += length
                _require_under_cap(
                    self.index,
                    self.text,
                    MAX_TEXT_BYTES,
                    "MAX_TEXT_BYTES",
                    "bytes of PNG text (keys + values)",
                )
        self.stage = "done" if kind == b"IEND" else "png"
        self.skip = length + 4  # data and CRC

    def _jpeg_segment(self, head: bytes) -> None:
        if head[0] != 0xFF or head[1] in (0xDA, 0xD9, 0xFF):
            self.stage = "done"  # start of scan, end, fill bytes or no marker: the full scan takes over
            return
        self.chunks += 1
        _require_under_cap(
            self.index,
            self.chunks,
            MAX_IMAGE_CHUNKS,
            "MAX_IMAGE_CHUNKS",
            "JPEG segments before its image data",
        )
        length = int.from_bytes(head[2:4], "big")
        if head[1] in _JPEG_ANCILLARY:
            self.ancillary += length
            _require_under_cap(
                self.index,
                self.ancillary,
                MAX_ANCILLARY_BYTES,
                "MAX_ANCILLARY_BYTES",
                "bytes of JPEG APPn/COM segments",
            )
        self.skip = max(length - 2, 0)


@dataclass
class _Open:
    """An open msgpack container: values still to come (a map's keys and values each count), whether
    it is a map, the top-level key it is the value of (``None`` elsewhere), how many values it holds."""

    remaining: int
    is_map: bool
    key: bytes | None
    size: int


class MsgpackScanner:
    """Walks a msgpack body's token headers as it arrives, without building anything, and refuses it
    (413) at the first cap it passes, before the rest is read or parsed:

    * items: every container counts its length + 1, as the parser's own count (``_ItemCounter``) does;
    * the structure of each file in the top-level ``images`` list (:class:`_StreamingImageScan`).

    A byte that is not msgpack, or anything after the top-level value, ends the walk: the parser then
    answers. Memory: a few small buffers and one entry per open container.
    """

    def __init__(self, max_items: int) -> None:
        self.limit, self.count = max_items, 0
        self.head = bytearray()  # the bytes of the token header being read
        self.skip = 0  # payload bytes (strings, binaries, fixed scalars) still to pass over
        self.image: _StreamingImageScan | None = None  # the file whose bytes are passing
        self.key: bytearray | None = None  # a top-level key being read
        self.last_key: bytes | None = None
        self.stack: list[_Open] = []
        self.done = False

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Walk ``chunk``; raises a 413 :class:`WireError` naming the cap it passes."""
        data = memoryview(chunk).cast("B") if not isinstance(chunk, memoryview) else chunk.cast("B")
        pos = 0
        while pos < len(data) and not self.done:
            if self.skip:
                step = min(self.skip, len(data) - pos)
                if self.image is not None:
                    self.image.feed(data[pos : pos + step])
                elif self.key is not None:
                    self.key += data[pos : pos + step]
                self.skip -= step
                pos += step
                if not self.skip:
                    self._payload_done()
                continue
            if not self.head:
                self.head.append(data[pos])
                pos += 1
            size = self._header_size(self.head[0])
            if size is None:
                self.done = True  # not msgpack (0xc1): the parser says so
                return
            pos, head = _fill_header(self.head, data, pos, size)
            if head is not None:
                self._token(head)

    @staticmethod
    def _header_size(first: int) -> int | None:
        if first <= 0xBF or first >= 0xE0:
            return 1  # fixint, fixmap, fixarray, fixstr
        entry = _MSGPACK.get(first)
        return None if entry is None else 1 + entry[1]

    def _at_top_key(self) -> bool:
        return len(self.stack) == 1 and self.stack[0].is_map and self.stack[0].remaining % 2 == 0

    def _token(self, head: bytes) -> None:
        first = head[0]
        at_key = self._at_top_key()
        if at_key:
            self.last_key = None
        if first <= 0x7F or first >= 0xE0:
            self._value_done()
        elif first <= 0x8F:
            self._open(first & 0x0F, is_map=True)
        elif first <= 0x9F:
            self._open(first & 0x0F, is_map=False)
        elif first <= 0xBF:
            self._payload("str", first & 0x1F, at_key)
        else:
            kind, _, fixed = _MSGPACK[first]
            n = int.from_bytes(head[1:], "big")
            if kind in ("array", "map"):
                self._open(n, is_map=kind == "map")
            else:
                self._payload(kind, fixed if kind == "scalar" else n + fixed, at_key)

    def _payload(self, kind: str, n: int, at_key: bool) -> None:
        frame = self.stack[-1] if self.stack else None
        if kind == "bin" and len(self.stack) == 2 and not frame.is_map and frame.key == b"images":
            self.image = _StreamingImageScan(frame.size - frame.remaining)
        elif kind == "str" and at_key and n <= 64:
            self.key = bytearray()
        self.skip = n
        if not n:
            self._payload_done()

    def _payload_done(self) -> None:
        if self.key is not None:
            self.last_key = bytes(self.key)
            self.key = None
        self.image = None
        self._value_done()

    def _open(self, n: int, is_map: bool) -> None:
        self.count += n + 1
        if self.count > self.limit:
            raise _too_many(self.limit, f"more than {self.limit} counted before the body ended")
        top = self.stack[0] if len(self.stack) == 1 else None
        key = self.last_key if top is not None and top.is_map and top.remaining % 2 == 1 else None
        self.stack.append(_Open(2 * n if is_map else n, is_map, key, n))
        if not n:
            self.stack.pop()
            self._value_done()

    def _value_done(self) -> None:
        while self.stack:
            frame = self.stack[-1]
            frame.remaining -= 1
            if frame.remaining:
                return
            self.stack.pop()
        self.done = True  # the top-level value is complete
