"""The PolicyEngine's two small concurrency helpers: one lock per adapter being loaded, so a cold load
holds up only the requests for that adapter, and the mean number of requests inside the engine (the
batch it sees), which the PolicyServer reports."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

__all__ = ["KeyedLocks", "Occupancy"]


class KeyedLocks:
    """One `asyncio.Lock` per key, forgotten once no one holds or waits for it (the keys requests can
    name are unbounded: every well-formed adapter name, loadable or not)."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key) or (asyncio.Lock(), 0)
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


class Occupancy:
    """The time-weighted mean number of requests inside the engine while it holds any: the batch the
    engine sees (what matches in flight and several workers are for), reported by `status`."""

    def __init__(self) -> None:
        self.inside = 0
        self.last = time.monotonic()
        self.weighted = 0.0
        self.busy_s = 0.0

    def _tick(self) -> None:
        now = time.monotonic()
        if self.inside:
            self.weighted += self.inside * (now - self.last)
            self.busy_s += now - self.last
        self.last = now

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self._tick()
        self.inside += 1
        try:
            yield
        finally:
            self._tick()
            self.inside -= 1

    def mean(self) -> float:
        self._tick()
        return self.weighted / self.busy_s if self.busy_s else 0.0
