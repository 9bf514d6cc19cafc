"""Settings a run composes but its recipe (or loss, or family) never reads: held at their schema defaults.

A value other than the default would silently do nothing, so the config checks refuse it, each with its
own message saying what the setting is elsewhere and what to set instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from rlgen_cli.errors import require

__all__ = ["require_defaults", "shown"]


def require_defaults(
    section: Any, schema: type, keys: Iterable[str], message: Callable[[str, Any, Any], str]
) -> None:
    """Each of ``keys`` of ``section`` (an instance of the dataclass ``schema`` or a subclass) at its
    default in ``schema``, else :class:`UserError` with ``message(key, value, default)``."""
    defaults = {f.name: f.default for f in dataclasses.fields(schema)}
    for key in keys:
        value = getattr(section, key)
        require(value == defaults[key], message(key, value, defaults[key]))


def shown(value: Any) -> str:
    """A setting's value as an override writes it (``true``, ``null``, ``population``, ``[a, b]``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return f"[{', '.join(map(shown, value))}]"
    return "null" if value is None else str(value)
