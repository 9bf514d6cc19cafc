"""Server-wide admission: a budget of requests in flight and of the memory they may hold together.

Each request takes one slot of ``max_inflight_requests`` before its body is read.
``max_inflight_decoded_mb`` is split in two halves: a request reserves twice its declared body size (the
bytes and their parse; ``max_request_mb`` for a chunked or ``Content-Encoding`` body, which may inflate) from the first before reading it, then,
once its image headers are read and before anything is decoded, its decoded pixels (``Σ C·H·W``, five
times for a reward that gets float pixels: the uint8 arrays and their float32 batch) from the second, and
holds both until it is answered. A request holding a body share waits only for pixel shares, and pixel
holders wait for nothing, so requests can never block each other for good. A request that does not fit
waits, in arrival order, at most ``admission_wait_s`` and is then answered 503 with ``Retry-After``; the
remote clients retry it (on another endpoint when there is one). A request alone in a budget is always
admitted, so a budget below one cap-sized request slows requests down but never refuses them all.
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Budget"]


class Budget:
    """A capacity shared by concurrent requests; ``acquire`` waits (first come, first served) up to a
    timeout. Runs on one event loop: no locks."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, amount: int) -> bool:
        return self.used == 0 or self.used + amount <= self.capacity

    async def acquire(self, amount: int, timeout_s: float) -> bool:
        """Take ``amount``; False when it did not fit within ``timeout_s`` (nothing taken then). Anything
        fits an empty budget."""
        if not self._waiters and self._fits(amount):
            self.used += amount
            return True
        entry = (amount, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(entry[1]), timeout_s)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            self._abandon(entry)
            raise
        if entry[1].done():
            return True
        self._abandon(entry)
        return False

    def _abandon(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """Give up a wait: drop it from the queue, or hand back what it was granted meanwhile."""
        amount, granted = entry
        if granted.done():
            self.release(amount)
            return
        self._waiters.remove(entry)
        granted.cancel()
        self._wake()  # it may have been the head that blocked smaller requests behind it

    def release(self, amount: int) -> None:
        """Give back ``amount`` and admit the waiters that now fit, in order."""
        self.used -= amount
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            amount, granted = self._waiters.popleft()
            self.used += amount
            granted.set_result(None)
