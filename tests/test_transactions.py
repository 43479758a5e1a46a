"""adapters/transactions.py: the store's write transactions take turns per file, each writer's
whole wait bounded by the busy timeout, and a big flush's own transaction walks only the intents
it did not write ahead."""

from __future__ import annotations

import sqlite3
import threading
import time
from uuid import UUID

from conftest import db_file, hold_write_lock, tool_rounds, user

from contextrender import Engine, store, transactions
from contextrender.transactions import WRITE_TURNS


def _timed_writes(engines: list[Engine], sessions: list[str]) -> list[tuple[float, str]]:
    """Each (engine, session) ingests one message in its own thread, all at once: (seconds, outcome)."""
    ended: list[tuple[float, str]] = []
    started = time.monotonic()

    def write(engine: Engine, session: str) -> None:
        try:
            engine.ingest(session, [user("one more")], append=True)
            outcome = "written"
        except Exception as error:  # noqa: BLE001  (what the writer met is the outcome)
            outcome = f"{type(error).__name__}: {error}"
        ended.append((time.monotonic() - started, outcome))
    threads = [threading.Thread(target=write, args=pair) for pair in zip(engines, sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return ended


def test_writers_behind_another_process_all_give_up_at_the_busy_timeout(tmp_path, monkeypatch):
    """The review of the first version: with another process holding the file's write lock and a
    1 s busy timeout, five writers of this process gave up at 1, 2, 3, 4 and 5 s (each waited for
    its turn without a limit, then SQLite's whole timeout). Now each writer's whole wait is the
    busy timeout: all five give up at about 1 s."""
    monkeypatch.setenv("CONTEXTRENDER_STORE_BUSY_TIMEOUT", "1")
    engine = Engine(tmp_path / "store")
    sessions = [f"s{i}" for i in range(5)]
    for session in sessions:
        engine.ingest(session, [user("start")])
    taken = threading.Event()
    holder = threading.Thread(target=hold_write_lock, args=(db_file(engine), 6.0, taken))
    holder.start()
    try:
        assert taken.wait(10)
        ended = _timed_writes([engine] * 5, sessions)
    finally:
        holder.join(30)
    assert len(ended) == 5 and all("locked" in outcome for (_, outcome) in ended), ended
    assert max(seconds for (seconds, _) in ended) < 2.0, ended


def test_a_write_to_one_file_does_not_wait_for_a_stuck_write_to_another(tmp_path, monkeypatch):
    """The review of the first version: one turn for every store file of the process, so a write to
    a free file waited behind a writer of another file stuck on that file's lock (2.7-2.9 s,
    against 0.01 s without the turns)."""
    monkeypatch.setenv("CONTEXTRENDER_STORE_BUSY_TIMEOUT", "3")
    stuck, free = Engine(tmp_path / "stuck"), Engine(tmp_path / "free")
    stuck.ingest("s", [user("start")])
    free.ingest("s", [user("start")])
    taken = threading.Event()
    holder = threading.Thread(target=hold_write_lock, args=(db_file(stuck), 4.0, taken))
    holder.start()
    try:
        assert taken.wait(10)
        waiting = threading.Thread(target=_timed_writes, args=([stuck], ["s"]))
        waiting.start()
        time.sleep(0.5)  # the stuck writer holds its file's turn, waiting for SQLite's lock
        ended = _timed_writes([free], ["s"])
        waiting.join(30)
    finally:
        holder.join(30)
    assert ended[0][1] == "written" and ended[0][0] < 1.0, ended


def test_every_write_transaction_of_a_big_flush_begins_with_its_turn_held(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "WRITE_AHEAD_BATCH", 5)
    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("start")])
    path = db_file(engine)
    began: list[int] = []
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        conn = connect(*args, **kwargs)
        conn.set_trace_callback(lambda sql: began.append(WRITE_TURNS.waiting(path)) if sql.strip() == "BEGIN IMMEDIATE" else None)
        return conn

    monkeypatch.setattr(store.sqlite3, "connect", traced)
    store.release(engine._keepalive_path)  # the next call opens a (traced) connection
    engine.ingest("s", tool_rounds(12), append=False)
    assert len(began) > 10 and began == [1] * len(began)  # written ahead in batches, then the flush: each in its turn


def test_a_big_flush_walks_only_the_intents_it_did_not_write_ahead(big_flush, monkeypatch):
    """jaclang's transaction walked every intent of a big flush, the ones written ahead too (a
    no-op each, 140,000 for a 40,000-message call, the write lock held meanwhile). It now walks
    the others; the report names every intent applied, in jaclang's order, as before."""
    (messages, whole, engine) = big_flush
    walked, reports, staged = [], [], []
    apply_one, apply = store.jac_memory.SqliteMemory._apply_one, store.SharedSqliteStore._apply

    def counted(self, conn, intent):
        walked.append(intent.anchor.id)
        return apply_one(self, conn, intent)

    def reported(self, changeset):
        staged.append([intent.anchor.id for stage in changeset.staged() for intent in stage])
        reports.append(apply(self, changeset))
        return reports[-1]

    monkeypatch.setattr(store.jac_memory.SqliteMemory, "_apply_one", counted)
    monkeypatch.setattr(store.SharedSqliteStore, "_apply", reported)
    engine.ingest("s", messages, append=False)
    big = max(range(len(staged)), key=lambda i: len(staged[i]))
    assert len(staged[big]) > 60 and len(walked) < 10  # the stored nodes' edge lists, not the new rows
    assert reports[big].applied == staged[big]
    monkeypatch.undo()
    assert engine.get_session("s", include_messages=True)["messages"] == whole.get_session("s", include_messages=True)["messages"]
    assert engine.render("s", messages, budget=300).messages == whole.render("s", messages, budget=300).messages


def test_a_flush_that_rolls_back_reports_nothing_applied(tmp_path):
    class Report:
        def __init__(self, applied, conflicts=()):
            self.applied, self.conflicts = applied, list(conflicts)

    class Intent:
        def __init__(self, number):
            self.anchor = type("A", (), {"id": UUID(int=number)})

    class Changes:
        def staged(self):
            return [[Intent(1), Intent(2)], [Intent(3)]]

    # The rows written ahead are named by their ids' numbers (`UUID.int`), as adapters/store.py keys them.
    (one, two, three) = (UUID(int=1), UUID(int=2), UUID(int=3))
    own = transactions.without_written(Changes(), {1, 2})
    assert own.staged() == [[], [own.staged()[1][0]]] and not own.is_empty()
    assert transactions.with_written(Report([three]), Changes(), {1, 2}, own).applied == [one, two, three]
    assert transactions.with_written(Report([]), Changes(), {1, 2}, own).applied == []  # rolled back
    assert transactions.with_written(Report([], ["lost"]), Changes(), {1, 2}, own).applied == []


def test_a_forked_child_holds_no_turn_of_its_parents_threads():
    """A child forked while another thread of the parent holds a file's turn (multiprocessing's
    default on Linux): without `Turns.forget` after the fork, the dead ticket stayed first in the
    line and every write of the child waited out the busy timeout (the review's finding)."""
    import os

    (held, done) = (threading.Event(), threading.Event())

    def holder():
        with WRITE_TURNS.turn("forked.db", 5.0):
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(5)
        pid = os.fork()
        if pid == 0:  # the child: served at once, or exit 1
            with WRITE_TURNS.turn("forked.db", 0.5) as served:
                os._exit(0 if served else 1)
        (_, status) = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert WRITE_TURNS.waiting("forked.db") == 1  # the parent's line as it was
    finally:
        done.set()
        thread.join()
