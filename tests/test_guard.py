"""The request guard's session locks and its watch on the client (adapters/server/guard.py), on a
fake walker app: a new session is made under the user's lock in a call of its own, and not behind
another session's ingestion; a call whose client has left is not run, or sees that it has."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid

import pytest

from conftest import assistant, call, tool, user
from contextrender import core
from contextrender.client import Client
from contextrender.server.guard import RequestGuard

ROOT_WRITERS = {"create_session", "ingest_events", "render_context", "configure_session", "delete_session"}


class FakeWalkers:
    """An ASGI app answering /walker/<name> as jac-scale does (the reports in `data`). An ingest
    of a session in `held` waits until the test releases it; `failing` sessions answer 400."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.held: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = {}
        self.failing: set[str] = set()
        self.sessions: set[str] = set()
        self.creating = 0
        self.most_creating = 0
        self.left_seen: dict[str, bool] = {}
        self.turns: dict[str, object] = {}
        self.stored_bytes: dict[str, int] = {}

    async def __call__(self, scope: dict, receive, send) -> None:
        body = json.loads((await receive())["body"])
        walker, session = scope["path"].removeprefix("/walker/"), body.get("session_id")
        status, report = 200, {}
        if walker == "list_sessions":  # the guard's read of the stored total (not a call of the test's)
            report = [{"session_id": s, "stored_bytes": self.stored_bytes.get(s, 0)} for s in sorted(self.sessions)]
            payload = json.dumps({"ok": True, "data": {"reports": [report]}}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": payload})
            return
        self.calls.append((walker, session))
        if walker == "create_session":
            self.creating += 1
            self.most_creating = max(self.most_creating, self.creating)
            await asyncio.sleep(0.02)  # another creation would overlap now if it were let in
            self.creating -= 1
            report = {"created": session not in self.sessions}
            self.sessions.add(session)
        elif walker == "delete_session":
            self.sessions.discard(session)
        else:
            self.entered.setdefault(session, asyncio.Event()).set()
            # The call's turn, as engine/courtesy.jac reads it in the walker's thread.
            self.turns[session] = core.TURN.get()
            if session in self.held:
                await self.held[session].wait()
            # What engine/cancel.jac reads in the walker's thread.
            self.left_seen[session] = core.CLIENT_LEFT.get().is_set()
            if session in self.failing:
                status = 400
        payload = json.dumps({"ok": status < 300, "data": {"reports": [report]}}).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


class Request:
    """One request to the guard: its answer, and a client that can leave."""

    def __init__(self, guard: RequestGuard, walker: str, session: str, user: str = "alice", messages: list | None = None) -> None:
        self.gone = asyncio.Event()
        self.status: int | None = None
        body = json.dumps({"session_id": session, "messages": messages or []}).encode()
        scope = {"type": "http", "path": f"/walker/{walker}", "headers": [(b"content-length", str(len(body)).encode())],
                 "state": {"username": user}}
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await self.gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]

        self.task = asyncio.ensure_future(guard(scope, receive, send))


def run(test) -> None:
    app = FakeWalkers()
    guard = RequestGuard(app, fields_of=lambda name, caller: None, root_writers=ROOT_WRITERS)
    asyncio.run(asyncio.wait_for(test(app, guard), timeout=60))


def test_a_new_session_is_not_made_to_wait_behind_another_sessions_ingestion():
    async def test(app: FakeWalkers, guard: RequestGuard) -> None:
        app.held["big"] = asyncio.Event()
        big = Request(guard, "ingest_events", "big")
        await app.entered.setdefault("big", asyncio.Event()).wait()
        # The big ingestion of a new session is running; the same user's new session is answered
        # meanwhile (before this change it waited for the big one's end, which never comes here).
        small = Request(guard, "ingest_events", "small")
        await small.task
        assert small.status == 200 and not big.task.done()
        app.held["big"].set()
        await big.task
        assert big.status == 200
        # Each session was made by a call of its own before the call that writes it.
        assert app.calls == [("create_session", "big"), ("ingest_events", "big"),
                             ("create_session", "small"), ("ingest_events", "small")]

    run(test)


def test_new_sessions_are_made_one_at_a_time_per_user_and_a_refused_first_call_leaves_none():
    async def test(app: FakeWalkers, guard: RequestGuard) -> None:
        app.failing.add("bad-3")
        requests = [Request(guard, "ingest_events", f"{'bad' if n == 3 else 'new'}-{n}") for n in range(6)]
        requests.append(Request(guard, "ingest_events", "of-bob", user="bob"))
        await asyncio.gather(*(r.task for r in requests))
        assert [r.status for r in requests] == [200, 200, 200, 400, 200, 200, 200]
        # Alice's creations never overlapped (Bob's may overlap one of hers: other root).
        assert app.most_creating <= 2
        creations = [s for (w, s) in app.calls if w == "create_session"]
        assert sorted(creations) == sorted(["new-0", "new-1", "new-2", "bad-3", "new-4", "new-5", "of-bob"])
        # The session made for the refused call is deleted again (if nothing was stored in it).
        assert ("delete_session", "bad-3") in app.calls and "bad-3" not in app.sessions
        # A known session is not made again.
        again = Request(guard, "ingest_events", "new-0")
        await again.task
        assert app.calls[-1] == ("ingest_events", "new-0") and app.calls.count(("create_session", "new-0")) == 1

    async def alice_only(app: FakeWalkers, guard: RequestGuard) -> None:
        requests = [Request(guard, "ingest_events", f"one-of-{n}") for n in range(5)]
        await asyncio.gather(*(r.task for r in requests))
        assert app.most_creating == 1

    run(test)
    run(alice_only)


def test_a_call_whose_client_left_is_not_run_and_a_running_one_sees_it():
    async def test(app: FakeWalkers, guard: RequestGuard) -> None:
        guard.remember(("alice", "s"))
        app.held["s"] = asyncio.Event()
        slow = Request(guard, "ingest_events", "s")
        await app.entered.setdefault("s", asyncio.Event()).wait()
        queued = Request(guard, "ingest_events", "s")
        await asyncio.sleep(0.05)
        queued.gone.set()  # its client leaves while it waits for the session
        slow.gone.set()  # and the running call's client too
        await asyncio.sleep(0.05)
        app.held["s"].set()
        await asyncio.gather(slow.task, queued.task)
        # The running call saw its client leave (the walker stops at its next safe point); the
        # queued one never reached the app; the next call of the session is served.
        assert app.left_seen["s"] is True
        assert app.calls == [("ingest_events", "s")]
        del app.held["s"]
        following = Request(guard, "ingest_events", "s")
        await following.task
        assert following.status == 200 and app.left_seen["s"] is False and len(guard.locks) == 0

    run(test)


# ---------------------------------------------------------------- the same on a real server


def long_run(rounds: int, tag: str = "") -> list[dict]:
    """A long agent run: `rounds` tool calls with their results (about 270 bytes a round). Each
    `tag` gives other ids, so the server's caches of counts and embeddings know none of its texts."""
    messages = [user(f"start {tag}")]
    for i in range(rounds):
        messages.append(assistant(None, call(f"c{i}", "get", {"order": f"ORD_{tag}{i}"})))
        messages.append(tool(f"c{i}", f"order ORD_{tag}{i} status shipped, item {i * 7}, value {i * 13}"))
    return messages


def left_line(server, since: int, finished=lambda: False, timeout: float = 120.0) -> str:
    """The server's log line (written after offset `since`) about a client that left, once it is
    there; "answered before the client left" when `finished()` says the call ended and no such line
    came (the answer was sent before the connection closed, so the server saw no client leave)."""
    deadline = time.monotonic() + timeout
    ended_at = None
    while time.monotonic() < deadline:
        with open(server.log, "rb") as log:
            log.seek(since)
            found = [line for line in log.read().decode(errors="replace").splitlines() if "the client left" in line
                     or "closed the connection before" in line]
        if found:
            return found[0]
        if ended_at is None and finished():
            ended_at = time.monotonic()
        if ended_at is not None and time.monotonic() - ended_at > 2.0:
            return "answered before the client left"
        time.sleep(0.05)
    raise AssertionError("the server never logged the client that left")


def sessions_of(client: Client) -> set[str]:
    return {s["session_id"] for s in client.list_sessions()}


def raw_post(server, token: str, walker: str, body: dict) -> tuple[socket.socket, bytes]:
    payload = json.dumps(body).encode()
    head = (f"POST /walker/{walker} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    return socket.create_connection(("127.0.0.1", server.port), timeout=60), head + payload


@pytest.fixture(scope="module")
def carol(jac_server):
    with Client(jac_server.url) as client:
        client.register(f"guard_{uuid.uuid4().hex[:8]}", "secret-password-1")
        yield client


def test_a_new_session_is_answered_while_a_long_first_ingestion_runs(jac_server, carol):
    big = long_run(3000)  # about 0.8 MB: the test server takes at most 1 MB
    finished = threading.Event()

    def ingest_big() -> None:
        with Client(jac_server.url, token=carol.token) as other:
            other.ingest("long-first", big)
        finished.set()

    runner = threading.Thread(target=ingest_big)
    runner.start()
    # The long call's session exists (made by its own call) while its ingestion runs.
    while "long-first" not in sessions_of(carol) and not finished.is_set():
        time.sleep(0.02)
    assert not finished.is_set(), "the long ingestion ended before its session was listed"
    carol.ingest("short-new", [user("hello")])
    # Answered while the long one is still in flight (it used to wait for its end).
    assert not finished.is_set()
    runner.join(timeout=600)
    assert carol.get_session("long-first")["events"] == len(big)
    assert carol.get_session("short-new")["events"] == 1


def test_a_call_whose_client_left_stops_and_the_next_call_of_its_session_is_served(jac_server, carol):
    # A new session: its call is known to be running once the session is listed; the client leaves.
    sock, request = raw_post(jac_server, carol.token, "ingest_events", {"session_id": "left-new", "messages": long_run(3000, "new_")})
    sock.sendall(request)
    deadline = time.monotonic() + 120
    while "left-new" not in sessions_of(carol):
        assert time.monotonic() < deadline, "the call never made its session"
        time.sleep(0.02)
    sock.close()
    # The next call of that session runs (its lock is free) and finds no trace of the one that
    # left: it stopped before anything was committed, and the empty session made for it is gone.
    carol.ingest("left-new", [user("only this")])
    assert carol.get_session("left-new", include_messages=True)["messages"] == [user("only this")]
    # A session with acknowledged events: a long call whose client leaves adds nothing, takes
    # nothing away, and the next call is served. When the client leaves depends on the machine's
    # speed: leaving too early stops the call before it ran, too late lets it finish. So the client
    # leaves ever later, each try on a session of its own with texts no cache knows, until a try
    # stops at a safe point (after counting and embedding began, before anything was written).
    paths = []
    for attempt, wait in enumerate((0.05, 0.1, 0.2, 0.35, 0.5, 0.8, 1.2, 2.0)):
        kept = f"left-kept-{attempt}"
        carol.ingest(kept, [user("first"), assistant("acknowledged")])
        since = jac_server.log.stat().st_size
        sock, request = raw_post(jac_server, carol.token, "ingest_events",
                                 {"session_id": kept, "messages": long_run(3000, f"t{attempt}_")[1:], "append": True})
        sock.sendall(request)
        time.sleep(wait)
        sock.close()
        paths.append(left_line(jac_server, since, finished=lambda: carol.get_session(kept)["events"] > 2))
        if "left before its answer; the call stopped at a safe point" in paths[-1]:
            break
        assert "passed its last safe point" not in paths[-1] and "answered before" not in paths[-1], (
            f"a try that left after {wait} s was already too late: {paths}")
    assert "left before its answer; the call stopped at a safe point" in paths[-1], paths
    carol.ingest(kept, [user("next")], append=True)
    stored = carol.get_session(kept, include_messages=True)["messages"]
    assert stored == [user("first"), assistant("acknowledged"), user("next")]


def test_a_client_that_drops_mid_body_leaves_one_log_line_and_no_traceback(jac_server, carol):
    before = jac_server.log.stat().st_size
    sock, request = raw_post(jac_server, carol.token, "ingest_events", {"session_id": "dropped", "messages": [user("x" * 5000)]})
    sock.sendall(request[: len(request) // 2])
    time.sleep(0.2)
    sock.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(jac_server.log, "rb") as log:
            log.seek(before)
            written = log.read().decode(errors="replace")
        if "before its request body was complete" in written:
            break
        time.sleep(0.1)
    assert written.count("before its request body was complete") == 1, written[-2000:]
    assert "Traceback" not in written and "No response returned" not in written, written[-2000:]
    assert "dropped" not in sessions_of(carol)


def test_a_user_at_the_stored_bytes_quota_gets_403_and_can_still_read_and_delete():
    async def scenario() -> None:
        app = FakeWalkers()
        guard = RequestGuard(app, fields_of=lambda name, caller: None, root_writers=ROOT_WRITERS, max_stored=1000)
        first = Request(guard, "ingest_events", "a")
        await first.task
        assert first.status == 200
        app.stored_bytes["a"] = 1000  # what the session now stores, as list_sessions reports it
        guard.stored.clear()  # read again (as after STORED_REFRESH seconds)
        refused = Request(guard, "ingest_events", "b")
        await refused.task
        assert refused.status == 403 and ("ingest_events", "b") not in app.calls and "b" not in app.sessions
        also = Request(guard, "render_context", "a")
        await also.task
        assert also.status == 403
        # Reads and deletions go on; a deletion makes room.
        read = Request(guard, "get_session", "a")
        await read.task
        assert read.status == 200
        gone = Request(guard, "delete_session", "a")
        await gone.task
        app.stored_bytes.pop("a")
        again = Request(guard, "ingest_events", "b")
        await again.task
        assert gone.status == 200 and again.status == 200

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_the_guard_counts_the_calls_in_progress_for_a_long_call_to_give_way_to():
    async def test(app: FakeWalkers, guard: RequestGuard) -> None:
        before = core.CALLS.running
        app.held["big"] = asyncio.Event()
        big = Request(guard, "ingest_events", "big")
        await app.entered.setdefault("big", asyncio.Event()).wait()
        assert core.CALLS.running == before + 1
        assert core.TURN.get() is None  # each request's turn is its own, not the server's
        other = Request(guard, "ingest_events", "other")
        await other.task
        assert core.CALLS.running == before + 1  # the other call is counted no more once answered
        app.held["big"].set()
        await big.task
        assert core.CALLS.running == before
        # Each call had a turn of its own.
        assert isinstance(app.turns["big"], core.CallTurn) and isinstance(app.turns["other"], core.CallTurn)
        assert app.turns["big"] is not app.turns["other"]

    run(test)


def test_a_call_with_a_big_body_holds_full_collections_until_it_ends():
    import gc

    from engine.courtesy import HELD_FULL_THRESHOLD

    from contextrender.server.guard import OFF_LOOP_BYTES

    thresholds = gc.get_threshold()

    async def test(app: FakeWalkers, guard: RequestGuard) -> None:
        app.held["big"] = asyncio.Event()
        big = Request(guard, "ingest_events", "big", messages=[user("x" * 1000)] * (OFF_LOOP_BYTES // 1000 + 1))
        await app.entered.setdefault("big", asyncio.Event()).wait()
        assert app.turns["big"].long and gc.get_threshold()[2] == HELD_FULL_THRESHOLD
        small = Request(guard, "ingest_events", "small")
        await small.task
        assert not app.turns["small"].long and gc.get_threshold()[2] == HELD_FULL_THRESHOLD
        app.held["big"].set()
        await big.task
        assert big.status == 200 and gc.get_threshold() == thresholds and core.CALLS.holding == 0

    run(test)


def test_a_big_body_is_checked_while_the_event_loop_serves_the_others(monkeypatch):
    from contextrender.server import guard as guard_module

    real = guard_module.json_problem
    loop_ran = threading.Event()

    def check_waiting_for_the_loop(body: bytes):
        # On the loop's own thread this would wait in vain: nothing else runs while it checks.
        assert loop_ran.wait(5), "the event loop did not run while the body was checked"
        return real(body)

    monkeypatch.setattr(guard_module, "json_problem", check_waiting_for_the_loop)
    big = json.dumps({"session_id": "s", "messages": [user("x" * 1000)] * 400}).encode()
    assert len(big) > guard_module.OFF_LOOP_BYTES

    async def scenario():
        checking = asyncio.ensure_future(guard_module.checked_json(big))
        await asyncio.sleep(0.05)  # another request's turn on the loop
        loop_ran.set()
        return await checking

    assert asyncio.run(scenario()) == (json.loads(big), "")
    # A small body is checked in place (no thread hop for an ordinary call), with the same answer.
    monkeypatch.setattr(guard_module, "json_problem", real)
    small = json.dumps({"session_id": "s", "messages": [user("hi")]}).encode()
    assert asyncio.run(guard_module.checked_json(small)) == (json.loads(small), "")
    bad = json.dumps({"messages": [user("\udc80" * (guard_module.OFF_LOOP_BYTES // 6 + 1))]}).encode()
    (parsed, problem) = asyncio.run(guard_module.checked_json(bad))
    assert parsed is None and "surrogate" in problem
