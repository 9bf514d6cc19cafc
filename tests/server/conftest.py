"""Fixtures of the reward-server tests: real aiohttp servers on 127.0.0.1 with ephemeral ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from rlgen_cli.server.app import ServerSettings, build_app
from rlgen_cli.server.runner import BackgroundServer


@pytest.fixture
def serve() -> Iterator[Callable[..., BackgroundServer]]:
    """Start ``BackgroundServer(build_app(rewards, ServerSettings(**settings)))``; stopped after the test."""
    servers: list[BackgroundServer] = []

    def start(rewards: dict, **settings) -> BackgroundServer:
        settings.setdefault("port", 0)
        settings.setdefault("max_wait_ms", 0)
        server = BackgroundServer(
            build_app(rewards, ServerSettings(**settings)), shutdown_timeout_s=10
        ).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
