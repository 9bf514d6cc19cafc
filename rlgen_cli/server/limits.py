"""Bounded parsing of ``/v1/score`` bodies: the structure a body may build is limited while it is parsed.

A small body can describe a huge object graph (a msgpack empty map is 1 byte, a Python dict about 64),
so the body size alone bounds nothing. Every list element, map entry and container counts as one item:

* **msgpack** is parsed with a hook on every list and map that adds its length, so parsing stops at
  the first container past ``max_items``; no single list or map may even declare more (msgpack's own
  ``max_array_len``/``max_map_len``, checked from the header before allocating);
* **JSON** has no such hooks, so its items are counted before parsing: every ``[``, ``{`` and ``,``
  outside strings (a ``bytes.count`` when the whole body has few enough of them, else a scan that
  skips strings first).

:func:`check_depth` bounds how deeply free-form fields (``metadata``) nest. Each function raises a
:class:`~rlgen_cli.rewards.remote.wire.WireError` naming the limit and its ``server.`` key.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlgen_cli.rewards.remote.wire import WireError

__all__ = ["check_depth", "count_json_items", "parse_body"]

_JSON_MARKS = (b"[", b"{", b",")
_JSON_STRING = re.compile(rb'"[^"]*"')  # a string once its escaped quotes and backslashes are gone


def _too_many(limit: int, detail: str) -> WireError:
    return WireError(
        f"request body holds more than {limit} items (list elements, map entries, containers: {detail}), "
        f"above server.max_request_items={limit}; send fewer images or less metadata per request",
        status=413,
    )


def count_json_items(body: bytes, limit: int) -> int:
    """The items of a JSON body: its ``[``, ``{`` and ``,`` outside strings (exact when above ``limit``).

    The quick count over the whole body also counts commas and brackets inside strings (prompts), so
    only when it is above ``limit`` are the strings removed and the rest counted exactly.
    """
    quick = sum(body.count(mark) for mark in _JSON_MARKS)
    if quick <= limit:
        return quick
    # In valid JSON a backslash only starts an escape inside a string: drop escaped backslashes first,
    # then escaped quotes, and every quote left delimits a string.
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = _JSON_STRING.sub(b"", unescaped)
    return sum(outside.count(mark) for mark in _JSON_MARKS)


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


def parse_body(body: bytes, binary: bool, max_items: int) -> dict[str, Any]:
    """Parse a request body (msgpack when ``binary``, else JSON) holding at most ``max_items`` items.

    Raises:
        WireError: 413 above ``max_items``; 400 for a body that is not valid msgpack/JSON or not a map.
    """
    fmt = "msgpack" if binary else "JSON"
    try:
        if binary:
            payload = _parse_msgpack(body, max_items)
        else:
            counted = count_json_items(body, max_items)
            if counted > max_items:
                raise _too_many(max_items, f"{counted} counted")
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
