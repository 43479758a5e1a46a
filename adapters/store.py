"""The embedded SQLite store, as jaclang's own `SqliteMemory` with three changes, installed through
jaclang's `get_persistent_memory` hook (the server's plugin, adapters/server/plugin.py, and the
in-process Engine, adapters/local.py, both answer it with `SharedSqliteStore`):

- **A busy timeout that fits the longest commit.** jaclang opens the file with Python's default
  5 s lock wait, so a call that waited longer than that for another call's commit failed with
  `database is locked` (a 500 on the server). Here a writer waits up to
  CONTEXTRENDER_STORE_BUSY_TIMEOUT seconds (default 120; readers never wait, the file is in WAL
  mode).
- **Short commits.** jaclang serialises every written node inside its write transaction
  (`BEGIN IMMEDIATE` ... `COMMIT`), so the write lock was held for the whole serialisation: 13.7 s
  for a 40,000-message ingestion here. Here the rows of the nodes and edges a call creates are
  serialised before the transaction; inside it, each is only inserted (when no row with its id is
  stored, as jaclang checks) or merged with the stored row exactly as jaclang merges it.
- **No write to open the store.** jaclang's open runs four `CREATE TABLE IF NOT EXISTS` and
  writes its schema version at every connection (a new connection per server request): a write
  that waits on any other call's commit, made by calls that only read. Here the schema is created
  (or a legacy store migrated) only when it is not already the current one.

Everything else (reads, quarantine, the merge of a stored row, the stored format) is jaclang's:
stores written before this module read and write as they did, and jaclang reads what it writes.
With MongoDB configured (MONGODB_URI, jac-scale), the hook answers nothing and jac-scale's MongoDB
backend is used as before.
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.runtime import hookimpl, plugin_manager  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.changeset import ChangeSet, WriteIntent  # noqa: E402


__all__ = ["SharedSqliteStore", "StorePlugin", "busy_timeout", "install"]

DEFAULT_BUSY_TIMEOUT = 120.0
# jaclang's insert of a whole row (SqliteMemory._merge_write, its branch for a row not stored yet).
_INSERT = """
    INSERT OR REPLACE INTO anchors
        (id, type, arch_module, arch_type, fingerprint, data, format_version, updated_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""
_TABLES = ("anchors", "anchors_quarantine", "schema_meta", "aliases")


def busy_timeout() -> float:
    """Seconds a writer waits for another's commit: CONTEXTRENDER_STORE_BUSY_TIMEOUT (default 120)."""
    raw = os.environ.get("CONTEXTRENDER_STORE_BUSY_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_BUSY_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"CONTEXTRENDER_STORE_BUSY_TIMEOUT must be a number of seconds > 0 (got {raw!r})")
    return seconds


def _schema_is_current(conn: sqlite3.Connection) -> bool:
    """jaclang's tables are all there and its schema version is the one it writes (read only)."""
    names = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not set(_TABLES) <= names or not jac_memory._is_new_schema(conn):
        return False
    row = conn.execute("SELECT value FROM schema_meta WHERE key = 'db_format_version'").fetchone()
    return row is not None and row[0] == str(jac_memory.SQLITE_DB_FORMAT_VERSION)


class SharedSqliteStore(jac_memory.SqliteMemory):
    """jaclang's SQLite store for a file several calls (threads, requests, processes) share."""

    def _ensure_connection(self) -> None:
        if self.__conn__ is not None:
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
        jac_memory._load_db_aliases(conn)
        self.__conn__ = conn

    def apply(self, changeset: ChangeSet) -> Any:
        """jaclang's `apply` (one BEGIN IMMEDIATE transaction, the stages in order, a failed write
        poisoning its dependents, a lost race rolling everything back), with the rows of created
        nodes and edges serialised before the transaction takes the write lock."""
        if changeset.is_empty():
            return jac_memory.ApplyReport()
        rows: dict[Any, tuple] = {}
        for stage in changeset.staged():
            for intent in stage:
                if intent.is_create() and not intent.is_delete():
                    try:
                        rows[intent.anchor.id] = jac_memory._anchor_to_row(intent.anchor)
                    except Exception:  # noqa: BLE001  (jaclang reports it from inside, as before)
                        pass
        self._prepared = rows
        try:
            return super().apply(changeset)
        finally:
            self._prepared = {}

    def _merge_write(self, conn: sqlite3.Connection, intent: WriteIntent) -> None:
        row = getattr(self, "_prepared", {}).get(intent.anchor.id)
        if row is not None:
            key = str(intent.anchor.id)
            stored = conn.execute("SELECT 1 FROM anchors WHERE id = ?", (key,)).fetchone()
            if stored is None:
                conn.execute(_INSERT, (key,) + row)
                return
        # A stored row (or nothing prepared): jaclang's merge with what is stored.
        super()._merge_write(conn, intent)


class StorePlugin:
    """jaclang's `get_persistent_memory` hook: the store every execution context opens."""

    @staticmethod
    @hookimpl
    def get_persistent_memory(config: dict) -> Any:
        path = config.get("db_path")
        if path:  # jaclang's own contexts (the in-process Engine): always a SQLite file
            return SharedSqliteStore(path=str(path))
        # jac-scale's contexts pass no path: MongoDB when configured (its backend, as before),
        # else its configured SQLite file, as it would open it.
        try:
            from jac_scale.config_loader import get_scale_config
        except ImportError:
            return None
        database = get_scale_config().get_database_config()
        if os.environ.get("MONGODB_URI") or database.get("mongodb_uri"):
            return None
        return SharedSqliteStore(path=str(database["shelf_db_path"]))


_installed: list[StorePlugin] = []


def install() -> None:
    """Register the hook once per process (later registrations answer first in jaclang)."""
    if not _installed:
        _installed.append(StorePlugin())
        plugin_manager.register(_installed[0])
