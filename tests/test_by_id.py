"""Edges added to a stored node by its id alone (adapters/by_id.py, made by ingestion
for a `Reuses` edge to a result an earlier call stored): the node is never loaded, and it reads
back as the row jaclang's merge writes for the node a call would have loaded and linked (the same
values, its edge ids in the same order, the same version), its row left as it is and its edge
list stored apart (adapters/edge_lists.py); a row in an earlier format is merged as jaclang merges
the node loaded from it."""

from __future__ import annotations

import json
import sqlite3

from conftest import trace_prefix

from contextrender import Engine, by_id, store

from jaclang.jac0core.archetype import EdgeAnchor  # noqa: E402
from jaclang.runtimelib.changeset import WriteIntent, WriteOp  # noqa: E402
from jaclang.runtimelib.serializer import Serializer  # noqa: E402


def _by_id_compared_with_jaclang(engine: Engine, monkeypatch, sessions: list[list[dict]]) -> list[str]:
    """Ingest each message list in rounds of 3 messages; every merge by id compared with jaclang's
    own merge (inside a savepoint, rolled back) of the node as a load gives it, the new edges
    appended in their order; the archetypes merged by id."""
    merged_by_id = store.SharedSqliteStore._merge_edge_ids
    loaded = store.SharedSqliteStore.get
    checked: list[str] = []
    loads: set = set()

    def read(conn, key):  # noqa: ANN001, ANN202  (the node as every reader reads it, parsed)
        row = conn.execute("SELECT type, arch_module, arch_type, fingerprint, data, format_version FROM anchors WHERE id = ?",
                           (key,)).fetchone()
        return (*row[:4], json.loads(row[4]), row[5])

    def compared(self, conn, intent):
        key = str(intent.anchor.id)
        (row_text, fingerprint) = conn.execute("SELECT data, fingerprint FROM anchor_rows WHERE id = ?", (key,)).fetchone()
        (text,) = conn.execute("SELECT data FROM anchors WHERE id = ?", (key,)).fetchone()
        node = Serializer.deserialize(json.loads(text))  # as a load gives it
        for id in intent.edges_added:
            link = object.__new__(EdgeAnchor)
            link.id = id
            node.edges.append(link)
        conn.execute("SAVEPOINT jaclang")
        store.jac_memory.SqliteMemory._merge_write(self, conn, WriteIntent(op=WriteOp.EDGE_LIST_DELTA, anchor=node))
        expected = read(conn, key)
        conn.execute("ROLLBACK TO jaclang")
        conn.execute("RELEASE jaclang")
        merged_by_id(self, conn, intent)
        assert read(conn, key) == expected
        if fingerprint == type(node.archetype).__jac_fingerprint__:  # (the current format: merged apart)
            assert conn.execute("SELECT data FROM anchor_rows WHERE id = ?", (key,)).fetchone() == (row_text,)
        checked.append(type(node.archetype).__name__)

    def get(self, id):  # noqa: ANN001, ANN202
        loads.add(id)
        return loaded(self, id)

    monkeypatch.setattr(store.SharedSqliteStore, "_merge_edge_ids", compared)
    monkeypatch.setattr(store.SharedSqliteStore, "get", get)
    linked: set = set()
    record = store.links_by_id
    monkeypatch.setattr(store, "links_by_id", lambda intent: record(intent) and not linked.add(intent.anchor.id))
    for (n, messages) in enumerate(sessions):
        for end in range(4, len(messages) + 3, 3):
            engine.ingest(f"s{n}", messages[:end])
    # Merged by id, and never loaded by the calls that linked them.
    assert linked and not linked & loads
    return checked


def test_a_reuse_of_an_earlier_result_is_merged_by_id_as_jaclang_merges_the_loaded_result(tmp_path, monkeypatch):
    engine = Engine(tmp_path / "store")
    checked = _by_id_compared_with_jaclang(engine, monkeypatch, [trace_prefix(turns=20)])
    assert set(checked) == {"ToolResult"} and len(checked) >= 4


def test_a_result_stored_in_an_earlier_format_is_merged_as_jaclang_merges_it(tmp_path, monkeypatch):
    from graph.context import ToolResult

    engine = Engine(tmp_path / "store")
    messages = trace_prefix(turns=14)
    current = ToolResult.__jac_fingerprint__
    with monkeypatch.context() as earlier:
        earlier.setattr(ToolResult, "__jac_fingerprint__", "written-by-an-earlier-version")
        engine.ingest("s0", messages[:-8])
    on_text: list[tuple] = []
    merge = by_id.merge_edge_ids
    monkeypatch.setattr(by_id, "merge_edge_ids", lambda conn, key, *args: on_text.append((key, merge(conn, key, *args))) or on_text[-1][1])
    checked = _by_id_compared_with_jaclang(engine, monkeypatch, [messages])
    assert "ToolResult" in checked and any(not done for (_, done) in on_text)
    with sqlite3.connect(str(next((tmp_path / "store").rglob("*.db")))) as conn:
        # jaclang's merge wrote the row in the current format.
        for (key, _) in on_text:
            assert conn.execute("SELECT fingerprint FROM anchors WHERE id = ?", (key,)).fetchone() == (current,)
    assert ToolResult.__jac_fingerprint__ == current
    assert len(engine.get_session("s0", include_messages=True)["messages"]) == len(messages)


def test_without_a_store_that_merges_by_id_the_result_is_loaded_and_linked(tmp_path, monkeypatch):
    monkeypatch.setattr(store.SharedSqliteStore, "merges_edge_ids", False)
    linked: list = []
    monkeypatch.setattr(store.SharedSqliteStore, "_merge_edge_ids", lambda self, conn, intent: linked.append(intent))
    engine = Engine(tmp_path / "store")
    messages = trace_prefix(turns=14)
    links = sum(engine.ingest("s", messages[:end]).reuse_links for end in range(4, len(messages) + 3, 3))
    assert links > 4 and linked == []


def test_a_result_is_linked_by_id_only_when_the_callers_root_may_connect_to_it(tmp_path):
    """jaclang's check answers WRITE for the system root and for a node stored under the caller's
    root: only then is a stored result linked by id (its stored root read once a call)."""
    import types
    import uuid

    import walkers.ingest as ingest_module

    engine = Engine(tmp_path / "store")
    engine.ingest("s", trace_prefix(turns=3))
    path = _db(tmp_path)
    with sqlite3.connect(path) as conn:
        (mine, theirs) = [uuid.UUID(row[0]) for row in conn.execute("SELECT id FROM anchors WHERE arch_type = 'ToolResult' LIMIT 2")]
        owner = uuid.uuid4()
        conn.execute("UPDATE anchors SET data = json_set(data, '$.root', ?) WHERE id = ?", (str(owner), str(mine)))
    l3 = store.SharedSqliteStore(path=path)
    asked: list = []
    stored_roots = l3.stored_roots
    l3.stored_roots = lambda ids: asked.append(ids) or stored_roots(ids)
    system = types.SimpleNamespace(id=uuid.UUID(int=0))

    def lean(user):  # noqa: ANN001, ANN202
        context = types.SimpleNamespace(user_root=user, system_root=system, mem=types.SimpleNamespace(l3=l3))
        return ingest_module.LeanLinks(context=context, indexed=False, by_id=True)

    as_owner = lean(types.SimpleNamespace(id=owner))
    assert ingest_module._owned(mine, as_owner) and not ingest_module._owned(theirs, as_owner)
    assert ingest_module._owned(mine, as_owner) and len(asked) == 2  # once a node a call
    as_system = lean(system)
    assert ingest_module._owned(mine, as_system) and ingest_module._owned(theirs, as_system) and len(asked) == 2
    assert not ingest_module._owned(uuid.uuid4(), lean(types.SimpleNamespace(id=owner)))  # not stored
    l3.close()


def test_a_result_linked_by_id_and_reached_later_in_the_same_call_keeps_its_edge(tmp_path, monkeypatch):
    """The session's index dropped between the ingestion and the render (as another call's put
    over the cache's size does): the render rebuilds it from the graph in the same call, which
    resolves the targets of the operations' edges, populating the stubs linked by id in place.
    Their edges are still merged by id: every Reuses edge in its result's edge list."""
    import walkers.render as render_module
    from engine.index import SESSION_CACHE, index_key

    check = render_module.stop_if_client_left

    def dropped(where, session):  # noqa: ANN001, ANN202
        check(where, session)
        if where == "between ingestion and the render":
            SESSION_CACHE.drop(index_key(session))

    monkeypatch.setattr(render_module, "stop_if_client_left", dropped)
    import walkers.ingest as ingest_module

    linked: list = []
    link_by_id = ingest_module._link_by_id
    monkeypatch.setattr(ingest_module, "_link_by_id", lambda *args: link_by_id(*args) and not linked.append(args[1]))
    engine = Engine(tmp_path / "store")
    messages = trace_prefix(turns=14)
    for end in range(4, len(messages) + 3, 3):
        engine.render("s", messages[:end], budget=3000)
    with sqlite3.connect(_db(tmp_path)) as conn:
        rows = {key: json.loads(data) for (key, data) in conn.execute("SELECT id, data FROM anchors")}
    reuses = [key for (key, data) in rows.items() if data["archetype"]["__type__"] == "Reuses"]
    assert len(linked) > 4 and len(reuses) > 4
    assert [key for key in reuses if key not in rows[rows[key]["target"]]["edges"]] == []


def test_a_result_deleted_before_the_flush_replays_the_call_once_naming_it(tmp_path, monkeypatch):
    """The system root (the Engine) links a stored result by id without reading its row; the row
    deleted before the call's flush (by another process) is a lost race that names the result, and
    the one replay, which loads the session afresh, completes the call."""
    engine = Engine(tmp_path / "store")
    messages = trace_prefix(turns=14)
    for end in range(4, len(messages) - 6, 3):
        engine.ingest("s", messages[:end])
    deleted: list[str] = []
    apply = store.SharedSqliteStore._apply

    def deleted_meanwhile(self, changeset):  # noqa: ANN001, ANN202
        linked = [str(i.anchor.id) for i in changeset.intents.values() if by_id.links_by_id(i)]
        if linked and not deleted:
            with sqlite3.connect(_db(tmp_path)) as other:
                other.execute("DELETE FROM anchors WHERE id = ?", (linked[0],))
            deleted.append(linked[0])
        return apply(self, changeset)

    monkeypatch.setattr(store.SharedSqliteStore, "_apply", deleted_meanwhile)
    raised: list[BaseException] = []
    attempt = engine._attempt

    def attempted(walker):  # noqa: ANN001, ANN202
        try:
            return attempt(walker)
        except BaseException as error:
            raised.append(error)
            raise

    monkeypatch.setattr(engine, "_attempt", attempted)
    assert engine.ingest("s", messages).events > 0
    assert len(deleted) == 1 and [type(e) for e in raised] == [by_id.ResultGone]
    assert deleted[0] in str(raised[0]) and "no longer in the store" in str(raised[0])


def test_a_result_first_found_gone_on_a_later_attempt_still_gets_its_replay(tmp_path, monkeypatch):
    """An ordinary lost race, then a result gone, then a clean attempt: the call completes (the one
    replay a gone result gets counts gone results, not attempts)."""
    import uuid

    from jaclang.runtimelib.changeset import WriteConflict

    engine = Engine(tmp_path / "store")
    attempt = engine._attempt
    raised = iter([WriteConflict(anchor_id=uuid.uuid4(), expected_version=0, actual_version=1),
                   by_id.ResultGone(anchor_id=uuid.uuid4(), expected_version=0, actual_version=-1)])
    attempts: list = []

    def lost_then_gone(walker):  # noqa: ANN001, ANN202
        attempts.append(walker)
        failure = next(raised, None)
        if failure is not None:
            raise failure
        return attempt(walker)

    monkeypatch.setattr(engine, "_attempt", lost_then_gone)
    summary = engine.ingest("s", trace_prefix(turns=3))
    assert len(attempts) == 3 and summary.added > 0


def test_a_result_still_gone_on_the_replay_fails_the_call_at_once_naming_it(tmp_path, monkeypatch):
    """Met again on the one replay, a result gone from the store ends the call with its name, not
    after every attempt with "the store kept changing"."""
    import uuid

    import pytest

    from contextrender import ContextRenderError

    engine = Engine(tmp_path / "store")
    gone = uuid.uuid4()
    attempts: list = []

    def still_gone(walker):  # noqa: ANN001, ANN202
        attempts.append(walker)
        raise by_id.ResultGone(anchor_id=gone, expected_version=0, actual_version=-1)

    monkeypatch.setattr(engine, "_attempt", still_gone)
    with pytest.raises(ContextRenderError, match=f"result {gone}, which this call links a Reuses edge to, is no longer in the store"):
        engine.ingest("s", trace_prefix(turns=3))
    assert len(attempts) == 2


def _db(tmp_path) -> str:  # noqa: ANN001
    return str(next((tmp_path / "store").rglob("*.db")))


# Put on the server's PYTHONPATH: the id of every node the store merges edges into by id.
MERGE_SPY = """import os, sys, threading, time
def _install():
    while getattr(sys.modules.get("contextrender.store"), "SharedSqliteStore", None) is None:
        time.sleep(0.05)
    store = sys.modules["contextrender.store"].SharedSqliteStore
    merge = store._merge_edge_ids
    def _merge_edge_ids(self, conn, intent):
        with open(os.environ["BY_ID_SPY_LOG"], "a") as log:
            log.write(f"{intent.anchor.id}\\n")
        return merge(self, conn, intent)
    store._merge_edge_ids = _merge_edge_ids
threading.Thread(target=_install, daemon=True).start()
"""


def test_on_the_server_reuses_are_merged_by_id_and_every_edge_is_in_both_its_ends_lists(tmp_path):
    """A user's calls on the server (its own root, not the system root), in rounds: the server
    links reuses of earlier results by id (the store's merge by id is called, on result rows), each
    stored `Reuses` edge is in the edge lists of its operation and of its result, and the session
    reads."""
    import uuid

    from contextrender import Client
    from jacserver import JacServer

    (tmp_path / "spy").mkdir()
    (tmp_path / "spy" / "sitecustomize.py").write_text(MERGE_SPY)
    log = tmp_path / "merged.log"
    messages = trace_prefix(turns=14)
    server = JacServer(tmp_path / "server", PYTHONPATH=str(tmp_path / "spy"), BY_ID_SPY_LOG=str(log)).start()
    try:
        with Client(server.url) as client:
            client.register(f"user_{uuid.uuid4().hex[:8]}", "secret-password-1")
            links = sum(client.ingest("by-id", messages[:end]).reuse_links for end in range(4, len(messages) + 3, 3))
            assert client.get_session("by-id", include_messages=True)["messages"] == messages
    finally:
        server.stop()
    assert links > 4
    path = str(next((server.workdir / ".jac" / "data").glob("anchor_store.db")))
    with sqlite3.connect(path) as conn:
        rows = {key: json.loads(data) for (key, data) in conn.execute("SELECT id, data FROM anchors")}
    merged = log.read_text().split() if log.exists() else []
    assert len(merged) >= 3 and {rows[key]["archetype"]["__type__"] for key in merged} == {"ToolResult"}
    reuses = [(key, data) for (key, data) in rows.items() if data["archetype"]["__type__"] == "Reuses"]
    assert len(reuses) >= links
    for (key, data) in reuses:
        assert key in rows[data["source"]]["edges"] and key in rows[data["target"]]["edges"]
