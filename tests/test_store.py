"""The shared SQLite store (adapters/store.py): a call waits for another's commit instead of failing,
a call that only reads writes nothing to open the store, and a call's rows are serialised before
its write transaction takes the lock."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid

from conftest import assistant, call, db_file, hold_write_lock, tool, tool_rounds, trace_prefix, user

from contextrender import Engine, store, transactions

HELD = 5.6  # seconds: longer than the 5 s lock wait jaclang opens its SQLite file with


def _read_and_write_while_another_commit_holds(store, path: str, written: list[dict]) -> None:
    """While another writer's commit holds the write lock of the store file at `path` for HELD s,
    `store` (an Engine, or a Client of a server: the same methods) reads session "reader" (ingested
    before) at once and writes `written` to session "writer", which waits and lands."""
    taken = threading.Event()
    holder = threading.Thread(target=hold_write_lock, args=(path, HELD, taken))
    holder.start()
    try:
        assert taken.wait(10)
        started = time.monotonic()
        # A read writes nothing, so it does not wait for the lock (jaclang's open wrote its
        # schema row, which waited 5 s and failed with `database is locked`).
        assert store.get_session("reader", include_messages=True)["messages"] == [user("what is in the repo?")]
        assert time.monotonic() - started < HELD / 2
        # A write waits for the other commit and then lands (jaclang gave up after 5 s).
        assert store.ingest("writer", written).added == len(written)
    finally:
        holder.join(timeout=30)
    assert store.get_session("writer")["events"] == len(written)


def test_a_call_waits_for_a_long_commit_and_a_read_does_not_wait(tmp_path):
    engine = Engine(tmp_path / "store")
    engine.ingest("reader", [user("what is in the repo?")])
    _read_and_write_while_another_commit_holds(engine, db_file(engine), [user("fix it"), assistant(None, call("c1", "ls", {})), tool("c1", "a.py")])


def test_rows_are_serialised_before_the_write_transaction(tmp_path, monkeypatch):
    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("start")])
    order: list[str] = []
    # A created anchor's row (adapters/rows.py) and jaclang's (a merge it makes whole).
    (to_row, jaclang_row) = (store.anchor_row, store.jac_memory._anchor_to_row)
    monkeypatch.setattr(store, "anchor_row", lambda anchor: order.append("row") or to_row(anchor))
    monkeypatch.setattr(store.jac_memory, "_anchor_to_row", lambda anchor: order.append("row") or jaclang_row(anchor))
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(lambda sql: order.append("BEGIN IMMEDIATE") if sql.strip() == "BEGIN IMMEDIATE" else None)
        return conn

    monkeypatch.setattr(store.sqlite3, "connect", traced)
    store.release(engine._keepalive_path)  # the next call opens a (traced) connection
    engine.ingest("s", [user("start"), assistant(None, call("c1", "cat", {"path": "a.py"})), tool("c1", "print(1)")])
    begin = order.index("BEGIN IMMEDIATE")
    # The new message, call and result nodes and their edges: serialised, all before BEGIN.
    assert order[:begin].count("row") >= 6
    # Inside the transaction only rows merged with a stored one (the session, the chain's tail).
    assert order[begin:].count("row") <= 3
    assert engine.render("s", budget=1000).messages[-1] == tool("c1", "print(1)")


def test_created_rows_are_inserted_without_a_read_each(tmp_path, monkeypatch):
    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("start")])
    reads: list[str] = []
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(lambda sql: reads.append(sql) if sql.lstrip().startswith(("SELECT type, arch_module", "SELECT id FROM")) else None)
        return conn

    monkeypatch.setattr(store.sqlite3, "connect", traced)
    store.release(engine._keepalive_path)  # the next call opens a (traced) connection
    messages = [user("start")]
    for i in range(20):
        messages += [assistant(None, call(f"c{i}", "cat", {"path": f"a{i}.py"})), tool(f"c{i}", f"print({i})")]
    engine.ingest("s", messages)
    # 60 new nodes and about 80 new edges (145 reads before), read for none of them: only the
    # rows loaded or merged with a stored one (the session, the chain's tail) are read; not even
    # one read of the new rows' ids (`INSERT OR IGNORE` tells a stored id).
    assert 0 < len(reads) <= 6 and not [sql for sql in reads if sql.startswith("SELECT id FROM")]
    assert engine.render("s", budget=4000).messages[-1] == tool("c19", "print(19)")
    assert engine.get_session("s")["events"] == len(messages)


def test_busy_timeout_setting(monkeypatch):
    monkeypatch.delenv("CONTEXTRENDER_STORE_BUSY_TIMEOUT", raising=False)
    assert store.busy_timeout() == store.DEFAULT_BUSY_TIMEOUT
    monkeypatch.setenv("CONTEXTRENDER_STORE_BUSY_TIMEOUT", "2.5")
    assert store.busy_timeout() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("CONTEXTRENDER_STORE_BUSY_TIMEOUT", bad)
        try:
            store.busy_timeout()
        except ValueError as error:
            assert "CONTEXTRENDER_STORE_BUSY_TIMEOUT" in str(error)
        else:
            raise AssertionError(f"{bad!r} was taken")


def _merges_compared_with_jaclang(tmp_path, monkeypatch, stored_by_another=None) -> list[str]:
    """Every merge made on the stored text compared with jaclang's own merge of the same intent
    (made first inside a savepoint, then rolled back): the same node as every reader reads it
    (the view `anchors`: the same values, edge ids in the same order, the same version; a row
    written whole is byte for byte jaclang's, an edge list alone is stored apart:
    adapters/edge_lists.py). Before both,
    `stored_by_another(conn, key, intent)` may change the stored row (another writer's work);
    the archetypes of the nodes merged on their text."""
    engine = Engine(tmp_path / "store")
    merged_on_text = store.SharedSqliteStore._merge_stored_text
    checked: list[str] = []

    def compared(self, conn, key, stored, intent):
        if stored_by_another is not None and stored_by_another(conn, key, intent):
            stored = conn.execute("SELECT type, arch_module, arch_type, fingerprint, data, format_version"
                                  " FROM anchors WHERE id = ?", (key,)).fetchone()
        version = intent.anchor.version
        conn.execute("SAVEPOINT jaclang")
        store.jac_memory.SqliteMemory._merge_write(self, conn, intent)
        (expected,) = conn.execute("SELECT data FROM anchors WHERE id = ?", (key,)).fetchone()
        conn.execute("ROLLBACK TO jaclang")
        conn.execute("RELEASE jaclang")
        intent.anchor.version = version
        if not merged_on_text(self, conn, key, stored, intent):
            return False
        (row, apart) = conn.execute("SELECT r.data, e.node FROM anchor_rows AS r LEFT JOIN edge_lists AS e ON e.node = r.id"
                                    " WHERE r.id = ?", (key,)).fetchone()
        # A merge on the text writes the row whole: a list kept apart went back into it.
        assert apart is None and row == expected
        checked.append(type(intent.anchor.archetype).__name__)
        return True

    monkeypatch.setattr(store.SharedSqliteStore, "_merge_stored_text", compared)
    messages = trace_prefix(turns=12)
    for end in range(4, len(messages) + 1, 3):
        engine.ingest("s", messages[:end])
        engine.render("s", budget=1500)
    engine.render("s", budget=900, policy="per-call")
    engine.close()
    return checked


def test_a_stored_row_merged_on_its_text_is_the_row_jaclang_writes(tmp_path, monkeypatch):
    checked = _merges_compared_with_jaclang(tmp_path, monkeypatch)
    assert "Session" in checked and "ToolResult" in checked and len(checked) > 20


def test_an_edge_another_writer_stored_survives_the_merge_as_in_jaclang(tmp_path, monkeypatch):
    """The node's new edges merged into a stored list that holds an edge this call never loaded
    (another writer's, added after this call read the node): kept, in jaclang's order."""
    foreign: list[str] = []

    def another_writer_added_an_edge(conn, key, intent):
        if intent.is_create() or not intent.anchor.edge_delta() or not intent.anchor.edge_delta()[0]:
            return False
        (text,) = conn.execute("SELECT data FROM anchors WHERE id = ?", (key,)).fetchone()
        data = json.loads(text)
        if not isinstance(data.get("edges"), list) or not data["edges"]:
            return False
        foreign.append(str(uuid.uuid4()))
        data["edges"].insert(len(data["edges"]) // 2, foreign[-1])
        conn.execute("UPDATE anchors SET data = ? WHERE id = ?", (json.dumps(data), key))
        return True

    checked = _merges_compared_with_jaclang(tmp_path, monkeypatch, another_writer_added_an_edge)
    assert foreign and "ToolResult" in checked
    stored = sqlite3.connect(str(next((tmp_path / "store").rglob("*.db")))).execute("SELECT data FROM anchors").fetchall()
    assert any(f in text for (text,) in stored for f in foreign)


def test_the_server_answers_while_another_commit_holds_its_store(jac_server):
    """Two users of one server: while one commit holds the store's write lock longer than jaclang's
    5 s wait, the other's read answers at once and its write waits and lands: no 500."""
    import uuid

    from contextrender import Client

    with Client(jac_server.url) as client:
        client.register(f"user_{uuid.uuid4().hex[:8]}", "secret-password-1")
        client.ingest("reader", [user("what is in the repo?")])
        files = sorted((jac_server.workdir / ".jac" / "data").glob("anchor_store.db"))
        assert len(files) == 1, sorted((jac_server.workdir / ".jac" / "data").iterdir())
        _read_and_write_while_another_commit_holds(client, str(files[0]), [user("fix it"), assistant("on it")])


def test_a_row_stored_by_an_earlier_version_is_merged_by_jaclang_and_reads(tmp_path, monkeypatch):
    """A Session row whose class has changed since it was written (another fingerprint) is not
    merged on its text: jaclang's merge reads it, fills what it lacks, and writes it in the
    current format, which later merges take on their text."""
    from graph.context import Session

    engine = Engine(tmp_path / "store")
    current = Session.__jac_fingerprint__
    monkeypatch.setattr(Session, "__jac_fingerprint__", "written-by-an-earlier-version")
    engine.ingest("old", [user("first")])
    monkeypatch.setattr(Session, "__jac_fingerprint__", current)
    conn = sqlite3.connect(db_file(engine))
    fingerprint = "SELECT fingerprint FROM anchors WHERE arch_type = 'Session'"
    assert conn.execute(fingerprint).fetchall() == [("written-by-an-earlier-version",)]
    on_text: list[bool] = []  # for the Session's row, merge by merge
    merged_on_text = store.SharedSqliteStore._merge_stored_text

    def watched(self, conn, key, stored, intent):
        done = merged_on_text(self, conn, key, stored, intent)
        if isinstance(intent.anchor.archetype, Session):
            on_text.append(done)
        return done

    monkeypatch.setattr(store.SharedSqliteStore, "_merge_stored_text", watched)
    engine.ingest("old", [user("first"), assistant("second")])
    assert conn.execute(fingerprint).fetchall() == [(current,)]
    engine.ingest("old", [user("first"), assistant("second"), user("third")])
    assert on_text == [False, True]
    assert engine.get_session("old", include_messages=True)["messages"] == [user("first"), assistant("second"), user("third")]


def test_a_malformed_busy_timeout_stops_the_engine_saying_so(tmp_path):
    """jaclang swallows a failing hook and opens its own store: the setting is checked before."""
    done = subprocess.run([sys.executable, "-c", "import contextrender.local"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CONTEXTRENDER_STORE_BUSY_TIMEOUT": "soon"})
    assert done.returncode != 0 and "CONTEXTRENDER_STORE_BUSY_TIMEOUT must be a positive number of seconds" in done.stderr


def test_calls_reuse_an_idle_connection_and_never_one_to_a_replaced_file(tmp_path, monkeypatch):
    """Opening a connection (connect, PRAGMAs, the schema check) cost each call 0.3-0.5 ms: a
    closed context's idle connection serves the next call on the same file. A file deleted and
    made again at the same path is not written through a connection to the old one."""
    import shutil

    opened: list[str] = []
    connect = sqlite3.connect
    monkeypatch.setattr(store.sqlite3, "connect", lambda path, *a, **k: opened.append(path) or connect(path, *a, **k))
    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("one")])
    before = len(opened)
    for n in range(5):
        engine.ingest("s", [user(f"more {n}")], append=True)
    assert len(opened) == before, "each call opened its own connection"
    assert engine.get_session("s")["events"] == 6
    engine.close()
    assert transactions._idle.get(str(tmp_path / "store" / ".jac" / "data" / "main.db")) is None, "close keeps no idle connection"

    engine = Engine(tmp_path / "again")
    engine.ingest("t", [user("first store")])
    path = engine._keepalive_path
    engine._keepalive.close()  # as if nothing else held the old file: only the idle connections do
    engine._keepalive = None
    shutil.rmtree(tmp_path / "again")
    fresh = Engine(tmp_path / "again")
    fresh.ingest("t", [user("second store")])
    assert [m["content"] for m in fresh.render("t", [], budget=1000).messages] == ["second store"]
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM anchors WHERE arch_type = 'Session'").fetchone() == (1,)
    fresh.close()


def _rows(engine: Engine) -> int:
    with sqlite3.connect(db_file(engine)) as conn:
        return conn.execute("SELECT count(*) FROM anchors").fetchone()[0]


def test_a_big_flush_writes_its_new_rows_ahead_in_short_transactions(big_flush, monkeypatch):
    (messages, whole, ahead) = big_flush
    began: list[str] = []
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(lambda sql: began.append(sql) if sql.strip() == "BEGIN IMMEDIATE" else None)
        return conn

    monkeypatch.setattr(store.sqlite3, "connect", traced)
    store.release(ahead._keepalive_path)  # the next call opens a (traced) connection
    ahead.ingest("s", messages, append=False)
    # About 80 new rows, 5 a transaction, then the flush's own: not one transaction.
    assert len(began) > 10
    # The same session and the same number of rows as one transaction writes.
    assert ahead.get_session("s", include_messages=True)["messages"] == whole.get_session("s", include_messages=True)["messages"]
    assert _rows(ahead) == _rows(whole)
    assert ahead.render("s", messages, budget=300).messages == whole.render("s", messages, budget=300).messages


def test_rows_written_ahead_of_a_flush_that_is_not_applied_are_taken_back(tmp_path, monkeypatch):
    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("start")])
    before = (_rows(engine), engine.get_session("s")["events"])
    monkeypatch.setattr(store, "WRITE_AHEAD_BATCH", 5)
    # The flush's own transaction rolled back (a lost race): nothing of it applied.
    monkeypatch.setattr(store.jac_memory.SqliteMemory, "apply", lambda self, changeset: store.jac_memory.ApplyReport())
    try:
        engine.ingest("s", tool_rounds(12))
    except Exception:  # noqa: BLE001  (the call may say so; what matters is what is stored)
        pass
    monkeypatch.undo()
    assert (_rows(engine), engine.get_session("s")["events"]) == before


def test_no_full_collection_while_a_flush_serialises_and_writes(tmp_path, monkeypatch):
    import gc

    from engine.courtesy import HELD_FULL_THRESHOLD

    engine = Engine(tmp_path / "store")
    seen: list[int] = []
    row = store.anchor_row
    monkeypatch.setattr(store, "anchor_row", lambda anchor: seen.append(gc.get_threshold()[2]) or row(anchor))
    thresholds = gc.get_threshold()
    engine.ingest("s", tool_rounds(3))
    assert seen and set(seen) == {HELD_FULL_THRESHOLD}
    assert gc.get_threshold() == thresholds


def test_a_created_anchor_whose_id_is_stored_is_merged_not_inserted_over(tmp_path):
    """A create whose id already has a row (jaclang's create of a node stored meanwhile) is merged
    with the stored row as jaclang merges it: the insert of created rows leaves a stored row as it is."""
    from jaclang.runtimelib.changeset import ChangeSet

    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("start")])
    memory = store.SharedSqliteStore(path=engine._keepalive_path)
    conn = sqlite3.connect(engine._keepalive_path)
    (key, before) = conn.execute("SELECT id, data FROM anchors WHERE arch_type = 'Session'").fetchone()
    session = memory.get(uuid.UUID(key))
    session.archetype.name = "renamed"
    changes = ChangeSet()
    changes.record_create(session)
    report = memory.apply(changes)
    assert report.applied == [session.id] and not report.failed
    after = json.loads(conn.execute("SELECT data FROM anchors WHERE id = ?", (key,)).fetchone()[0])
    assert after["archetype"]["name"] == "renamed" and after["edges"] == json.loads(before)["edges"]
    memory.close()


def test_the_rows_of_one_flush_are_written_with_one_time(tmp_path):
    """A flush gives all its rows (created, merged on their text) the time it began, instead of
    asking the clock for each row; a row written outside a flush takes its own time."""
    from datetime import datetime, timezone

    from contextrender import rows

    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("start")])
    began = datetime.now(timezone.utc)
    messages = [user("start")]
    for i in range(10):
        messages += [assistant(None, call(f"c{i}", "cat", {"path": f"a{i}.py"})), tool(f"c{i}", f"print({i})")]
    engine.ingest("s", messages)
    with sqlite3.connect(engine._keepalive_path) as conn:
        times = {row[0] for row in conn.execute("SELECT updated_at FROM anchors WHERE updated_at > ?", (began.isoformat(),))}
        written = conn.execute("SELECT count(*) FROM anchors WHERE updated_at > ?", (began.isoformat(),)).fetchone()[0]
    assert written > 40 and len(times) == 1
    assert began <= datetime.fromisoformat(times.pop()) <= datetime.now(timezone.utc)
    assert getattr(rows._flush, "time", None) is None  # no flush's time left behind: a row outside one takes the clock's


def test_one_check_of_mongodb_answers_both_store_hooks(monkeypatch):
    """Whether MongoDB keeps the graph is told by one function (`store.mongodb_configured`), which the
    store's hook and the server's both ask: MONGODB_URI set, neither opens a SQLite store."""
    from contextrender.server import bulk_mongo
    from contextrender.server.plugin import ServerPlugin

    monkeypatch.delenv("MONGODB_URI", raising=False)
    assert not store.mongodb_configured()
    monkeypatch.setenv("MONGODB_URI", "mongodb://127.0.0.1:9/none")
    assert store.mongodb_configured()
    assert store.StorePlugin.get_persistent_memory({}) is None
    # The server's hook asks the same function: told MongoDB is configured, it answers MongoDB's store.
    monkeypatch.delenv("MONGODB_URI")
    monkeypatch.setattr(store, "mongodb_configured", lambda: True)

    class Bulk:
        def is_available(self) -> bool:
            return True

    monkeypatch.setattr(bulk_mongo, "BulkMongoBackend", Bulk)
    assert isinstance(ServerPlugin.get_persistent_memory({}), Bulk)
    assert store.StorePlugin.get_persistent_memory({"db_path": "/tmp/unused.db"}) is not None


def test_a_kept_connection_loads_the_aliases_again_only_after_another_connection_wrote(tmp_path, monkeypatch):
    """jaclang loads the file's class aliases at each connection, so that one its CLI adds applies
    to the next context; a kept connection loads them again only when another connection committed
    to the file since it last did (its data_version moved), and the call then has the new alias."""
    from jaclang.runtimelib.serializer import Serializer

    loads: list[int] = []
    load = store.jac_memory._load_db_aliases
    monkeypatch.setattr(store.jac_memory, "_load_db_aliases", lambda conn: loads.append(1) or load(conn))
    monkeypatch.setattr(Serializer, "_aliases", dict(Serializer._aliases))
    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("one")])
    before = len(loads)
    for n in range(3):
        engine.ingest("s", [user(f"more {n}")], append=True)
    assert len(loads) == before, "a kept connection read the aliases again with nobody else writing"
    other = sqlite3.connect(engine._keepalive_path)
    other.execute("INSERT INTO aliases (old_name, new_name, created_at) VALUES ('old.Kind', 'graph.context.Session', 'now')")
    other.commit()
    other.close()
    engine.ingest("s", [user("after the alias")], append=True)
    assert len(loads) == before + 1 and Serializer._aliases.get("old.Kind") == "graph.context.Session"
    engine.ingest("s", [user("once more")], append=True)
    assert len(loads) == before + 1
    assert engine.get_session("s")["events"] == 6
    engine.close()
