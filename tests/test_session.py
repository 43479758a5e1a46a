"""Finding the caller's session (walkers/session.jac): one load by a derived id among any number of
sessions, and stores from before the session directory."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from contextrender import Engine, UnknownSession
from tests.conftest import assistant, call, tool, user


def conversation(tag: str) -> list[dict]:
    return [
        {"role": "system", "content": f"You are agent {tag}."},
        user(f"look up {tag}"),
        assistant(None, call(f"{tag}-c1", "lookup", {"q": tag})),
        tool(f"{tag}-c1", f"record REC_{tag.upper()}_0001 found"),
        assistant(f"Found REC_{tag.upper()}_0001."),
    ]


@pytest.fixture
def loads(monkeypatch):
    """`loads(calls)`: how many nodes and edges `calls()` reads from SQLite (jaclang's L3), with no
    anchors kept between the engine's calls (adapters/working_set.py KeptAnchors)."""
    from jaclang.runtimelib.memory import SqliteMemory

    from contextrender import working_set

    monkeypatch.setattr(working_set, "MAX_KEPT", 0)

    real = SqliteMemory.get
    count = [0]

    def counted(self, id):
        before = self.l3_fetch_count
        found = real(self, id)
        count[0] += self.l3_fetch_count - before
        return found

    monkeypatch.setattr(SqliteMemory, "get", counted)

    def counting(calls) -> int:
        count[0] = 0
        calls()
        return count[0]

    return counting


def test_a_session_is_found_among_many_with_the_loads_it_takes_alone(engine, loads):
    follow_up = conversation("probe") + [user("and then?")]
    engine.render("probe", follow_up, budget=1000)

    def calls():
        engine.render("probe", follow_up, budget=1000)
        engine.get_session("probe")

    alone = loads(calls)
    for n in range(150):
        engine.ingest(f"other-{n}", conversation(f"o{n}"))
    among_many = loads(calls)
    # The call reads the same nodes whatever else is stored: no scan of the other sessions (and
    # it does read some: a count of 0 would mean the hook no longer sees jaclang's loads).
    assert alone > 0 and among_many == alone
    assert engine.render("probe", follow_up, budget=1000).messages == follow_up
    assert engine.get_session("other-77", include_messages=True)["messages"] == conversation("o77")
    with pytest.raises(UnknownSession):
        engine.get_session("other-150")
    engine.ingest("other-150", conversation("o150"))
    listed = [s["session_id"] for s in engine.list_sessions()]
    assert listed == ["probe"] + [f"other-{n}" for n in range(151)]


def test_an_unknown_session_creates_nothing(engine):
    with pytest.raises(UnknownSession):
        engine.get_session("ghost")
    with pytest.raises(UnknownSession):
        engine.delete_session("ghost")
    assert engine.list_sessions() == []


def _root_edges(store) -> int:
    with sqlite3.connect(next((store / ".jac" / "data").glob("*.db"))) as db:
        row = db.execute("SELECT data FROM anchors WHERE arch_type = 'Root'").fetchone()
    return len(json.loads(row[0])["edges"])


def test_sessions_stored_off_the_root_move_onto_shelves_and_stay_found(tmp_path):
    """Stores written before the directory hung every session off the root, with random node ids."""
    from jaclang.jac0core.runtime import JacRuntime, JacUtils
    from jaclang.lib import connect

    from graph.context import Session
    from walkers.ingest import ingest

    store = tmp_path / "store"
    Engine(store).close()  # creates the store
    ctx = JacUtils.create_j_context(user_root=None, base_path_dir=str(store))
    token = JacRuntime.push_request_context(ctx)
    try:
        root = ctx.get_root()
        for tag in ("old1", "old2", "old3"):
            session = Session(session_id=tag, created_at=time.time())
            connect(root, session)
            ingest(session, conversation(tag))
    finally:
        JacRuntime.reset_request_context(token)
        ctx.close()
    assert _root_edges(store) == 3

    engine = Engine(store)
    # Reads find them where they are, and move nothing.
    assert engine.get_session("old2", include_messages=True)["messages"] == conversation("old2")
    assert [s["session_id"] for s in engine.list_sessions()] == ["old1", "old2", "old3"]
    assert _root_edges(store) == 3
    # The first call that may create a session moves them all below the directory.
    more = conversation("old1") + [user("again")]
    assert engine.render("old1", more, budget=1000).messages == more
    assert _root_edges(store) == 1
    assert engine.get_session("old1")["events"] == len(more) - 1
    assert engine.get_session("old3", include_messages=True)["messages"] == conversation("old3")
    engine.ingest("new", conversation("new"))
    assert [s["session_id"] for s in engine.list_sessions()] == ["old1", "old2", "old3", "new"]
    assert engine.delete_session("old2")["deleted"]
    with pytest.raises(UnknownSession):
        engine.get_session("old2")
    # A new engine (as after a restart) finds them the same way.
    assert [s["session_id"] for s in Engine(store).list_sessions()] == ["old1", "old3", "new"]


def test_list_sessions_reads_the_stored_fields_without_loading_a_session(engine, monkeypatch):
    """`list_sessions` reads each session's listed fields from the store's rows (walkers/session.jac
    `session_rows`): no Session is loaded, and the rows are the ones the loaded sessions give."""
    from jaclang.runtimelib.memory import SqliteMemory

    from contextrender import working_set
    from contextrender.store import SharedSqliteStore
    from graph.context import Session

    monkeypatch.setattr(working_set, "MAX_KEPT", 0)  # the sessions are loaded from the store, not kept
    for n in range(12):
        engine.ingest(f"s{n}", conversation(f"t{n}"))
    engine.create_session("named", name="My session")
    engine.ingest("forked", conversation("f"))
    engine.ingest("forked", conversation("f")[:2] + [user("something else")])  # a rewrite: branch 1
    real = SqliteMemory.get
    loaded: list[str] = []

    def counted(self, id):
        found = real(self, id)
        if found is not None and isinstance(found.archetype, Session):
            loaded.append(found.archetype.session_id)
        return found

    monkeypatch.setattr(SqliteMemory, "get", counted)
    listed = engine.list_sessions()
    assert loaded == []
    by_id = {row["session_id"]: row for row in listed}
    assert by_id["named"]["name"] == "My session" and by_id["forked"]["branch"] == 1
    assert by_id["s3"]["events"] == len(conversation("t3")) - 1  # the system prompt is kept off the chain
    # The same rows as from the loaded sessions (a store that cannot read its rows).
    monkeypatch.setattr(SharedSqliteStore, "edge_targets", lambda *args: None)
    assert engine.list_sessions() == listed
    assert sorted(loaded) == sorted(by_id)


def test_a_root_holds_at_most_its_quota_of_sessions_and_counts_stored_bytes(engine, monkeypatch):
    from contextrender.core import QuotaExceeded
    from contextrender.server.errors import _error_statuses

    monkeypatch.setenv("CONTEXTRENDER_MAX_SESSIONS_PER_USER", "3")
    for tag in ("a", "b", "c"):
        engine.ingest(tag, conversation(tag))
    before = engine.list_sessions()
    with pytest.raises(QuotaExceeded, match="CONTEXTRENDER_MAX_SESSIONS_PER_USER=3") as refused:
        engine.ingest("d", conversation("d"))
    assert refused.value.status == 403 and _error_statuses()["QuotaExceeded"] == 403
    with pytest.raises(QuotaExceeded):
        engine.render("d", conversation("d"), budget=300)
    assert engine.list_sessions() == before
    # The sessions held still take writes; a deletion makes room.
    engine.ingest("a", [user("and more")], append=True)
    engine.delete_session("b")
    engine.ingest("d", conversation("d"))
    # Each session counts the bytes of its events (their JSON), in list_sessions and get_session.
    stored = {s["session_id"]: s["stored_bytes"] for s in engine.list_sessions()}
    assert stored["d"] == sum(len(json.dumps(m, ensure_ascii=False).encode()) for m in conversation("d")[1:])
    assert stored["a"] == stored["d"] + len(json.dumps(user("and more")).encode())
    assert engine.get_session("a")["stored_bytes"] == stored["a"]
