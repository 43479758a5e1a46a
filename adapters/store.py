"""The embedded SQLite store: jaclang's own `SqliteMemory` with the changes below, installed through
jaclang's `get_persistent_memory` hook (the server's plugin, adapters/server/plugin.py, and the
in-process Engine, adapters/local.py, both answer it with `SharedSqliteStore`):

- **A busy timeout that fits the longest commit**: a writer waits up to
  CONTEXTRENDER_STORE_BUSY_TIMEOUT seconds (default 120) for another's commit, where jaclang's
  5 s wait failed with `database is locked` (a 500 on the server); readers never wait (WAL). A
  process's writers of one file take turns in the order asked, within that wait (transactions.py).
- **Short commits**: the rows of the nodes and edges a call creates are serialised before the
  write transaction (jaclang serialised inside it: the lock held 13.7 s for a 40,000-message
  ingestion), giving way on the server (engine/courtesy.jac); inside it each is only inserted
  (`INSERT OR IGNORE`: no read) or, when a row with its id is stored, merged as jaclang merges it.
- **A big flush's new rows written ahead**: a flush creating more than WRITE_AHEAD_BATCH rows
  inserts its created nodes and edges (not a root) first, that many to a transaction, giving way
  between them; nothing stored reaches them until the flush's own transaction writes the changed
  stored nodes (their edge lists). Rows written ahead that the flush does not apply are deleted
  again; a process killed between leaves only rows nothing reaches.
- **Rows made without jaclang's generic serialiser** (adapters/rows.py, adapters/merges.py): a created
  anchor's row, and a stored row merged on its text for an edge-list change or a changed field (jaclang
  deserialises the node, sets the change and serialises it whole: a result's text, a session's render
  log), byte for byte jaclang's rows (tests/test_rows.py, tests/test_store.py).
- **No full collection in a flush**: Python's cyclic collector makes none while a flush serialises
  and writes its rows (its full passes scan every object of the process to free almost nothing).
- **Edges added to a stored node by its id**, the node never loaded (adapters/by_id.py).
- **Connections reused**: a closed context's idle connection is kept, a few per file, for the
  next context on the same file while the file is the one it opened; `release` closes them. jaclang's
  class aliases are loaded again only when another connection wrote the file (adapters/transactions.py).
- **No write to open the store**: the schema is created (or a legacy store migrated) only when not
  current (jaclang wrote its schema row at every connection: a write each read call waited for).
- **A node's edge list apart from its row** where a merge by id gave it edges (adapters/edge_lists.py):
  `anchors` is a view over the rows and the edge lists, which every reader reads alike; a store
  written before is given that form when first opened, its rows unchanged.

Everything else (reads, quarantine, the rows' format) is jaclang's: stores written before read and
write as they did. With MongoDB (MONGODB_URI, jac-scale) the hook answers nothing: jac-scale's backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sqlite3
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from contextrender.jaclang_setup import import_jaclang
from contextrender.settings import positive_number

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Root  # noqa: E402
from jaclang.jac0core.runtime import hookimpl, plugin_manager  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.changeset import ChangeSet, WriteIntent  # noqa: E402

from contextrender.by_id import links_by_id, merge_by_id  # noqa: E402
from contextrender.edge_lists import ROWS, give_form, has_form  # noqa: E402
from contextrender.merges import merge_stored_text  # noqa: E402
from contextrender.rows import INSERT_ROW as _INSERT, anchor_row, forget_id_texts, id_text, time_rows  # noqa: E402
from contextrender.transactions import (aliases_loaded, file_key, idle_connection, in_blocks, keep_idle, release,  # noqa: E402
                                         with_written, without_written, write_turn)

__all__ = ["LENDER", "SharedSqliteStore", "StorePlugin", "busy_timeout", "file_key", "in_blocks", "install", "mongodb_configured",
           "release"]

DEFAULT_BUSY_TIMEOUT = 120.0
# jaclang's insert of a new row, only where no row with its id is stored (a create's first branch):
# into the rows' table itself (adapters/edge_lists.py: a new node has no edge list apart).
_INSERT_NEW = _INSERT.replace("INSERT OR REPLACE INTO anchors", f"INSERT OR IGNORE INTO {ROWS}")
# A flush creating more rows than this writes them ahead in transactions of this many.
WRITE_AHEAD_BATCH = 2000
_TABLES = (ROWS, "anchors_quarantine", "schema_meta", "aliases")
@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """No full collection of Python's cyclic collector inside (engine/courtesy.jac counts the holds)."""
    from contextrender import core

    core.CALLS.hold_full_collections()
    try:
        yield
    finally:
        core.CALLS.release_full_collections()


def busy_timeout() -> float:
    """Seconds a writer waits for another's commit: CONTEXTRENDER_STORE_BUSY_TIMEOUT (default 120)."""
    return positive_number("CONTEXTRENDER_STORE_BUSY_TIMEOUT", DEFAULT_BUSY_TIMEOUT, unit="seconds")


def _schema_is_current(conn: sqlite3.Connection) -> bool:
    """jaclang's tables are all there, its schema version is the one it writes and the edge lists
    are apart (adapters/edge_lists.py) (read only)."""
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not set(_TABLES) <= names or not has_form(conn) or not jac_memory._is_new_schema(conn):
        return False
    row = conn.execute("SELECT value FROM schema_meta WHERE key = 'db_format_version'").fetchone()
    return row is not None and row[0] == str(jac_memory.SQLITE_DB_FORMAT_VERSION)


# Asked first for an anchor the store is to load, while set (the Engine sets it while jaclang makes a
# call's context, whose first load is its root: adapters/working_set.py `KeptAnchors.take`): a
# callable (store, id) -> the anchor, or None to load it.
LENDER: contextvars.ContextVar[Callable[[Any, UUID], Any] | None] = contextvars.ContextVar("contextrender_lender", default=None)


class SharedSqliteStore(jac_memory.SqliteMemory):
    """jaclang's SQLite store for a file several calls (threads, requests, processes) share."""

    def get(self, id: UUID) -> Any:
        """jaclang's load, unless the `LENDER` set has the anchor."""
        lender = LENDER.get()
        if lender is not None and id not in self.__mem__:
            anchor = lender(self, id)
            if anchor is not None:
                self.__mem__[id] = anchor  # (as jaclang's load keeps it)
                return anchor
        return super().get(id)

    # It merges edges added to a stored node by the node's id alone, the node not loaded
    # (adapters/by_id.py): ingestion links new `Reuses` edges to earlier results that way.
    merges_edge_ids = True
    # The connection's SQLite data_version when this store took it (read to load the aliases).
    taken_version: int | None = None
    # The stored edge list (ids' texts) of each node its last committed flush merged on text, by
    # the id's number, as that flush's transaction left it (the Engine's kept anchors take their
    # edges' order from it: adapters/working_set.py `Kept.keep`).
    edges_written: dict[int, list[str]] | None = None

    def _ensure_connection(self) -> None:
        if self.__conn__ is not None:
            return
        kept = idle_connection(self.path)
        if kept is not None:
            self.taken_version = aliases_loaded(kept[0], kept[1])
            self.__conn__ = kept[0]
            self._opened = file_key(self.path)
            return
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        conn = sqlite3.connect(self.path, check_same_thread=False, timeout=busy_timeout())
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        if not _schema_is_current(conn):
            # jaclang's own path: migrate a legacy (pickle) store, else create what is missing.
            if jac_memory._is_legacy_schema(conn):
                jac_memory._migrate_legacy_pickle_db(conn)
            else:
                jac_memory._create_new_schema(conn)
            if not has_form(conn):
                give_form(conn)  # (a store written before: its rows are left as they are)
        self.taken_version = aliases_loaded(conn, None)
        self.__conn__ = conn
        self._opened = file_key(self.path)

    def close(self) -> None:
        """jaclang's close, except that an idle connection (no transaction open) is kept for the
        next context on this file (MAX_IDLE of them), instead of closed."""
        conn = self.__conn__
        opened = getattr(self, "_opened", None)
        if conn is not None and opened is not None and not conn.in_transaction \
                and keep_idle(self.path, conn, opened, getattr(self, "taken_version", None)):
            self.__conn__ = None
        super().close()

    def apply(self, changeset: ChangeSet) -> Any:
        """jaclang's `apply` (one BEGIN IMMEDIATE transaction, the stages in order, a failed write
        poisoning its dependents, a lost race rolling everything back), with the rows of created
        nodes and edges serialised before the transaction takes the write lock."""
        if changeset.is_empty():
            return jac_memory.ApplyReport()
        with collector_held():
            time_rows(datetime.now(timezone.utc).isoformat())  # one time for the flush's rows
            try:
                return self._apply(changeset)
            finally:
                time_rows(None)
                forget_id_texts()

    def _apply(self, changeset: ChangeSet) -> Any:
        from contextrender import core

        give_way = core.give_way  # the serialisation of a long call's rows gives way (engine/courtesy.jac)
        # The created rows as their insert's parameters, by id number (rows.py `id_text`: UUID hashes are slow).
        rows: dict[int, tuple] = {}
        for stage in changeset.staged():
            for intent in stage:
                give_way()
                if intent.is_create() and not intent.is_delete():
                    try:
                        anchor = intent.anchor
                        rows[anchor.id.int] = (id_text(anchor.id), *anchor_row(anchor))
                    except Exception:  # noqa: BLE001  (jaclang reports it from inside, as before)
                        pass
        # The store's own (re-entrant) lock, which jaclang's apply takes too: the rows are this flush's.
        with self.__lock__:
            self._ensure_connection()
            ahead = self._write_ahead(rows) if len(rows) > WRITE_AHEAD_BATCH else set()
            self._prepared = {key: row for (key, row) in rows.items() if key not in ahead} if ahead else rows
            self._written_ahead, own = ahead, without_written(changeset, ahead)  # (adapters/transactions.py)
            self._edge_lists = edges = {}
            try:
                with write_turn(self.__conn__, self.path, busy_timeout()):
                    report = with_written(super().apply(own), changeset, ahead, own)
            finally:
                self._prepared, self._written_ahead, self._edge_lists = {}, set(), None
            self.edges_written = edges if report.applied and not report.conflicts else {}
            if ahead and (unapplied := ahead - {id.int for id in report.applied}):
                self._take_back(unapplied)
            return report

    def _write_ahead(self, rows: dict[int, tuple]) -> set[int]:
        """Insert the created rows but roots', WRITE_AHEAD_BATCH to a transaction, giving way
        between transactions; the ids written, as numbers (a row already stored is left to the flush)."""
        from contextrender import core

        conn = self.__conn__  # (opened by `apply`)
        conn.commit()
        pending = [(key, row) for (key, row) in rows.items() if row[2:4] != (Root.__module__, Root.__name__)]
        written: set = set()
        for start in range(0, len(pending), WRITE_AHEAD_BATCH):
            batch: list = []
            try:
                with write_turn(conn, self.path, busy_timeout()):
                    conn.execute("BEGIN IMMEDIATE")
                    for (key, row) in pending[start:start + WRITE_AHEAD_BATCH]:
                        if conn.execute(_INSERT_NEW, row).rowcount == 1:
                            batch.append(key)
                    conn.commit()
            except sqlite3.Error:
                conn.rollback()  # the rest is written by the flush's own transaction
                return written
            written.update(batch)
            core.give_way()
        return written

    def _take_back(self, ids: set) -> None:
        """Delete rows written ahead that their flush did not apply (nothing stored reaches them)."""
        self.__conn__.commit()
        with write_turn(self.__conn__, self.path, busy_timeout()), self.__conn__ as conn:
            in_blocks(conn, "DELETE FROM anchors WHERE id IN (?ids)", [str(UUID(int=key)) for key in ids])

    def edge_targets(self, node: UUID, edge_ids: list[UUID], via: type, cls: type, fields: tuple[str, ...],
                     root: UUID) -> list[tuple[UUID, dict]] | None:
        """Two steps down from `node`, read from the committed rows without loading a node: its out-edges among
        `edge_ids` (its edge list) lead to nodes of archetype `via`, whose edges lead to nodes of archetype `cls`;
        each of those owned by `root`, in the edges' order, as (node id, {field: stored value, None when not
        stored}) (walkers/session.jac `session_rows`). None when this SQLite cannot read JSON that way."""
        if not all(name.isidentifier() for name in fields):
            raise ValueError(f"field names only: {fields!r}")
        picks = ", ".join(f"n.data -> '$.archetype.{name}'" for name in fields)
        ids = [str(e) for e in edge_ids]
        with self.__lock__:
            if self.__conn__ is None and os.path.exists(self.path):
                self._ensure_connection()
            if self.__conn__ is None:
                return []
            try:
                rows = in_blocks(
                    self.__conn__,
                    f"SELECT first.id, step.key, n.id, {picks} FROM anchors AS first"
                    " JOIN anchors AS mid ON mid.id = json_extract(first.data, '$.target')"
                    " JOIN json_each(mid.data, '$.edges') AS step"
                    " JOIN anchors AS second ON second.id = step.value"
                    " JOIN anchors AS n ON n.id = json_extract(second.data, '$.target')"
                    " WHERE first.id IN (?ids) AND json_extract(first.data, '$.source') = ?"
                    " AND json_extract(second.data, '$.source') = mid.id"
                    " AND mid.arch_module = ? AND mid.arch_type = ? AND json_extract(mid.data, '$.root') = ?"
                    " AND n.arch_module = ? AND n.arch_type = ? AND json_extract(n.data, '$.root') = ?",
                    ids, (str(node), via.__module__, via.__name__, str(root), cls.__module__, cls.__name__, str(root)))
            except sqlite3.OperationalError:
                return None  # no JSON functions in this SQLite
        order = {e: i for (i, e) in enumerate(ids)}
        rows.sort(key=lambda row: (order[row[0]], row[1]))
        return [(UUID(row[2]), {name: None if v is None else json.loads(v) for (name, v) in zip(fields, row[3:])})
                for row in rows]

    def stored_roots(self, ids: list[UUID]) -> dict[UUID, str | None]:
        """The root (its id's text) each of `ids` that has a row is stored under, from the
        committed rows (none when this SQLite cannot read JSON)."""
        with self.__lock__:
            if self.__conn__ is None and os.path.exists(self.path):
                self._ensure_connection()
            if self.__conn__ is None:
                return {}
            try:
                found = in_blocks(self.__conn__, "SELECT id, json_extract(data, '$.root') FROM anchors WHERE id IN (?ids)",
                                  [str(id) for id in ids])
            except sqlite3.OperationalError:
                return {}  # no JSON functions in this SQLite: none known
        return {UUID(key): root for (key, root) in found}

    def _merge_edge_ids(self, conn: sqlite3.Connection, intent: WriteIntent) -> None:
        """Add the edges of an intent that links a stored node by id (adapters/by_id.py)."""
        merge_by_id(self, conn, intent)

    def _merge_write(self, conn: sqlite3.Connection, intent: WriteIntent) -> None:
        number = intent.anchor.id.int
        if number in getattr(self, "_written_ahead", ()):
            return  # this flush's own row, inserted ahead (`_write_ahead`)
        key = id_text(intent.anchor.id)
        row = self._prepared.get(number) if hasattr(self, "_prepared") else None
        if row is not None and conn.execute(_INSERT_NEW, row).rowcount == 1:
            # A created anchor with no stored row: inserted, as below, without a read (a stored
            # row with its id is left as it is, and merged below).
            return
        if links_by_id(intent):  # (never created: not among the rows above)
            self._merge_edge_ids(conn, intent)
            return
        stored = conn.execute(
            "SELECT type, arch_module, arch_type, fingerprint, data, format_version FROM anchors WHERE id = ?", (key,)
        ).fetchone()
        if stored is None:
            row = self._prepared.get(number) if hasattr(self, "_prepared") else None
            if row is not None:
                conn.execute(_INSERT, row)
                return
        elif self._merge_stored_text(conn, key, stored, intent):
            return
        # Anything else: jaclang's merge with what is stored.
        super()._merge_write(conn, intent)

    def _merge_stored_text(self, conn: sqlite3.Connection, key: str, stored: tuple, intent: WriteIntent) -> bool:
        """jaclang's merge of an intent into a stored row, made on the row's JSON where it can be
        (adapters/merges.py `merge_stored_text`); False when jaclang must merge it."""
        return merge_stored_text(conn, key, stored, intent, getattr(self, "_edge_lists", None))


class StorePlugin:
    """jaclang's `get_persistent_memory` hook: the store every execution context opens."""

    @staticmethod
    @hookimpl
    def get_persistent_memory(config: dict) -> Any:
        path = config.get("db_path")
        if path:  # jaclang's own contexts (the in-process Engine): always a SQLite file
            return SharedSqliteStore(path=str(path))
        # jac-scale's contexts pass no path: MongoDB when configured (its backend, as before),
        # else its configured SQLite file, as it would open it (nothing without jac-scale).
        config = _scale_database_config()
        if config is None or mongodb_configured(config):
            return None
        return SharedSqliteStore(path=str(config["shelf_db_path"]))


def _scale_database_config() -> dict | None:
    """jac-scale's database settings (jac.toml's), None without jac-scale."""
    try:
        from jac_scale.config_loader import get_scale_config
    except ImportError:
        return None
    return get_scale_config().get_database_config()


def mongodb_configured(config: dict | None = None) -> bool:
    """Whether jac-scale keeps the graph in MongoDB (MONGODB_URI, or jac.toml's mongodb_uri; `config`:
    its database settings when already read); the store hook above and the server's
    (adapters/server/plugin.py) answer nothing then."""
    config = config if config is not None else _scale_database_config()
    return config is not None and bool(os.environ.get("MONGODB_URI") or config.get("mongodb_uri"))


_installed: list[StorePlugin] = []


def install() -> None:
    """Register the hook once per process (later registrations answer first in jaclang). The
    setting is read here first: jaclang would swallow its error inside the hook and open its own
    store instead."""
    busy_timeout()
    if not _installed:
        _installed.append(StorePlugin())
        plugin_manager.register(_installed[0])
