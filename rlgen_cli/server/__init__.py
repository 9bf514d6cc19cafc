"""rlgen's reward server (aiohttp) and its wire format.

``build_app(rewards, settings)`` builds the application (:mod:`.app`); :mod:`.runner` serves it in the
foreground, as several worker processes, or in a background thread; :mod:`.wire` holds the encode/decode
helpers shared with the clients in :mod:`rlgen_cli.rewards.remote`. Attributes are imported lazily so
that the clients can import :mod:`.wire` without loading aiohttp's server side.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BackgroundServer", "ServerSettings", "build_app", "serve", "serve_workers"]

_LAZY = {
    "BackgroundServer": "rlgen_cli.server.runner",
    "ServerSettings": "rlgen_cli.server.app",
    "build_app": "rlgen_cli.server.app",
    "serve": "rlgen_cli.server.runner",
    "serve_workers": "rlgen_cli.server.runner",
}


def __getattr__(name: str) -> Any:
    """Import the public names on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'rlgen_cli.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
