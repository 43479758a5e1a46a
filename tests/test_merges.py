"""Stored rows merged on their text (adapters/merges.py): a row the store wrote is merged again
from its remembered parse; a merge by id stores the merged edge list apart and leaves the row as
it is, in any layout; the memo of parsed rows keeps its size exact when threads change it at once."""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid

from contextrender import edge_lists, merges, rows

from graph import context as graph  # noqa: E402  (a Jac module: importable once contextrender is)
from jaclang.jac0core.runtime import JacRuntime  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402

_READ = "SELECT type, arch_module, arch_type, fingerprint, data, format_version FROM anchors"


def _stored_result(conn: sqlite3.Connection, edges: int) -> tuple[str, tuple]:
    """A ToolResult with `edges` edges, stored as the store stores it (its edge lists apart:
    adapters/edge_lists.py); its key and the state `_merged` takes (its row, no edge list apart)."""
    result = graph.ToolResult(position=1, turn=1, raw='{"role": "tool", "content": "üñ \\"x\\""}', tokens=9, handle="r1")
    for _ in range(edges):
        JacRuntime.build_edge(is_undirected=False, conn_type=graph.Reuses(values=["v"], weight=0.5), conn_assign=None)(
            graph.Message(position=2, turn=1, raw="{}", tokens=1).__jac__, result.__jac__)
    jac_memory._create_new_schema(conn)
    edge_lists.give_form(conn)
    key = str(result.__jac__.id)
    conn.execute(rows.INSERT_ROW, (key,) + rows.anchor_row(result.__jac__))
    return (key, (conn.execute(_READ).fetchone(), None))


def _merged(conn: sqlite3.Connection, key: str, state: tuple, added: list, *, parsed: bool) -> tuple:
    """The merge by id of `added` into the node in `state` (its row and its edge list apart, put
    back first), from its row's remembered parse or (`parsed`) from a parse of its text: the
    state after it."""
    (row, apart) = state
    conn.execute(rows.INSERT_ROW, (key,) + row + (None,))
    if apart is not None:
        edge_lists.write_edge_list(conn, key, *apart)
    if parsed:
        merges._seen.clear()
    found = conn.execute(edge_lists.STORED_NODE, (key,)).fetchone()
    assert merges.merge_edge_ids(conn, key, found[:6], added, found[6:] if found[6] is not None else None)
    assert conn.execute(f"SELECT data FROM {edge_lists.ROWS}").fetchone()[0] == row[4], "the row is left as it is"
    return (row, conn.execute("SELECT edges, version FROM edge_lists WHERE node = ?", (key,)).fetchone())


def _read(conn: sqlite3.Connection) -> dict:
    """The stored node as every reader reads it (the view `anchors`), parsed."""
    return json.loads(conn.execute(_READ).fetchone()[4])


def test_a_row_the_store_wrote_is_merged_again_without_parsing_it(monkeypatch):
    """A result reused again and again is merged by id at each call: its row is taken as it was
    parsed before (no `json.loads` of it: only the edge list stored apart is read), the row is
    left as it is, and each edge list is the one a merge from a parse of the row writes."""
    conn = sqlite3.connect(":memory:")
    (key, state) = _stored_result(conn, 3)
    row_text = state[0][4]
    loads = []
    real_loads = json.loads
    monkeypatch.setattr(merges.json, "loads", lambda text, *a, **k: loads.append(text) or real_loads(text, *a, **k))
    state = _merged(conn, key, state, [uuid.uuid4()], parsed=True)
    for round_ in range(5):
        added = [uuid.uuid4() for _ in range(round_ % 3 + 1)]
        version = _read(conn)["version"]
        loads.clear()
        merged = _merged(conn, key, state, added, parsed=False)
        assert row_text not in loads
        assert merged == _merged(conn, key, state, added, parsed=True)
        assert _read(conn)["version"] == version + 1
        state = merged


def test_a_row_written_in_another_layout_is_left_as_it_is():
    """A stored row whose text is not `json.dumps` of its parse (written with other separators) is
    left as it is too: the merged edge list is stored apart, and read with the row's other values."""
    conn = sqlite3.connect(":memory:")
    (key, (row, _)) = _stored_result(conn, 2)
    spaced = json.dumps(json.loads(row[4]), indent=1)
    added = uuid.uuid4()
    _merged(conn, key, (row[:4] + (spaced,) + row[5:], None), [added], parsed=True)
    data = json.loads(spaced)
    read = _read(conn)
    assert set(read["edges"]) == set(data["edges"]) | {str(added)} and read["version"] == data["version"] + 1
    assert {k: v for (k, v) in read.items() if k not in ("edges", "version")} == {k: v for (k, v) in data.items() if k not in ("edges", "version")}


def test_the_memo_of_parsed_rows_keeps_its_size_exact_across_threads(monkeypatch):
    """Two threads writing two store files share the memo. A thread switch at the worst point (the
    first thread has emptied the memo, full, and not yet reset its character count) must not let the
    other's row go uncounted: the count is the memo's characters after both. The switch is made
    here, not waited for: the memo's `clear` runs the other thread's `_remember` and gives it 0.5 s,
    in which the lock keeps it waiting until the first is done (without the lock it finishes inside
    the window and the count drifts below the memo's size)."""

    class Switching(dict):
        def clear(self) -> None:
            super().clear()
            if switched:
                return  # one switch
            other = threading.Thread(target=merges._remember, args=("b", merges._Seen("y" * 20, {})))
            other.start()
            other.join(0.5)
            switched.append(other)

    switched: list[threading.Thread] = []
    monkeypatch.setattr(merges, "_seen", Switching())
    monkeypatch.setattr(merges, "_seen_chars", [0])
    monkeypatch.setattr(merges, "SEEN_CHARS_MAX", 100)
    merges._remember("a", merges._Seen("x" * 90, {}))
    merges._remember("a2", merges._Seen("x" * 30, {}))  # over the bound: the memo is emptied
    switched[0].join()
    assert sorted(merges._seen) == ["a2", "b"]
    assert merges._seen_chars[0] == sum(len(seen.text) for seen in merges._seen.values()) == 50


def test_a_merge_of_changed_fields_leaves_jaclangs_serialiser_out(monkeypatch):
    """A stored node merged for a changed field of the JSON types with the usual access (no root
    granted): neither the field nor the access goes through jaclang's generic serialiser (it took
    17 µs for the access's comparison and two to four times the fast path for a field, at each
    merge of the session and the render epoch), and the row is the one it writes."""
    from jaclang.runtimelib.changeset import WriteIntent, WriteOp
    from jaclang.runtimelib.serializer import Serializer

    conn = sqlite3.connect(":memory:")
    (key, (stored, _)) = _stored_result(conn, 2)
    result = graph.ToolResult(position=1, turn=1, raw="{}", tokens=9, handle="r1").__jac__
    data = json.loads(stored[4])
    result.id = uuid.UUID(key)
    result.edges = []
    for (name, value) in data["archetype"].items():
        if not name.startswith("__"):
            setattr(result.archetype, name, value)
    result.archetype.raw = '{"role": "tool", "content": ["changed", 1, 2.5, null]}'
    result.archetype.tokens = 11
    intent = WriteIntent(op=WriteOp.FIELD_UPDATE, anchor=result)
    intent.fields.update({"raw", "tokens"})
    monkeypatch.setattr(merges, "_current_node", lambda k, s, cls: merges._Seen(s[4], json.loads(s[4])))
    # The stored edges kept as stored: the node's own are left as the stored list (no edge change).
    result.edges = [type("E", (), {"id": uuid.UUID(e)})() for e in data["edges"]]
    calls = []
    real = Serializer._serialize_value
    monkeypatch.setattr(Serializer, "_serialize_value", staticmethod(lambda *a, **k: calls.append(a[0]) or real(*a, **k)))
    assert merges.merge_stored_text(conn, key, stored, intent)
    assert calls == []
    merged = json.loads(conn.execute("SELECT data FROM anchors").fetchone()[0])
    expected = dict(data, archetype=dict(data["archetype"], raw=result.archetype.raw, tokens=11))
    assert merged == expected
    # Another access (a root granted) is compared and written as jaclang's serialiser writes it.
    result.access.roots.anchors[uuid.UUID(int=7)] = result.access.all
    assert merges.merge_stored_text(conn, key, conn.execute(
        "SELECT type, arch_module, arch_type, fingerprint, data, format_version FROM anchors").fetchone(), intent)
    assert calls and json.loads(conn.execute("SELECT data FROM anchors").fetchone()[0])["access"] == real(result.access, True)


def test_the_access_comparison_is_jaclangs():
    """The stored access is the node's exactly when their sorted JSON texts are equal."""
    from jaclang.jac0core.archetype import Access, AccessLevel, Permission

    level = AccessLevel.NO_ACCESS
    usual = Permission(all=level, roots=Access())
    for stored in ({"all": level.value, "roots": {"anchors": {}}}, {"roots": {"anchors": {}}, "all": level.value},
                   {"all": bool(level.value), "roots": {"anchors": {}}}, {"all": float(level.value), "roots": {"anchors": {}}},
                   {"all": level.value, "roots": {"anchors": {"x": 1}}}, {"all": level.value}, None, []):
        texts_equal = json.dumps(stored, sort_keys=True, default=str) == json.dumps(
            {"all": level.value, "roots": {"anchors": {}}}, sort_keys=True, default=str)
        assert merges._same_access(stored, usual) is texts_equal, stored


def _merged_as_before(stored_text: str, added: list) -> str:
    """The row the merge by id wrote before its one-edge path: jaclang's edge delta on the node as
    loaded (every stored id, the new ones appended), the set merge, the whole row by `json.dumps`."""
    data = json.loads(stored_text)
    stored_ids = [uuid.UUID(e) for e in data["edges"]]
    initial = set(frozenset(stored_ids))
    current = set(e for e in stored_ids + list(added))
    (plus, minus) = (set(current - initial), set(initial - current))
    data["edges"] = [str(e) for e in (set(stored_ids) | plus) - minus]
    if plus or minus:
        data["version"] += 1
    return json.dumps(data)


def test_a_merge_by_id_of_one_new_edge_is_the_node_it_wrote_before_and_dumps_nothing(monkeypatch):
    """The usual merge by id (one new edge, the row remembered) takes the one-edge delta without the
    edge sets and writes the edge list's text without `json.dumps`; every node, for one edge, several,
    one already stored and none stored, reads as the row the general path wrote whole before the
    edge lists were apart (the same values, edge ids in the same order, the same version)."""
    conn = sqlite3.connect(":memory:")
    (key, state) = _stored_result(conn, 0)
    state = _merged(conn, key, state, [uuid.uuid4()], parsed=True)  # remembered from here on
    dumps = []
    real_dumps = json.dumps
    monkeypatch.setattr(merges.json, "dumps", lambda value, *a, **k: dumps.append(value) or real_dumps(value, *a, **k))
    for round_ in range(40):
        before = json.dumps(_read(conn))
        stored_ids = [uuid.UUID(e) for e in json.loads(before)["edges"]]
        added = [[uuid.uuid4()], [uuid.uuid4(), uuid.uuid4()], [stored_ids[0]], [stored_ids[-1], uuid.uuid4()]][round_ % 4]
        dumps.clear()
        merged = _merged(conn, key, state, added, parsed=False)
        if round_ % 4 == 0:
            assert dumps == []  # the one-edge path: no json.dumps
        assert _read(conn) == json.loads(_merged_as_before(before, added))
        assert merged == _merged(conn, key, state, added, parsed=True)
        state = merged
    # The edge list's text is json.dumps's, for no edge too.
    for texts in ([], [str(uuid.uuid4())], [str(uuid.uuid4()) for _ in range(5)]):
        assert merges._id_list(texts) == json.dumps(texts)
