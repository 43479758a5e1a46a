"""The store's write transactions (adapters/store.py): taken in turns per store file, each wait
bounded by the busy timeout, and a big flush's own transaction without the rows it wrote ahead.

- **Turns, per file, in the order asked** (`write_turn`): a write transaction of this process waits
  for the file's turn (`locks.Turns`) before its `BEGIN IMMEDIATE`, so the writers of one process
  are served in the order they asked, each as soon as the one before commits. SQLite's own wait
  polls in sleeps that grow to 100 ms, and a long call writing its rows ahead in batches took the
  lock again before a waiting commit's next poll (docs/performance.md, "Many users, a fourth
  round"). The whole wait, the turn's and then SQLite's (for another process's writer), is bounded
  by the busy timeout: SQLite waits only for what the turn left of it. A writer whose deadline
  passes in the line goes on without the turn and meets SQLite's wait with nothing left: the
  `database is locked` it met before, at the same time. Other files, and other processes on this
  file, are not in this line.
- **The flush's own transaction without the rows written ahead** (`without_written`,
  `with_written`): a 40,000-message call's flush had 140,000 intents, all but a few already
  written ahead, each still walked by jaclang's loop inside the write transaction (a no-op each:
  0.24 s alone, 1.5-2 s beside 30 users, while every other writer waited and the executor's
  threads filled with them). jaclang's transaction now walks only the others; the rows written
  ahead are reported applied, in jaclang's order, when that transaction committed, and taken back
  as before when it did not.
- **Statements over many ids** (`in_blocks`): an `IN (...)` list bound ID_BLOCK ids at a time.
- **Idle connections kept** (`idle_connection`, `keep_idle`, `release`): a closed context's idle
  connection is kept, a few per file, for the next context on the same file while the file is the
  one it opened. jaclang loads the file's class aliases at each connection; a kept one loads them
  again only when another connection committed to the file since it last did (`aliases_loaded`).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

from contextrender.jaclang_setup import import_jaclang
from contextrender.locks import Turns

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.runtimelib import memory as jac_memory  # noqa: E402

__all__ = ["ID_BLOCK", "MAX_IDLE", "WRITE_TURNS", "aliases_loaded", "data_version", "file_key", "idle_connection", "in_blocks",
           "keep_idle", "release", "with_written", "without_written", "write_turn"]

# Ids bound to one `IN (...)` list (within the 999 parameters a statement of an older SQLite takes).
ID_BLOCK = 500

WRITE_TURNS = Turns()
# A forked child (multiprocessing's default on Linux) holds no turn: the threads that held them stay
# in the parent, and their tickets would make each of the child's writes wait out its timeout.
os.register_at_fork(after_in_child=WRITE_TURNS.forget)


@contextlib.contextmanager
def write_turn(conn: sqlite3.Connection, path: str, timeout: float) -> Iterator[bool]:
    """The turn of the file `path` for one write transaction on `conn` (opened with the busy
    timeout `timeout`): inside, SQLite's wait for the write lock is what the turn left of
    `timeout`; after, `timeout` again. Yields whether the turn was had."""
    deadline = time.monotonic() + timeout
    with WRITE_TURNS.turn(path, timeout) as served:
        conn.execute(f"PRAGMA busy_timeout = {max(int((deadline - time.monotonic()) * 1000), 0)}")
        try:
            yield served
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")


def in_blocks(conn: sqlite3.Connection, sql: str, ids: list[str], params: tuple = ()) -> list:
    """The rows of `sql` run once per block of ID_BLOCK `ids`: its "(?ids)" is the block's
    placeholders (an `IN (...)` list), followed by `params`."""
    found: list = []
    for start in range(0, len(ids), ID_BLOCK):
        block = ids[start:start + ID_BLOCK]
        found += conn.execute(sql.replace("(?ids)", f"({', '.join('?' * len(block))})"), (*block, *params)).fetchall()
    return found


class _Unwritten:
    """A changeset less the intents whose rows were written ahead: what jaclang's `apply` reads
    of a changeset (`is_empty`, `staged`)."""

    def __init__(self, changeset: Any, ahead: set) -> None:
        self._stages = [[intent for intent in stage if intent.anchor.id.int not in ahead] for stage in changeset.staged()]

    def is_empty(self) -> bool:
        return not any(self._stages)

    def staged(self) -> list[list[Any]]:
        return self._stages


def without_written(changeset: Any, ahead: set) -> Any:
    """`changeset` for jaclang's transaction: less the intents written ahead (`ahead`, their ids'
    numbers, `UUID.int`, as adapters/store.py keys them)."""
    return _Unwritten(changeset, ahead) if ahead else changeset


def with_written(report: Any, changeset: Any, ahead: set, applied_to: Any) -> Any:
    """jaclang's report of the transaction on `applied_to` (`without_written`'s), with the rows
    written ahead applied as jaclang's loop would have applied them (no-ops that never fail), in
    its order, when the transaction committed; as it is when it rolled back (a lost race, a failed
    transaction: nothing applied) and the rows written ahead are to be taken back."""
    if not ahead or report.conflicts or (report.applied == [] and not applied_to.is_empty()):
        return report
    done = set(report.applied)
    report.applied = [intent.anchor.id for stage in changeset.staged() for intent in stage
                      if intent.anchor.id.int in ahead or intent.anchor.id in done]
    return report


# Idle connections kept per file (a context uses one at a time: one per thread that calls at once).
MAX_IDLE = 4
# path -> [(connection, the file's (device, inode) when it was opened, its data_version when it last
# loaded jaclang's class aliases)], and their lock.
_idle: dict[str, list[tuple[sqlite3.Connection, tuple[int, int], int | None]]] = {}
_idle_lock = threading.Lock()


def file_key(path: str) -> tuple[int, int] | None:
    """The file's (device, inode), None when it is not there: tells a file replaced under a path."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_dev, found.st_ino)


def idle_connection(path: str) -> tuple[sqlite3.Connection, int | None] | None:
    """A kept connection to `path` that is still open on the file now at `path` (one to a file
    deleted or replaced since is closed: it would read and write the old one), and its
    data_version when it last loaded the aliases."""
    now = file_key(path)
    while True:
        with _idle_lock:
            kept = _idle.get(path)
            if not kept:
                return None
            (conn, opened, aliased) = kept.pop()
        if opened == now:
            return (conn, aliased)
        conn.close()


def data_version(conn: sqlite3.Connection) -> int:
    """SQLite's count that changes when another connection commits to the file (not this one)."""
    return conn.execute("PRAGMA data_version").fetchone()[0]


def aliases_loaded(conn: sqlite3.Connection, aliased: int | None) -> int:
    """jaclang's class aliases stored in the file loaded, as jaclang loads them at each connection
    (`_load_db_aliases`: an alias its CLI adds applies to the next context), unless no other
    connection committed to the file since `conn` last loaded them (SQLite's `data_version` on
    `conn` is then `aliased`: the aliases table is as it read it; an alias added through `conn`
    itself is put in jaclang's registry by jaclang as it adds it). Its data_version now."""
    version = data_version(conn)
    if version != aliased:
        jac_memory._load_db_aliases(conn)
    return version


def release(path: str | os.PathLike[str]) -> None:
    """Close the idle connections kept for the SQLite file `path`."""
    with _idle_lock:
        kept = _idle.pop(str(path), [])
    for (conn, *_) in kept:
        conn.close()


def keep_idle(path: str, conn: sqlite3.Connection, opened: tuple[int, int], aliased: int | None) -> bool:
    """Keep `conn` (on the file `opened`, its aliases loaded at data_version `aliased`) for the next
    context on `path`, unless MAX_IDLE are kept already; whether it was kept."""
    with _idle_lock:
        kept = _idle.setdefault(path, [])
        if len(kept) >= MAX_IDLE:
            return False
        kept.append((conn, opened, aliased))
        return True
