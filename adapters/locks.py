"""Locks by key (a session): calls on one key take turns, calls on different keys do not wait for
each other. An entry leaves with its last caller, so the table holds only the keys with calls in
flight. The Engine holds them from threads (`hold`), the server from its event loop (`hold_async`);
one table is used one way."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from typing import Any


class KeyedLocks:
    def __init__(self) -> None:
        # Guards the table only, never held while a caller waits for a key's lock.
        self._guard = threading.Lock()
        self._entries: dict[Hashable, list] = {}

    @contextlib.contextmanager
    def _entry(self, key: Hashable, make: Callable[[], Any]) -> Iterator[Any]:
        """The key's lock (made by `make` for its first caller), counted as in use meanwhile."""
        with self._guard:
            entry = self._entries.setdefault(key, [make(), 0])
            entry[1] += 1
        try:
            yield entry[0]
        finally:
            with self._guard:
                entry[1] -= 1
                if not entry[1]:
                    del self._entries[key]

    @contextlib.contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        with self._entry(key, threading.Lock) as lock, lock:
            yield

    @contextlib.asynccontextmanager
    async def hold_async(self, key: Hashable) -> AsyncIterator[None]:
        with self._entry(key, asyncio.Lock) as lock:
            async with lock:
                yield

    def __len__(self) -> int:
        return len(self._entries)
