"""``load_plain``: what Python's pickler writes for plain data loads unchanged; everything else is refused
before it is built, and the item count matches msgpack's for the same data."""

from __future__ import annotations

import pickle
import struct

import msgpack
import pytest

from rlgen_cli.rewards.remote.wire import WireError
from rlgen_cli.server import limits
from rlgen_cli.server.plain_pickle import MAX_INT_BYTES, OPS_PER_ITEM, load_plain

SHARED = {"tag": "colors", "n": 2}
PLAIN = {
    "images": [b"\xff\xd8\xff" + bytes(300), b""],
    "meta_datas": [SHARED, SHARED, {"nested": [[1, -2], {"k": (3, 4.5, None)}], "ok": True, "no": False}],
    "text": "ünïcödé € 😀 " * 30,  # > 255 bytes: BINUNICODE, not SHORT_BINUNICODE
    "ints": [0, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31), 2**31, 2**200, -(2**200)],
    "floats": [0.0, -0.0, 1e-310, 1.5e300, float("inf")],
    "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
    (1, "tuple key"): "value",
    "long_list": list(range(2500)),  # several APPENDS batches
}


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_python_pickles_of_plain_data_load_unchanged(protocol):
    assert load_plain(pickle.dumps(PLAIN, protocol=protocol), 100_000, 8) == PLAIN
    nan = load_plain(pickle.dumps([float("nan")], protocol=protocol), 10, 2)[0]
    assert nan != nan


def _refusal(body: bytes, max_items: int = 1000, max_depth: int = 8) -> WireError:
    with pytest.raises(WireError) as caught:
        load_plain(body, max_items, max_depth)
    return caught.value


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"\x80\x04\x8c\x02os\x8c\x06system\x93.", "STACK_GLOBAL at byte 14 ('os.system')"),
        (b"cos\nsystem\n.", "GLOBAL at byte 0 ('os.system')"),
        (b"\x80\x04N)R.", "REDUCE"),
        (b"\x80\x04}Nb.", "BUILD"),
        (b"(ios\nsystem\n.", "INST"),
        (b"\x80\x02(N)o.", "OBJ"),
        (b"\x80\x02N)\x81.", "NEWOBJ"),
        (b"\x80\x04N)}\x92.", "NEWOBJ_EX"),
        (b"\x80\x02\x82\x01.", "EXT1"),
        (b"\x80\x02\x83\x01\x00.", "EXT2"),
        (b"\x80\x02\x84\x01\x00\x00\x00.", "EXT4"),
        (b"Pid\n.", "PERSID"),
        (b"\x80\x02NQ.", "BINPERSID"),
        (b"\x80\x04\x8f.", "EMPTY_SET"),
        (b"\x80\x04(\x91.", "FROZENSET"),
        (b"\x80\x05\x96\x00\x00\x00\x00\x00\x00\x00\x00.", "BYTEARRAY8"),
        (b"\x80\x05\x97.", "NEXT_BUFFER"),
        (b"I1\n.", "INT at byte 0 is protocol 0"),
        (b"Vabc\n.", "UNICODE"),
        (b"\x80\x02U\x01a.", "Python 2 string"),
        (b"\x80\x04\xff.", "0xff, not a pickle opcode"),
        (b"\x80\x06N.", "protocol 6 is unknown"),
    ],
)
def test_opcodes_beyond_plain_data_are_refused_by_name(body, needle):
    error = _refusal(body)
    assert error.status == 400 and needle in str(error), str(error)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"", "ends at byte 0 without its STOP"),
        (
            b"\x80\x04\x8e" + struct.pack("<Q", 2**64 - 1),
            "declares 18446744073709551615 bytes but 0 are left",
        ),
        (b"\x80\x04X\x05\x00\x00\x00ab.", "declares 5 bytes but 3 are left"),
        (b"\x80\x04\x8a\x41" + bytes(65) + b".", f"at most {MAX_INT_BYTES}"),
        (b"\x80\x04X\x01\x00\x00\x00\xff.", "not valid UTF-8"),
        (b"\x80\x04h\x03.", "never stored"),
        (b"\x80\x04a.", "pops an empty stack"),
        (b"\x80\x04e.", "needs a MARK"),
        (b"\x80\x04K\x01K\x02a.", "targets a int, not a list"),
        (b"\x80\x04NN.", "the stack holds 2 values"),
        (b"\x80\x04N.N", "1 bytes follow the STOP"),
        (b"\x80\x04}]K\x01s.", "a dict key is a list"),
        (b"\x80\x04]\x94h\x00a.", "holds itself"),
        (b"\x80\x04]\x94]\x94h\x00a0K\x01a.", "not being built"),  # L1 into L2, then L1 changes
    ],
)
def test_malformed_streams_are_refused_saying_why(body, needle):
    error = _refusal(body)
    assert error.status == 400 and needle in str(error), str(error)


def _msgpack_count(value) -> int:
    """Items msgpack's bounded parser counts for ``value`` (the native wire's rule)."""
    counter = limits._ItemCounter(10**9)
    msgpack.unpackb(msgpack.packb(value), list_hook=counter, object_hook=counter, raw=False)
    return counter.count


@pytest.mark.parametrize(
    "value",
    [
        {"a": "v"},  # hand count: the map (1) and its entry (1) = 2
        [{"a": "v", "b": "v"}],  # 1 + 1 + (1 + 2) = 5
        {"m": [SHARED] * 3, "k": [[1, 2], [3]]},  # a shared map counts at each reference
        {"images": [b"x"] * 4, "meta_datas": [{"include": [{"class": "dog", "count": 1}]}] * 2},
    ],
)
def test_items_are_counted_as_msgpack_counts_them(value):
    count = _msgpack_count(value)
    assert load_plain(pickle.dumps(value), count, 8) == value
    error = _refusal(pickle.dumps(value), max_items=count - 1)
    assert error.status == 413 and f"server.max_request_items={count - 1}" in str(error)


def test_hand_counts():
    assert _msgpack_count({"a": "v"}) == 2 and _msgpack_count([{"a": "v", "b": "v"}]) == 5


def test_shared_references_cannot_multiply_past_the_cap():
    # x0 = [1]; x(i) = [x(i-1), x(i-1)]: 40 levels would be 2^40 items as a tree, in 330 bytes
    body = b"\x80\x04]K\x01a\x94" + b"".join(b"0](h%ch%ce\x94" % (i, i) for i in range(40)) + b"."
    error = _refusal(body, max_items=250_000, max_depth=64)
    assert error.status == 413 and "a memo reference counts what it repeats" in str(error)


def test_depth_and_opcode_budgets():
    deep = b"\x80\x04" + b"]" * 10 + b"a" * 9 + b"."
    assert load_plain(deep, 100, 10) == [[[[[[[[[[]]]]]]]]]]
    assert _refusal(deep, max_depth=9).status == 413
    assert _refusal(b"\x80\x04K\x01" + b"\x85" * 10 + b".", max_depth=9).status == 413
    flood = b"\x80\x04" + b"N0" * (OPS_PER_ITEM * 10) + b"N."
    error = _refusal(flood, max_items=10)
    assert error.status == 413 and f"more than {OPS_PER_ITEM * 10} opcodes" in str(error)
