"""A node's edge list kept apart from its row (adapters/edge_lists.py): every reader of the store
reads the graph as the rows held it whole (jaclang's own SqliteMemory as `jac db` and `jac dot`
open the file, its fsck); a row written whole takes its edge list back; a deleted node's goes; a
store written before this form is given it when first opened, and reads and writes as before."""

from __future__ import annotations

import json
import sqlite3
import uuid

from conftest import trace_prefix

from contextrender import Engine, edge_lists, merges

from jaclang.runtimelib.changeset import ChangeSet  # noqa: E402
from jaclang.runtimelib.memory import SqliteMemory  # noqa: E402


def _store(tmp_path) -> str:
    return str(next((tmp_path / "store").rglob("*.db")))


def _ingested(tmp_path, session: str = "s", turns: int = 20) -> Engine:
    """An Engine whose session was ingested in rounds of 3 messages (its results reused by later
    calls get `Reuses` edges by id: their edge lists apart)."""
    engine = Engine(tmp_path / "store")
    messages = trace_prefix(turns=turns)
    for end in range(4, len(messages) + 3, 3):
        engine.ingest(session, messages[:end])
    return engine


def _apart(path: str) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [node for (node,) in conn.execute("SELECT node FROM edge_lists")]


def test_jaclangs_own_store_reads_the_edge_lists_kept_apart(tmp_path):
    """`jac db fsck` and `jac dot` open the file with jaclang's SqliteMemory, not ContextRender's
    store: through the view it loads each node with its edge list apart, and its fsck finds no
    edge that one end does not cite (it would collect those edges on repair)."""
    engine = _ingested(tmp_path)
    path = _store(tmp_path)
    apart = _apart(path)
    assert apart, "results reused by id have their edge list apart"
    memory = SqliteMemory(path=path)
    with sqlite3.connect(path) as conn:
        for key in apart:
            node = memory.get(uuid.UUID(key))
            (row_text, edges, version) = conn.execute(
                "SELECT r.data, e.edges, e.version FROM anchor_rows AS r JOIN edge_lists AS e ON e.node = r.id WHERE r.id = ?",
                (key,)).fetchone()
            assert [str(e.id) for e in node.edges] == json.loads(edges) and node.version == version
            assert json.loads(edges) != json.loads(row_text)["edges"], "the row is not rewritten for a new edge"
    report = memory.fsck(repair=False)
    assert not report["half_linked_edges"] and not report["orphan_edges"] and not report["dangling_node_edge"]
    memory.close()
    engine.close()


def test_a_row_written_whole_takes_its_edge_list_back(tmp_path):
    """jaclang's merge of a node with its edge list apart (a field changed: the row written whole,
    through the view) writes the row with the edge list it read, and the edge list apart goes."""
    engine = _ingested(tmp_path)
    path = _store(tmp_path)
    key = _apart(path)[0]
    memory = SqliteMemory(path=path)
    node = memory.get(uuid.UUID(key))
    edges = [str(e.id) for e in node.edges]
    node.archetype.tokens += 1
    changes = ChangeSet()
    changes.record_create(node)
    assert memory.apply(changes).applied == [node.id]
    with sqlite3.connect(path) as conn:
        (text,) = conn.execute("SELECT data FROM anchor_rows WHERE id = ?", (key,)).fetchone()
        assert json.loads(text)["edges"] == edges and key not in _apart(path)
    memory.close()
    engine.close()


def test_a_deleted_sessions_edge_lists_go_with_it(tmp_path):
    """Deleting a session deletes its nodes' rows through the view: their edge lists apart go too
    (the session's shelf, which stays, keeps its own: its edge to the session removed)."""
    engine = _ingested(tmp_path)
    path = _store(tmp_path)
    results = set(_apart(path))
    assert results
    engine.delete_session("s")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM edge_lists AS e LEFT JOIN anchor_rows AS r ON r.id = e.node"
                            " WHERE r.id IS NULL").fetchone() == (0,)
        assert not results & set(_apart(path))
        assert conn.execute("SELECT count(*) FROM anchors WHERE arch_type = 'ToolResult'").fetchone() == (0,)
    engine.close()


def _as_written_before(path: str) -> None:
    """The store put back in jaclang's form, as earlier versions wrote it: one table `anchors`,
    each node's row holding its edge list (as `json.dumps` writes a row)."""
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT id, data FROM anchors").fetchall()
        conn.execute("DROP VIEW anchors")
        conn.execute("DROP TABLE edge_lists")
        conn.execute("ALTER TABLE anchor_rows RENAME TO anchors")
        for (key, text) in rows:
            conn.execute("UPDATE anchors SET data = ? WHERE id = ?", (json.dumps(json.loads(text)), key))
        conn.execute("DELETE FROM schema_meta WHERE key = 'edge_lists'")
    with sqlite3.connect(path) as conn:
        assert not edge_lists.has_form(conn)


def test_a_store_written_before_is_given_the_form_and_reads_and_writes_as_before(tmp_path):
    engine = _ingested(tmp_path, turns=14)
    before = engine.get_session("s", include_messages=True)
    engine.close()
    path = _store(tmp_path)
    _as_written_before(path)
    with sqlite3.connect(path) as conn:
        rows = dict(conn.execute("SELECT id, data FROM anchors").fetchall())
    engine = Engine(tmp_path / "store")
    assert engine.get_session("s", include_messages=True) == before
    with sqlite3.connect(path) as conn:
        assert edge_lists.has_form(conn)
        assert conn.execute("SELECT value FROM schema_meta WHERE key = 'edge_lists'").fetchone() == (edge_lists.EDGE_LISTS_VERSION,)
        assert dict(conn.execute("SELECT id, data FROM anchor_rows").fetchall()) == rows, "the rows are left as they were"
    messages = trace_prefix(turns=20)
    for end in range(4, len(messages) + 3, 3):
        engine.ingest("s", messages[:end])
    assert len(engine.get_session("s", include_messages=True)["messages"]) == len(messages)
    assert _apart(path)
    engine.close()


def test_an_insert_the_stored_row_turns_away_keeps_the_edge_list_apart(tmp_path):
    """Through the view, `INSERT OR IGNORE` of a node's own row text (an earlier version's insert of
    a row it created) changes nothing: its edge list apart stays. `INSERT OR REPLACE` writes the
    row whole, and the edge list apart goes (the row holds the list it was read with)."""
    engine = _ingested(tmp_path)
    path = _store(tmp_path)
    key = _apart(path)[0]
    with sqlite3.connect(path) as conn:
        columns = "id, type, arch_module, arch_type, fingerprint, data, format_version, updated_at"
        row = conn.execute(f"SELECT {columns} FROM anchor_rows WHERE id = ?", (key,)).fetchone()
        read = conn.execute("SELECT data FROM anchors WHERE id = ?", (key,)).fetchone()
        conn.execute(f"INSERT OR IGNORE INTO anchors ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
        assert key in _apart_in(conn) and conn.execute("SELECT data FROM anchors WHERE id = ?", (key,)).fetchone() == read
        conn.execute(f"INSERT OR REPLACE INTO anchors ({columns}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row[:5] + read + row[6:])
        assert key not in _apart_in(conn) and json.loads(conn.execute("SELECT data FROM anchors WHERE id = ?", (key,)).fetchone()[0]) == json.loads(read[0])
    engine.close()


def _apart_in(conn: sqlite3.Connection) -> list[str]:
    return [node for (node,) in conn.execute("SELECT node FROM edge_lists")]


def test_a_node_holding_a_float_that_is_no_number_is_merged_whole(tmp_path):
    """SQLite's JSON functions refuse NaN and Infinity (which `json.dumps` writes): a node whose row
    holds one never gets its edge list apart, where the view could not read it; a merge by id
    writes its row whole, as jaclang does, and it reads back."""
    engine = _ingested(tmp_path)
    path = _store(tmp_path)
    with sqlite3.connect(path) as conn:
        (key, text) = conn.execute("SELECT r.id, r.data FROM anchor_rows AS r LEFT JOIN edge_lists AS e ON e.node = r.id"
                                   " WHERE r.arch_type = 'ToolResult' AND e.node IS NULL").fetchone()
        data = json.loads(text)
        floats = [name for (name, value) in data["archetype"].items() if isinstance(value, float)]
        assert floats, "a result has a float field"
        data["archetype"][floats[0]] = float("nan")
        conn.execute("UPDATE anchor_rows SET data = ? WHERE id = ?", (json.dumps(data), key))
        stored = conn.execute(edge_lists.STORED_NODE, (key,)).fetchone()
        assert not merges.merge_edge_ids(conn, key, stored[:6], [uuid.uuid4()], None)
        assert key not in _apart_in(conn)
        conn.execute("SELECT data FROM anchors").fetchall()  # every row reads through the view
    engine.close()
