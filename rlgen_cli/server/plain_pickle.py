"""A pickle reader that builds plain data only: dict, list, tuple, str, bytes, int, float, bool and None.

Flow-GRPO's reward clients POST a pickle (:mod:`rlgen_cli.server.flowgrpo`). :class:`pickle.Unpickler`
with a restricted ``find_class`` would still run the C unpickler over hostile input (its memo lets a
small body reference one object millions of times, or nest containers without bound), so this module
interprets the opcodes itself and knows only those that build the types above:

* every opcode that reaches Python objects — ``GLOBAL``, ``STACK_GLOBAL``, ``REDUCE``, ``BUILD``,
  ``INST``, ``OBJ``, ``NEWOBJ``, ``NEWOBJ_EX``, ``EXT1/2/4``, ``PERSID``, ``BINPERSID`` — and those of
  other types (sets, bytearrays, out-of-band buffers), Python 2 strings and protocol 0's text opcodes
  are refused with a 400 naming the opcode; nothing is ever looked up, imported or called;
* every length is checked against the bytes left before anything is sliced (a truncated stream or a
  declared length of 2⁶⁴ is a 400), integers are at most ``MAX_INT_BYTES`` long;
* work is bounded while it is done: each list element, map entry and container counts against
  ``max_items`` — a memo reference counts the whole object it repeats, so shared sub-trees cannot
  multiply — and each opcode against ``OPS_PER_ITEM × max_items``; containers nest at most
  ``max_depth`` deep; past a cap the answer is a 413 naming it;
* a list or dict cannot change once it is inside another container, nor be put inside itself, so the
  result is a finite tree (no cycles) whose depth and size are what was counted.

Pickles written by Python 3's ``pickle.dumps`` with protocol 3 or newer (the default is 4 or 5) of
such data load unchanged; protocols 0–2 store ``bytes`` through a global and are refused.
"""

from __future__ import annotations

import pickletools
import struct
from dataclasses import dataclass
from typing import Any

from rlgen_cli.rewards.remote.wire import WireError

__all__ = ["MAX_INT_BYTES", "OPS_PER_ITEM", "PLAIN_TYPES", "load_plain", "opcode_budget", "too_many_opcodes"]

PLAIN_TYPES = "dict, list, tuple, str, bytes, int, float, bool and None"
MAX_INT_BYTES = 64  # LONG1/LONG4 payload: a 512-bit integer is plenty for metadata
OPS_PER_ITEM = 8  # opcode budget per item: a map entry of strings takes ~4 (key, memo, value, memo)
_HIGHEST_PROTOCOL = 5
_NAME_CHARS = 80  # of a refused global's name quoted back in the error

_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_OBJECT_OPCODES = frozenset(
    b"c\x93Rbio\x81\x92\x82\x83\x84PQ"
)  # GLOBAL STACK_GLOBAL REDUCE BUILD INST OBJ NEWOBJ NEWOBJ_EX EXT1 EXT2 EXT4 PERSID BINPERSID
_TEXT_OPCODES = frozenset(b"ILFSVpg")  # protocol 0: INT LONG FLOAT STRING UNICODE PUT GET
_PY2_STRINGS = frozenset(b"TU")  # BINSTRING SHORT_BINSTRING


def _refused(message: str, status: int = 400) -> WireError:
    return WireError(f"pickle body refused: {message}", status=status)


def opcode_budget(max_items: int) -> int:
    """Opcodes a body may run: ``OPS_PER_ITEM`` per item of ``server.max_request_items``."""
    return OPS_PER_ITEM * max_items


def too_many_opcodes(max_items: int) -> WireError:
    """The 413 of a body past :func:`opcode_budget` (the parser's and the arriving body's scanner's)."""
    return _refused(
        f"it runs more than {opcode_budget(max_items)} opcodes ({OPS_PER_ITEM} per item of "
        f"server.max_request_items={max_items}); send fewer images or less metadata",
        status=413,
    )


@dataclass
class _Shape:
    """What is known of a container built so far: nesting depth, size in items, whether it is sealed
    (placed inside another container: it may no longer change)."""

    depth: int
    size: int
    sealed: bool


_MARK = object()  # what MARK pushes on the stack


class _Machine:
    """The pickle virtual machine restricted to plain data (see the module docstring)."""

    def __init__(self, body: memoryview, max_items: int, max_depth: int) -> None:
        self.data, self.pos = body, 0
        self.max_items, self.max_depth = max_items, max_depth
        self.max_ops = opcode_budget(max_items)
        self.items = self.ops = 0
        self.stack: list[Any] = []
        self.marks: list[int] = []  # stack heights at each MARK
        self.memo: dict[int, Any] = {}
        self.shapes: dict[int, _Shape] = {}  # id(container) → its shape
        self.alive: list[Any] = []  # every container made: keeps ids unique while the machine runs
        self.handlers = self._handlers()

    # ------------------------------------------------------------------------------------- reading
    def _take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > len(self.data) - self.pos:
            raise _refused(
                f"{what} at byte {self.pos} declares {n} bytes but {len(self.data) - self.pos} are left "
                "(a truncated or corrupt pickle)"
            )
        piece = self.data[self.pos : self.pos + n]
        self.pos += n
        return piece

    def _unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), what))[0]

    # ------------------------------------------------------------------------------------- counting
    def _count(self, n: int) -> None:
        self.items += n
        if self.items > self.max_items:
            raise _refused(
                f"it builds more than {self.max_items} items (list elements, map entries, containers; a "
                f"memo reference counts what it repeats), above server.max_request_items={self.max_items}; "
                "send fewer images or less metadata per request",
                status=413,
            )

    def _check_depth(self, depth: int) -> None:
        if depth > self.max_depth:
            raise _refused(
                f"it nests containers more than {self.max_depth} deep (server.max_metadata_depth + 2); "
                "flatten the metadata",
                status=413,
            )

    def _new(self, container: Any, depth: int = 1, size: int = 1, sealed: bool = False) -> Any:
        self._check_depth(depth)
        self.shapes[id(container)] = _Shape(depth, size, sealed)
        self.alive.append(container)
        self._count(1)
        return container

    def _measure(self, value: Any) -> tuple[int, int, int]:
        """``(depth, size, cost)`` of a value about to fill a slot of a container, and seal it. ``size``
        is what the value holds (0 for a scalar; for a container itself and its slots, as msgpack's
        count has it); ``cost`` is what filling the slot adds to the count: the slot, and for a repeat
        (a memo reference to a sealed container) all it holds again — a fresh container's contents
        were counted as they went in."""
        shape = self.shapes.get(id(value))
        if shape is None:
            return 0, 0, 1
        repeat, shape.sealed = shape.sealed, True
        return shape.depth, shape.size, 1 + (shape.size if repeat else 0)

    def _place(self, parent: Any, values: list[Any], pairs: bool = False) -> None:
        """Account for ``values`` going into the list or dict ``parent`` (``pairs``: key, value, …; an
        entry is one slot, counted with its value)."""
        shape = self.shapes.get(id(parent))
        if shape is None or shape.sealed:
            raise _refused(
                "it adds to a list or dict that is not being built (already inside another container); "
                "only trees of plain data are accepted"
            )
        for i, value in enumerate(values):
            if value is parent:
                raise _refused("a container holds itself; only trees of plain data are accepted")
            depth, size, cost = self._measure(value)
            self._check_depth(depth + 1)
            slot = 0 if pairs and i % 2 == 0 else 1
            shape.depth = max(shape.depth, depth + 1)
            shape.size += slot + size
            self._count(cost - 1 + slot)

    def _tuple(self, values: list[Any]) -> tuple:
        depth = size = cost = 0
        for value in values:
            d, s, c = self._measure(value)
            depth, size, cost = max(depth, d), size + 1 + s, cost + c
        self._count(cost)
        return self._new(tuple(values), depth + 1, size + 1)

    # ------------------------------------------------------------------------------------- stack
    def _pop_mark(self) -> list[Any]:
        if not self.marks:
            raise _refused(f"an opcode at byte {self.pos - 1} needs a MARK and none is open")
        height = self.marks.pop()
        items = self.stack[height:]
        del self.stack[height:]
        return items

    def _pop(self, n: int = 1) -> list[Any]:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) - floor < n:
            raise _refused(f"an opcode at byte {self.pos - 1} pops an empty stack")
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def _peek(self) -> Any:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) <= floor:
            raise _refused(f"an opcode at byte {self.pos - 1} reads an empty stack")
        return self.stack[-1]

    # ------------------------------------------------------------------------------------- opcodes
    def _handlers(self) -> dict[int, Any]:
        push = self.stack.append

        def proto() -> None:
            version = self._take(1, "PROTO")[0]
            if version > _HIGHEST_PROTOCOL:
                raise _refused(f"pickle protocol {version} is unknown (0–{_HIGHEST_PROTOCOL})")

        def frame() -> None:
            size = self._unpack("<Q", "FRAME")
            if size > len(self.data) - self.pos:
                left = len(self.data) - self.pos
                raise _refused(
                    f"a FRAME declares {size} bytes but {left} are left (a truncated or corrupt pickle)"
                )

        def integer(fmt: str, name: str) -> Any:
            return lambda: push(self._unpack(fmt, name))

        def long(fmt: str, name: str) -> Any:
            def load() -> None:
                n = self._unpack(fmt, name)
                if n > MAX_INT_BYTES:
                    raise _refused(f"an integer of {n} bytes ({name}); at most {MAX_INT_BYTES} are accepted")
                push(int.from_bytes(self._take(n, name), "little", signed=True))

            return load

        def text(fmt: str, name: str) -> Any:
            def load() -> None:
                at = self.pos
                raw = self._take(self._unpack(fmt, name), name)
                try:
                    push(str(raw, "utf-8"))
                except UnicodeDecodeError as err:
                    raise _refused(f"the string at byte {at} is not valid UTF-8 ({err.reason})") from err

            return load

        def binary(fmt: str, name: str) -> Any:
            return lambda: push(bytes(self._take(self._unpack(fmt, name), name)))

        def memo_put(fmt: str | None) -> Any:
            def put() -> None:
                key = len(self.memo) if fmt is None else self._unpack(fmt, "BINPUT")
                self.memo[key] = self._peek()

            return put

        def memo_get(fmt: str) -> Any:
            def get() -> None:
                key = self._unpack(fmt, "BINGET")
                if key not in self.memo:
                    raise _refused(
                        f"a memo reference at byte {self.pos} names entry {key}, which was never stored"
                    )
                push(self.memo[key])

            return get

        def mark() -> None:
            self.marks.append(len(self.stack))

        def appends() -> None:
            values = self._pop_mark()
            target = self._peek()
            if not isinstance(target, list):
                raise _refused(
                    f"APPENDS at byte {self.pos - 1} targets a {type(target).__name__}, not a list"
                )
            self._place(target, values)
            target.extend(values)

        def append() -> None:
            (value,) = self._pop()
            target = self._peek()
            if not isinstance(target, list):
                raise _refused(f"APPEND at byte {self.pos - 1} targets a {type(target).__name__}, not a list")
            self._place(target, [value])
            target.append(value)

        def set_items(pairs: list[Any]) -> None:
            target = self._peek()
            if not isinstance(target, dict) or len(pairs) % 2:
                raise _refused(f"a SETITEM(S) at byte {self.pos - 1} does not set key/value pairs of a dict")
            self._place(target, pairs, pairs=True)
            for key, value in zip(pairs[::2], pairs[1::2], strict=True):
                try:
                    target[key] = value
                except TypeError as err:  # an unhashable key: a list or dict
                    raise _refused(f"a dict key is a {type(key).__name__} ({err})") from err

        def new_dict(pairs: list[Any]) -> None:
            push(self._new({}))
            set_items(pairs)

        def new_list(values: list[Any]) -> None:
            push(self._new([]))
            self._place(self.stack[-1], values)
            self.stack[-1].extend(values)

        def pop() -> None:
            if self.marks and len(self.stack) == self.marks[-1]:
                self.marks.pop()  # POP of a MARK, as pickle does
            else:
                self._pop()

        def stop() -> None:
            raise _Stop

        return {
            0x80: proto,
            0x95: frame,
            ord("."): stop,
            ord("("): mark,
            ord("0"): pop,
            ord("1"): self._pop_mark,
            ord("2"): lambda: push(self._peek()),
            ord("N"): lambda: push(None),
            0x88: lambda: push(True),
            0x89: lambda: push(False),
            ord("J"): integer("<i", "BININT"),
            ord("K"): integer("<B", "BININT1"),
            ord("M"): integer("<H", "BININT2"),
            0x8A: long("<B", "LONG1"),
            0x8B: long("<i", "LONG4"),
            ord("G"): lambda: push(self._unpack(">d", "BINFLOAT")),
            ord("X"): text("<I", "BINUNICODE"),
            0x8C: text("<B", "SHORT_BINUNICODE"),
            0x8D: text("<Q", "BINUNICODE8"),
            ord("B"): binary("<I", "BINBYTES"),
            ord("C"): binary("<B", "SHORT_BINBYTES"),
            0x8E: binary("<Q", "BINBYTES8"),
            ord("]"): lambda: push(self._new([])),
            ord("l"): lambda: new_list(self._pop_mark()),
            ord("a"): append,
            ord("e"): appends,
            ord("}"): lambda: push(self._new({})),
            ord("d"): lambda: new_dict(self._pop_mark()),
            ord("s"): lambda: set_items(self._pop(2)),
            ord("u"): lambda: set_items(self._pop_mark()),
            ord(")"): lambda: push(self._tuple([])),
            ord("t"): lambda: push(self._tuple(self._pop_mark())),
            0x85: lambda: push(self._tuple(self._pop(1))),
            0x86: lambda: push(self._tuple(self._pop(2))),
            0x87: lambda: push(self._tuple(self._pop(3))),
            ord("q"): memo_put("<B"),
            ord("r"): memo_put("<I"),
            0x94: memo_put(None),
            ord("h"): memo_get("<B"),
            ord("j"): memo_get("<I"),
        }

    def _unknown(self, op: int) -> WireError:
        at = self.pos - 1
        name = _NAMES.get(op)
        if name is None:
            return _refused(f"byte {at} is {op:#04x}, not a pickle opcode")
        if op in _OBJECT_OPCODES:
            return _refused(
                f"opcode {name} at byte {at}{self._global_name(op)} asks for a Python object (a class, a "
                "function or a call; numpy arrays and scalars are ones); this server builds only "
                f"{PLAIN_TYPES}: send lists of plain values (array.tolist())"
            )
        if op in _TEXT_OPCODES:
            return _refused(
                f"opcode {name} at byte {at} is protocol 0's text form; pickle with protocol 3 or newer "
                "(Python 3's default)"
            )
        if op in _PY2_STRINGS:
            return _refused(f"opcode {name} at byte {at} is a Python 2 string; send str or bytes")
        return _refused(f"opcode {name} at byte {at} builds a type other than {PLAIN_TYPES}")

    def _global_name(self, op: int) -> str:
        """`` (module.name)`` of a GLOBAL or STACK_GLOBAL, read as text and never resolved; else ``""``."""
        if op == ord("c"):
            module, name, *_ = bytes(self.data[self.pos : self.pos + 2 * _NAME_CHARS]).split(b"\n") + [b""]
            text = f"{module.decode('latin-1')}.{name.decode('latin-1')}"
        elif op == 0x93 and len(self.stack) >= 2 and all(isinstance(s, str) for s in self.stack[-2:]):
            text = ".".join(self.stack[-2:])
        else:
            return ""
        return f" ({text[:_NAME_CHARS]!r})"

    def run(self) -> Any:
        handlers, data = self.handlers, self.data
        while True:
            if self.pos >= len(data):
                raise _refused(f"the pickle ends at byte {self.pos} without its STOP opcode (truncated)")
            op = data[self.pos]
            self.pos += 1
            self.ops += 1
            if self.ops > self.max_ops:
                raise too_many_opcodes(self.max_items)
            handler = handlers.get(op)
            if handler is None:
                raise self._unknown(op)
            try:
                handler()
            except _Stop:
                return self._result()

    def _result(self) -> Any:
        if self.pos != len(self.data):
            raise _refused(f"{len(self.data) - self.pos} bytes follow the STOP opcode at byte {self.pos - 1}")
        if self.marks or len(self.stack) != 1:
            raise _refused(f"the stack holds {len(self.stack)} values at STOP (one is expected)")
        return self.stack[0]


class _Stop(Exception):
    """The STOP opcode: the value on the stack is the result."""


def load_plain(body: bytes | bytearray | memoryview, max_items: int, max_depth: int) -> Any:
    """Load a pickle that holds only plain data (see the module docstring), never running its code.

    Args:
        body: The pickle's bytes (exactly one pickle, nothing after it).
        max_items: Most list elements, map entries and containers it may build (shared sub-trees
            counted each time they are referenced); ``OPS_PER_ITEM`` times as many opcodes.
        max_depth: Deepest nesting of containers (the top-level value is 1 deep).

    Returns:
        The value: a tree of dict, list, tuple, str, bytes, int, float, bool and None.

    Raises:
        WireError: 400 for anything else (an opcode that reaches Python objects or other types, a
            truncated or malformed stream), 413 past ``max_items``, the opcode budget or ``max_depth``.
    """
    view = memoryview(body).cast("B") if not isinstance(body, memoryview) or body.format != "B" else body
    return _Machine(view, max_items, max_depth).run()
