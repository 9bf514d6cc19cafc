"""Launched workers compute with one CPU thread each (``OMP_NUM_THREADS`` defaults to 1 in the launcher,
but a value in the caller's environment is kept): pin it here, so the bit-for-bit comparisons with an
in-process run on one thread do not depend on the shell the tests run from."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
