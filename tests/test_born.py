"""A call's new anchors written as created rows outside jaclang's working set and change set
(adapters/born.py): the rows jaclang writes for them, in the call's one transaction, taken back
with a flush that wrote nothing, and an anchor looked up by its id in the call given back to
jaclang's pass."""

from __future__ import annotations

import json
import sqlite3

from conftest import assistant, call, tool, trace_prefix, user

from contextrender import Engine, born, store

from jaclang.runtimelib.changeset import WriteOp  # noqa: E402


def _db(engine: Engine) -> str:
    return str(next(engine.store.rglob("*.db")))


def _stored(engine: Engine) -> dict[str, tuple]:
    with sqlite3.connect(_db(engine)) as conn:
        return {row[0]: row[1:] for row in conn.execute(
            "SELECT id, type, arch_module, arch_type, fingerprint, data, format_version FROM anchors")}


def _flushes(monkeypatch) -> list[tuple[list, list]]:
    """Each flush's new anchors written as rows, and its intents' (operation, anchor)."""
    seen: list = []
    flush = store.SharedSqliteStore._apply

    def spy(self, changeset):  # noqa: ANN001, ANN202
        seen.append((list(born.born_of(changeset)), [(i.op, i.anchor) for i in changeset.intents.values()]))
        return flush(self, changeset)

    monkeypatch.setattr(store.SharedSqliteStore, "_apply", spy)
    return seen


def test_an_ingestions_new_anchors_are_written_as_jaclangs_rows_without_create_intents(tmp_path, monkeypatch):
    engine = Engine(tmp_path / "store")
    messages = trace_prefix(turns=12)
    engine.ingest("s", messages[:5])
    seen = _flushes(monkeypatch)
    engine.ingest("s", messages)
    ((new, intents),) = seen
    assert len(new) > 30
    # No create intent: only the stored nodes that changed (the chain's tail, the session, results
    # linked by id) went through jaclang's change set.
    assert [op for (op, _) in intents if op in (WriteOp.NODE_CREATE, WriteOp.EDGE_CREATE)] == []
    stored = _stored(engine)
    for anchor in new:
        ours = stored[str(anchor.id)]
        jaclangs = store.jac_memory._anchor_to_row(anchor)
        assert ours == tuple(jaclangs[:6]), anchor
    # Every edge id a stored node lists is stored, and both ends of every edge.
    rows = {key: json.loads(row[4]) for (key, row) in stored.items()}
    for (key, data) in rows.items():
        if data["__type__"] == "NodeAnchor":
            assert all(edge in rows for edge in data["edges"]), key
        else:
            assert data["source"] in rows and data["target"] in rows, key


def test_the_same_session_whether_new_anchors_are_written_as_rows_or_by_jaclang(tmp_path, monkeypatch):
    messages = trace_prefix(turns=10)
    engines = {}
    for writes in (True, False):
        monkeypatch.setattr(store.SharedSqliteStore, "writes_born", writes)
        engine = engines[writes] = Engine(tmp_path / f"store-{writes}")
        for end in range(3, len(messages) + 4, 4):
            engine.ingest("s", messages[:end])
        monkeypatch.undo()
    (rows, jaclangs) = (_stored(engines[True]), _stored(engines[False]))
    assert len(rows) == len(jaclangs)
    shapes = [sorted((row[0], row[2], len(json.loads(row[4]).get("edges", []))) for row in found.values())
              for found in (rows, jaclangs)]
    assert shapes[0] == shapes[1]
    render = [engine.render("s", messages, budget=2000) for engine in engines.values()]
    assert render[0].messages == render[1].messages


def test_a_new_anchor_looked_up_by_its_id_in_the_call_goes_through_jaclangs_pass(tmp_path, monkeypatch):
    """The session's index dropped between the ingestion and the render of one call: the render
    rebuilds it from the graph, and whatever it looks up by id is in the working set for the commit."""
    import walkers.render as render_module
    from engine.index import SESSION_CACHE, index_key

    check = render_module.stop_if_client_left

    def dropped(where, session):  # noqa: ANN001, ANN202
        check(where, session)
        if where == "between ingestion and the render":
            SESSION_CACHE.drop(index_key(session))

    adopted: list = []
    adopt = born.BornAsRows.adopt
    monkeypatch.setattr(born.BornAsRows, "adopt", lambda self, id: (found := adopt(self, id)) and adopted.append(id) or found)
    monkeypatch.setattr(render_module, "stop_if_client_left", dropped)
    messages = trace_prefix(turns=8)

    def renders(engine: Engine) -> list:
        return [engine.render("s", messages[:end], budget=3000).messages for end in range(4, len(messages) + 3, 3)]

    engine = Engine(tmp_path / "store")
    dropping = renders(engine)
    monkeypatch.undo()
    assert adopted
    stored = _stored(engine)
    assert all(str(id) in stored for id in adopted)
    assert dropping == renders(Engine(tmp_path / "other")) and dropping[-1] == renders(engine)[-1]


def test_new_rows_that_cannot_be_written_leave_the_store_as_it_was(tmp_path, monkeypatch):
    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("start")])
    before = (_stored(engine), engine.get_session("s")["events"])
    monkeypatch.setattr(born, "INSERT_ROW", "INSERT INTO no_such_table VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
    failed = None
    try:
        engine.ingest("s", [user("start"), assistant(None, call("c1", "bash", {"cmd": "ls"})), tool("c1", "a.py b.py")])
    except Exception as error:  # noqa: BLE001
        failed = error
    monkeypatch.undo()
    assert failed is not None and "new rows could not be written" in str(failed)
    assert (_stored(engine), engine.get_session("s")["events"]) == before
