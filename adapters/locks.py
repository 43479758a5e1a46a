"""Locks by key (a session): calls on one key take turns, calls on different keys do not wait for
each other. An entry leaves with its last caller, so the table holds only the keys with calls in
flight. The Engine holds them from threads (`hold`), the server from its event loop (`hold_async`);
one table is used one way. And turns by key in the order asked, each wait bounded (`Turns`: the
store's write transactions, adapters/transactions.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
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


class _Ticket:
    """One caller's place in a key's line; `served` is set when its turn comes."""

    __slots__ = ("served", "thread")

    def __init__(self) -> None:
        self.served = threading.Event()
        self.thread = threading.get_ident()


class Turns:
    """Turns by key (a store file), served in the order asked, each wait bounded.

    A caller asks for the key's turn with a timeout (`turn`): it is served once the callers that
    asked before it are done, or the timeout passes first, and then it goes on without the turn
    (holding nothing; what it guards, SQLite's own lock, still decides). Keys are apart: a turn on
    one key never waits for another's. The turn is held only inside the `with` block, and the
    ticket joins the line inside the block's `try`: an exception (a KeyboardInterrupt too) anywhere
    from the ask to the end of the block leaves the line without it, and one that interrupts the
    leaving itself is raised only once the ticket is out and the turn passed on (Python checks for
    signals between bytecodes, not only where `sys.setprofile` sees calls, so this holds where the
    tests raise one: at each call and return). A thread that holds the key's turn and asks again is
    served at once (re-entrant)."""

    def __init__(self) -> None:
        # Guards the lines only, never held while a caller waits for its turn.
        self._guard = threading.Lock()
        # key -> the tickets in the order asked; the first holds the turn.
        self._lines: dict[Hashable, deque[_Ticket]] = {}

    @contextlib.contextmanager
    def turn(self, key: Hashable, timeout: float) -> Iterator[bool]:
        """The key's turn, waited for up to `timeout` seconds: yields True when served (held until
        the block ends), False when the timeout passed first (nothing held)."""
        (ticket, interrupted) = (None, None)
        try:
            with self._guard:
                line = self._lines.get(key)
                if not (line and line[0].thread == threading.get_ident()):
                    ticket = _Ticket()
                    self._lines.setdefault(key, deque()).append(ticket)
                    if self._lines[key][0] is ticket:
                        ticket.served.set()
            yield ticket is None or self._wait(key, ticket, timeout)
        finally:
            while ticket is not None:  # (the first thing the `finally` runs)
                try:
                    self._leave(key, ticket)
                    ticket = None
                except BaseException as error:  # noqa: BLE001  (raised below, once the ticket is out)
                    interrupted = error
            if interrupted is not None:
                raise interrupted

    def _wait(self, key: Hashable, ticket: _Ticket, timeout: float) -> bool:
        if ticket.served.wait(max(timeout, 0.0)):
            return True
        with self._guard:
            if ticket.served.is_set():
                return True  # served as the timeout passed
            self._lines[key].remove(ticket)  # out of the line: nobody waits for it now
        return False

    def _leave(self, key: Hashable, ticket: _Ticket) -> None:
        """The ticket out of the key's line, wherever it is, and the turn passed on if it held it.
        Run again after an interruption anywhere in it, it ends the same."""
        with self._guard:
            line = self._lines.get(key)
            if line is None or ticket not in line:
                return
            if line[0] is ticket and len(line) > 1:
                line[1].served.set()
            line.remove(ticket)
            if not line:
                del self._lines[key]

    def forget(self) -> None:
        """Every line emptied, the guard new: a forked child's (the threads holding or waiting for
        turns are not in it; transactions.py registers this to run after a fork)."""
        (self._guard, self._lines) = (threading.Lock(), {})

    def waiting(self, key: Hashable) -> int:
        """How many callers are in the key's line (its holder included)."""
        with self._guard:
            return len(self._lines.get(key, ()))
