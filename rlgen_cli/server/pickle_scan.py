"""A Flow-GRPO pickle body walked as it arrives (``server.flowgrpo_protocol``), as
:class:`~rlgen_cli.server.limits.MsgpackScanner` walks a msgpack one: before the body is complete and
before :func:`~rlgen_cli.server.plain_pickle.load_plain` builds anything, each file of the request's
top-level ``images`` list has its PNG chunk / JPEG segment headers walked against the structure caps
(:class:`~rlgen_cli.server.limits._StreamingImageScan`), and the opcodes are counted against the
parser's own budget (``OPS_PER_ITEM × server.max_request_items``). A chunk flood is then refused (413)
within the bytes that pass its cap, not after the whole body has been read and unpickled.

Nothing is built: the walk keeps one small tag per value on the pickle stack (bounded by the opcode
budget) and a few header bytes. An opcode outside the plain-data set, a malformed stream or anything
after STOP ends the walk; the parser then answers with its own 400. Each image's size and the full
structure scan still run after parsing, as for the native wire.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rlgen_cli.server.limits import _fill_header, _StreamingImageScan  # the msgpack scanner's pieces
from rlgen_cli.server.plain_pickle import opcode_budget, too_many_opcodes

__all__ = ["PickleScanner"]

_KEY_CHARS = 64  # a str this short is kept: it may be the top-level key "images"

# opcode → bytes of its fixed argument (no payload after it)
_FIXED = {
    0x80: 1, 0x95: 8, ord("J"): 4, ord("K"): 1, ord("M"): 2, ord("G"): 8,  # PROTO FRAME BININT* BINFLOAT
    ord("q"): 1, ord("r"): 4, ord("h"): 1, ord("j"): 4,  # BINPUT LONG_BINPUT BINGET LONG_BINGET
}  # fmt: skip
# opcode → (kind, struct format of its length field); a payload of that many bytes follows
_SIZED = {
    0x8A: ("int", "<B"), 0x8B: ("int", "<i"),  # LONG1 LONG4
    ord("X"): ("str", "<I"), 0x8C: ("str", "<B"), 0x8D: ("str", "<Q"),  # BINUNICODE SHORT_ BINUNICODE8
    ord("B"): ("bytes", "<I"), ord("C"): ("bytes", "<B"), 0x8E: ("bytes", "<Q"),  # BINBYTES SHORT_ BINBYTES8
}  # fmt: skip
_BARE = frozenset(b".(012N]lae}dsu)t\x85\x86\x87\x88\x89\x94")  # the plain-data opcodes without an argument


@dataclass
class _List:
    """A list on the stack; ``images``: the value of the top-level dict's ``images`` key."""

    images: bool


_MARK, _DICT, _TOP_DICT, _IMAGE, _OTHER = "mark", "dict", "top dict", "image", "other"


class PickleScanner:
    """Feed the body's pieces as they arrive (``feed``); raises a 413 :class:`WireError` at the first cap
    passed. ``done`` once the walk ended (STOP, or something the parser is left to answer)."""

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self.max_ops = opcode_budget(max_items)
        self.ops = 0
        self.head = bytearray()  # the opcode and argument bytes being read
        self.skip = 0  # payload bytes still to pass over
        self.payload: tuple[str, int] | None = None  # (kind, length) of the payload passing
        self.text: bytearray | None = None  # a short str payload being kept
        self.image: _StreamingImageScan | None = None  # the image file whose bytes are passing
        self.images = 0  # image files seen
        self.stack: list[object] = []
        self.memo: dict[int, object] = {}
        self.done = False

    # ------------------------------------------------------------------------------------- reading
    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        data = memoryview(chunk).cast("B") if not isinstance(chunk, memoryview) else chunk.cast("B")
        pos = 0
        while pos < len(data) and not self.done:
            if self.skip:
                step = min(self.skip, len(data) - pos)
                piece = data[pos : pos + step]
                if self.image is not None:
                    self.image.feed(piece)
                elif self.text is not None:
                    self.text += piece
                self.skip -= step
                pos += step
                if not self.skip:
                    self._payload_done()
                continue
            if not self.head:
                self._opcode(data[pos])
                pos += 1
                if self.done or not self.head:
                    continue
            pos, head = _fill_header(self.head, data, pos, self._header_size(self.head[0]))
            if head is not None:
                self._argument(head)

    def _opcode(self, op: int) -> None:
        self.ops += 1
        if self.ops > self.max_ops:
            raise too_many_opcodes(self.max_items)
        if op in _FIXED or op in _SIZED:
            self.head.append(op)  # its argument follows
        elif op in _BARE:
            self._bare(op)
        else:
            self.done = True  # not plain data: the parser names it

    @staticmethod
    def _header_size(op: int) -> int:
        if op in _FIXED:
            return 1 + _FIXED[op]
        return 1 + struct.calcsize(_SIZED[op][1])

    def _argument(self, head: bytes) -> None:
        op = head[0]
        if op in _FIXED:
            self._fixed(op, head[1:])
            return
        kind, fmt = _SIZED[op]
        length = struct.unpack(fmt, head[1:])[0]
        if length < 0:
            self.done = True  # LONG4 with a negative length: the parser refuses it
            return
        self.payload = (kind, length)
        if kind == "bytes" and self._opens_image():
            self.image = _StreamingImageScan(self.images)
            self.images += 1
        elif kind == "str" and length <= _KEY_CHARS:
            self.text = bytearray()
        self.skip = length
        if not length:
            self._payload_done()

    def _payload_done(self) -> None:
        kind, _ = self.payload
        if kind == "bytes":
            self.stack.append(_IMAGE if self.image is not None else _OTHER)
        elif kind == "str" and self.text is not None:
            self.stack.append(("str", bytes(self.text)))
        else:
            self.stack.append(_OTHER)
        self.payload = self.image = self.text = None

    # ------------------------------------------------------------------------------------- the stack
    def _opens_image(self) -> bool:
        """Whether a bytes value read now goes into the ``images`` list: the list is on top, or only a
        MARK and earlier images lie above it (APPEND / APPENDS come after)."""
        for tag in reversed(self.stack):
            if isinstance(tag, _List):
                return tag.images
            if tag not in (_MARK, _IMAGE):
                return False
        return False

    def _is_images_key(self) -> bool:
        """The stack holds the top-level dict, perhaps a MARK, and the key ``"images"``."""
        stack = self.stack
        return (
            len(stack) in (2, 3)
            and stack[0] == _TOP_DICT
            and stack[-1] == ("str", b"images")
            and (len(stack) == 2 or stack[1] == _MARK)
        )

    def _pop(self, n: int) -> None:
        if len(self.stack) < n:
            self.done = True  # the parser refuses the underflow
            return
        del self.stack[len(self.stack) - n :]

    def _pop_mark(self) -> None:
        for at in range(len(self.stack) - 1, -1, -1):
            if self.stack[at] == _MARK:
                del self.stack[at:]
                return
        self.done = True  # no MARK open: the parser refuses it

    def _fixed(self, op: int, arg: bytes) -> None:
        if op in (0x80, 0x95):  # PROTO, FRAME: nothing on the stack
            return
        if op in (ord("q"), ord("r")):  # BINPUT, LONG_BINPUT
            if self.stack:
                self.memo[int.from_bytes(arg, "little")] = self.stack[-1]
            return
        if op in (ord("h"), ord("j")):  # BINGET, LONG_BINGET: the tag stored (a list repeats as other)
            if self._opens_image():  # a file sent twice: walked the first time, counted each time
                self.images += 1
                self.stack.append(_IMAGE)
                return
            tag = self.memo.get(int.from_bytes(arg, "little"), _OTHER)
            self.stack.append(_OTHER if isinstance(tag, _List) else tag)
            return
        self.stack.append(_OTHER)  # BININT*, BINFLOAT

    def _bare(self, op: int) -> None:
        push, char = self.stack.append, chr(op)
        if char == ".":
            self.done = True
        elif char == "(":
            push(_MARK)
        elif char == "0":
            self._pop(1)
        elif char == "1":
            self._pop_mark()
        elif char == "2":
            push(self.stack[-1] if self.stack else _OTHER)
        elif op == 0x94:  # MEMOIZE
            if self.stack:
                self.memo[len(self.memo)] = self.stack[-1]
        elif char == "]":
            push(_List(images=self._is_images_key()))
        elif char == "}":
            push(_TOP_DICT if not self.stack else _DICT)
        elif char in "ld":  # LIST, DICT from the items above a MARK
            self._pop_mark()
            push(_List(images=False) if char == "l" else _DICT)
        elif char == "t":
            self._pop_mark()
            push(_OTHER)
        elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
            self._pop(op - 0x84)
            push(_OTHER)
        elif char == "a":
            self._pop(1)
        elif char == "s":
            self._pop(2)
        elif char in "eu":  # APPENDS, SETITEMS
            self._pop_mark()
        else:  # N, NEWTRUE, NEWFALSE, EMPTY_TUPLE
            push(_OTHER)
