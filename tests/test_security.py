"""Safe to expose: one regression test per hole found by the security and fault test,
over real HTTP on loopback, each checking that nothing stored changed (list_sessions, get_session
with messages, export_graph, before and after); concurrent writers on one session; a seeded fuzz
of every endpoint; the proxy's timeouts, cancellation and status header."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import assistant, call, tool, user
from contextrender.testing.checks import pairing_problems
from contextrender.client import Client
from contextrender.testing.fake_upstream import LoopbackServer
from contextrender.locks import KeyedLocks
from contextrender.proxy import SESSION_HEADER, STATUS_HEADER, create_app
from contextrender.server.app import (
    PUBLIC_DEFAULT_SECRET, admin_password, check_jwt_secret, map_walker_error, strength_problem,
)
from engine.measure import get_tokenizer
from jacserver import JAC, JacServer
from tests.test_render import history_of

ADMIN_PASSWORD = "k3Jq-x9Vw2mZp7Rt-Lc4Hs8N"
SECRET_PASSWORD = "secret-password-1"
TOK = get_tokenizer()


def conversation(results: int = 3) -> list[dict]:
    messages = [{"role": "system", "content": "You are a support agent."}, user("Refund order ORD_0001")]
    for i in range(results):
        messages.append(assistant(None, call(f"call_{i}", "lookup", {"page": i})))
        messages.append(tool(f"call_{i}", f"page {i} ITEM_{i:04d}_SKU " + "details " * 30))
    messages.append(user("What was refunded?"))
    return messages


def account(server: JacServer, name: str = "") -> Client:
    client = Client(server.url)
    client.register(name or f"user_{uuid.uuid4().hex[:8]}", SECRET_PASSWORD)
    return client


def snapshot(*clients: Client) -> list:
    """Everything the clients' users have stored: their sessions, each with its messages and graph."""
    state = []
    for client in clients:
        sessions = sorted(client.list_sessions(), key=lambda s: s["session_id"])
        state.append([(s, client.get_session(s["session_id"], include_messages=True),
                       client.export_graph(s["session_id"])) for s in sessions])
    return state


def headers(client: Client) -> dict:
    return {"Authorization": f"Bearer {client.token}", "content-type": "application/json"}


def raw_post(server: JacServer, path: str, body: bytes | dict, client: Client | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers(client) if client else {"content-type": "application/json"}, timeout=60)


def graph_ids(client: Client, session_id: str) -> dict[str, str]:
    """kind of the first node of each kind -> its id."""
    ids: dict[str, str] = {}
    for node in client.export_graph(session_id)["nodes"]:
        ids.setdefault(node["kind"], node["id"])
    return ids


@pytest.fixture(scope="module")
def alice(jac_server):
    with account(jac_server) as client:
        client.ingest("kept", conversation())
        client.render("kept", budget=300)
        yield client


@pytest.fixture(scope="module")
def bob(jac_server):
    with account(jac_server) as client:
        client.ingest("bobs", conversation(2))
        yield client


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    """A server of its own, with the admin portal on (a strong password), for the tests that
    restart it."""
    server = JacServer(tmp_path_factory.mktemp("admin_server"), CONTEXTRENDER_ADMIN_PASSWORD=ADMIN_PASSWORD).start()
    yield server
    server.stop()


# ---------------------------------------------------------------- 1. the admin account


def test_admin_portal_is_off_by_default_and_changeme_is_no_password(jac_server, alice, bob):
    before = snapshot(alice, bob)
    login = httpx.post(f"{jac_server.url}/admin/login", json={"username": "admin", "password": "changeme"})
    assert login.status_code == 404 and "CONTEXTRENDER_ADMIN_PASSWORD" in login.json()["error"]["message"]
    for path in ("/admin/users", "/admin/config", f"/admin/graph?username={alice.token[:8]}", "/admin/logs", "/admin/", "/admin"):
        response = httpx.get(f"{jac_server.url}{path}", headers={"Authorization": f"Bearer {alice.token}"})
        assert response.status_code == 404, (path, response.text[:200])
    # No admin account was made with jac-scale's default password.
    with pytest.raises(Exception) as refused:
        Client(jac_server.url).login("admin", "changeme")
    assert getattr(refused.value, "status", None) == 401
    assert snapshot(alice, bob) == before


def test_admin_portal_with_a_strong_password(admin_server):
    login = httpx.post(f"{admin_server.url}/admin/login", json={"username": "admin", "password": ADMIN_PASSWORD})
    assert login.status_code == 200, login.text[:300]
    token = login.json()["data"]["token"]
    users = httpx.get(f"{admin_server.url}/admin/users", headers={"Authorization": f"Bearer {token}"})
    assert users.status_code == 200
    assert httpx.post(f"{admin_server.url}/admin/login", json={"username": "admin", "password": "changeme"}).status_code == 401


def test_weak_secrets_are_refused(monkeypatch):
    monkeypatch.delenv("CONTEXTRENDER_DEV", raising=False)
    # The JWT secret: length, distinct characters and estimated entropy.
    assert strength_problem("a" * 32, 32, 96, 10)
    assert strength_problem("ab" * 16, 32, 96, 10)
    assert strength_problem("password" * 4, 32, 96, 10)
    # Ten distinct characters, 133 bits by character counts alone: a repeated run, not a secret.
    assert strength_problem("abcdefghij" * 4, 32, 96, 10)
    assert strength_problem("0123456789abcdefghijklmnopqrstuvwxyz", 32, 96, 10)
    assert strength_problem("q3" + "abcdefghij" * 4, 32, 96, 10)
    assert not strength_problem("x7Qp2vLmN9sK4tRwZ8cYb3HjF6gD1aE5", 32, 96, 10)
    assert not strength_problem(uuid.uuid4().hex + uuid.uuid4().hex, 32, 96, 10)
    with pytest.raises(SystemExit, match="distinct characters"):
        check_jwt_secret("a" * 40)
    with pytest.raises(SystemExit, match="well-known default"):
        check_jwt_secret(PUBLIC_DEFAULT_SECRET)
    # The admin password: unset keeps the portal off; set, it must be strong.
    monkeypatch.delenv("CONTEXTRENDER_ADMIN_PASSWORD", raising=False)
    assert admin_password() is None
    for weak in ("changeme", "Adminpassword123", "a" * 20, "short-Pw1"):
        monkeypatch.setenv("CONTEXTRENDER_ADMIN_PASSWORD", weak)
        with pytest.raises(SystemExit, match="CONTEXTRENDER_ADMIN_PASSWORD"):
            admin_password()
    monkeypatch.setenv("CONTEXTRENDER_ADMIN_PASSWORD", ADMIN_PASSWORD)
    assert admin_password() == ADMIN_PASSWORD


def test_the_server_refuses_to_start_with_a_weak_admin_password(tmp_path):
    # As it does for a weak JWT secret (the same check, tested above without a server start).
    server = JacServer(tmp_path / "weak", CONTEXTRENDER_ADMIN_PASSWORD="changeme")
    done = subprocess.run([str(JAC), "start", "contextrender.jac", "--no_client", "-p", str(server.port)],
                          cwd=server.workdir, env=server.env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "CONTEXTRENDER_ADMIN_PASSWORD is a well-known default" in output, output[-2000:]


def listening_on(port: int) -> list[tuple[str, str]]:
    """(table, local address) of every listening TCP socket on `port`, IPv4 and IPv6 (a listener
    on [::] is in /proc/net/tcp6 only)."""
    found = []
    for name in ("tcp", "tcp6"):
        table = Path("/proc/net") / name
        if not table.exists():  # tcp6: a kernel without IPv6, where nothing can listen on [::]
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.append((name, fields[1]))
    return found


def test_the_server_listens_on_loopback_only(jac_server):
    # CONTEXTRENDER_HOST=127.0.0.1 (set by tests/jacserver.py): jac-scale alone binds 0.0.0.0.
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux's /proc/net/tcp and /proc/net/tcp6")
    assert listening_on(jac_server.port) == [("tcp", "0100007F:%04X" % jac_server.port)]


# ---------------------------------------------------------------- 3. only the caller's graph


def test_node_id_routes_and_functions_are_not_served(jac_server, alice, bob):
    before = snapshot(alice, bob)
    ids = graph_ids(bob, "bobs")
    attempts = [
        (f"/walker/get_session/{ids['Session']}", {"include_messages": True}),
        (f"/walker/export_graph/{ids['Session']}", {}),
        (f"/walker/ingest_events/{ids['Session']}", {"session_id": "bobs", "messages": [user("alice was here")], "append": True}),
        (f"/walker/delete_session/{ids['Session']}", {"session_id": "bobs"}),
        ("/walker/get_session/notanid", {"session_id": "kept"}),
        ("/function/jobj", {"id": ids["ToolResult"]}),
        ("/function/session_node", {"node_id": ids["Session"]}),
    ]
    for path, body in attempts:
        response = raw_post(jac_server, path, body, alice)
        assert response.status_code == 404, (path, response.text[:300])
        assert "ITEM_0000_SKU" not in response.text and "alice was here" not in response.text
    assert snapshot(alice, bob) == before
    # The routes are not in the API either.
    paths = httpx.get(f"{jac_server.url}/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/function/") or "{nd}" in p or p.startswith("/admin")]


# ---------------------------------------------------------------- 4, 5, 7. refused before anything is written


def test_unencodable_text_and_bad_session_ids_are_400_naming_the_field(jac_server, alice, bob):
    before = snapshot(alice, bob)
    cases = [
        ({"session_id": "kept\udcff", "messages": [user("x")]}, "session_id has a lone UTF-16 surrogate"),
        ({"session_id": "kept", "messages": [user("tool output \udcff here")], "append": True}, "messages[0].content has a lone UTF-16 surrogate"),
        ({"session_id": "kept", "messages": [assistant(None, call("c9", "lookup", "{\"q\": \"\udc80\"}"))], "append": True},
         "messages[0].tool_calls[0].function.arguments has a lone"),
        ({"session_id": "kept", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}], "append": True},
         "messages[0].content[0].text has a lone"),
        ({"session_id": "a\x00b", "messages": [user("x")]}, "control character"),
        ({"session_id": "a\nb", "messages": [user("x")]}, "control character"),
        ({"session_id": "x" * 2_000, "messages": [user("x")]}, "at most 256"),
    ]
    for body, words in cases:
        response = raw_post(jac_server, "/walker/ingest_events", body, alice)
        assert response.status_code == 400 and words in response.json()["error"]["message"], (words, response.text[:300])
    render = raw_post(jac_server, "/walker/render_context", {"session_id": "kept", "budget": 300, "params": {"encoding": "o200k\udcff"}}, alice)
    assert render.status_code == 400 and "encoding" in render.json()["error"]["message"]
    assert snapshot(alice, bob) == before


def test_configure_session_refuses_settings_that_would_break_renders(jac_server, alice, bob):
    before = snapshot(alice, bob)
    for params, words in (({"encoding": "nonexistent_enc"}, "'encoding'"), ({"first_user_clip": -1}, "'first_user_clip'"),
                          ({"decay": 1e308}, "'decay'"), ({"recent_turns": 10**12}, "'recent_turns'"),
                          ({"recent_turns": 1e12}, "'recent_turns'"), ({"fold_target": 0}, "'fold_target'"),
                          ({"omitted": "hide"}, "'omitted'"), ({"gamma": -0.1}, "'gamma'")):
        response = raw_post(jac_server, "/walker/configure_session", {"session_id": "kept", "params": params}, alice)
        assert response.status_code == 400 and words in response.json()["error"]["message"], (params, response.text[:300])
        # The same rules for a render's own settings.
        response = raw_post(jac_server, "/walker/render_context", {"session_id": "kept", "budget": 300, "params": params}, alice)
        assert response.status_code == 400 and words in response.json()["error"]["message"], (params, response.text[:300])
    assert snapshot(alice, bob) == before
    assert alice.render("kept", budget=300).history_tokens <= 300


def test_nan_infinity_and_deep_json_are_400_not_500(jac_server, alice, bob):
    before = snapshot(alice, bob)
    deep_message = b'{"session_id":"kept","append":true,"messages":[{"role":"user","content":[{"type":"text","x":' + b"[" * 1000 + b"]" * 1000 + b"}]}]}"
    cases = [
        ("/walker/render_context", b'{"session_id":"kept","budget":NaN}', "budget is nan"),
        ("/walker/render_context", b'{"session_id":"kept","budget":Infinity}', "budget is inf"),
        ("/walker/configure_session", b'{"session_id":"kept","params":{"decay":-Infinity}}', "params.decay is -inf"),
        ("/walker/ingest_events", b'{"session_id":"kept","append":true,"messages":[{"role":"user","content":[{"type":"x","v":NaN}]}]}',
         "messages[0].content[0].v is nan"),
        ("/walker/ingest_events", deep_message, "nested more than"),
        ("/walker/ingest_events", b'{"session_id":"kept","messages":' + b"[" * 5000 + b"]" * 5000 + b"}", "nested more than"),
        ("/user/login", b'{"identity":NaN}', "identity is nan"),
    ]
    for path, body, words in cases:
        response = raw_post(jac_server, path, body, alice)
        assert response.status_code == 400 and words in response.json()["error"]["message"], (path, words, response.text[:300])
    assert snapshot(alice, bob) == before


# ---------------------------------------------------------------- 8. logs


def test_no_message_content_in_the_server_log(jac_server, alice):
    marker = f"PRIVATE_{uuid.uuid4().hex}"
    alice.render("logged", [user(f"my card is {marker}")], budget=300)
    alice.get_session("logged", include_messages=True)
    alice.export_graph("logged", format="dot")
    assert marker not in jac_server.log.read_text(errors="replace")


# ---------------------------------------------------------------- a client that stalls mid-body


def test_a_client_that_stalls_mid_body_gets_408_and_is_closed(jac_server, alice, bob):
    before = snapshot(alice, bob)
    body = json.dumps({"session_id": "kept", "messages": [user("never finished")], "append": True}).encode()
    request = (f"POST /walker/ingest_events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {alice.token}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body[:20]
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", jac_server.port), timeout=60) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):  # ends when the server closes the connection
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 60  # CONTEXTRENDER_BODY_TIMEOUT=10 in conftest
    assert snapshot(alice, bob) == before


# ---------------------------------------------------------------- 2. concurrent writers on one session


def _post_all(server: JacServer, token: str, bodies: list[dict]) -> list[httpx.Response]:
    """POST every body to ingest_events at once (one thread each, released together)."""
    barrier = threading.Barrier(len(bodies))

    def send(body: dict) -> httpx.Response:
        barrier.wait()
        return httpx.post(f"{server.url}/walker/ingest_events", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=120)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(send, bodies))


def _forks(client: Client, session_id: str) -> int:
    return sum(1 for edge in client.export_graph(session_id)["edges"] if edge["kind"] == "Superseded")


def test_concurrent_writers_on_one_session_apply_one_after_another(admin_server):
    username = f"writer_{uuid.uuid4().hex[:8]}"
    client = account(admin_server, username)
    figures = {"requests": 0, "statuses": {}, "lost": 0}
    expected: dict[str, list[dict]] = {}

    def count(responses: list[httpx.Response]) -> None:
        figures["requests"] += len(responses)
        for response in responses:
            figures["statuses"][response.status_code] = figures["statuses"].get(response.status_code, 0) + 1

    for writers in (2, 4, 8):
        # Appending: each writer sends its own new events, 5 calls each.
        session_id = f"append-{writers}"
        acknowledged: list[dict] = []
        for k in range(5):
            bodies = [{"session_id": session_id, "messages": [user(f"writer {w} call {k}")], "append": True} for w in range(writers)]
            responses = _post_all(admin_server, client.token, bodies)
            count(responses)
            acknowledged += [body["messages"][0] for body, r in zip(bodies, responses) if r.status_code == 200]
        stored = client.get_session(session_id, include_messages=True)["messages"]
        missing = [m for m in acknowledged if stored.count(m) != 1]
        figures["lost"] += len(missing)
        assert not missing and len(stored) == len(acknowledged) == writers * 5
        expected[session_id] = stored
        # Resending the same growing list, as retries and parallel tabs do: one copy is ingested.
        session_id = f"resend-{writers}"
        messages = [{"role": "system", "content": "You are a coding agent."}]
        for k in range(4):
            messages = messages + ([user(f"step {k}")] if k % 2 == 0 else [assistant(f"done step {k}")])
            responses = _post_all(admin_server, client.token, [{"session_id": session_id, "messages": messages}] * writers)
            count(responses)
            assert all(r.status_code == 200 for r in responses), [r.text[:200] for r in responses]
            assert sum(r.json()["data"]["reports"][0]["added"] for r in responses) == 1
        session = client.get_session(session_id, include_messages=True)
        assert session["messages"] == messages and session["branch"] == 0 and _forks(client, session_id) == 0
        expected[session_id] = messages
    # Different sessions of one user at once, 8 new ones three times (each adds a session to the
    # user's root), then a second event in each at once: each gets its events.
    for round_ in range(3):
        bodies = [{"session_id": f"parallel-{round_}-{w}", "messages": [user(f"only {w}")]} for w in range(8)]
        count(_post_all(admin_server, client.token, bodies))
    bodies = [{"session_id": f"parallel-{round_}-{w}", "messages": [user(f"and then {w}")], "append": True}
              for round_ in range(3) for w in range(8)]
    count(_post_all(admin_server, client.token, bodies))
    for round_ in range(3):
        for w in range(8):
            expected[f"parallel-{round_}-{w}"] = [user(f"only {w}"), user(f"and then {w}")]
    assert not [code for code in figures["statuses"] if code >= 500], figures
    # No session is stuck: each renders within B, validly paired, up to its last event; and a
    # restart finds the same sessions with no phantom fork.
    for session_id, messages in expected.items():
        rendered = client.render(session_id, budget=300)
        assert TOK.history_tokens(history_of(rendered)) == rendered.history_tokens <= 300, session_id
        assert pairing_problems(rendered.messages) == [] and rendered.messages[-1] == messages[-1], (session_id, rendered.messages)
    admin_server.stop()
    admin_server.start()
    client.login(username, SECRET_PASSWORD)
    for session_id, messages in expected.items():
        session = client.get_session(session_id, include_messages=True)
        assert session["messages"] == messages and session["branch"] == 0 and _forks(client, session_id) == 0, session_id
    print(f"\nconcurrency: {figures['requests']} requests, statuses {figures['statuses']}, lost acknowledged events {figures['lost']}")


def test_a_commit_that_keeps_conflicting_is_a_409_not_a_500():
    # jaclang's answer when its optimistic commit lost five times in a row (jac-scale made it a 500).
    status, envelope = map_walker_error({"error": {"message": "write_conflict: retries exhausted"}, "meta": {"extra": {}}})
    assert status == 409 and envelope["error"]["code"] == "WRITE_CONFLICT" and "retry" in envelope["error"]["message"]


def test_session_locks_keep_different_sessions_parallel():
    """Two requests of different sessions run at the same time; two of one session do not."""

    async def scenario(keys: tuple) -> bool:
        locks = KeyedLocks()
        second_started = asyncio.Event()

        async def first() -> bool:
            async with locks.hold_async(keys[0]):
                try:  # waits for the second to start: possible only if it is not blocked
                    await asyncio.wait_for(second_started.wait(), timeout=1.0)
                    return True
                except TimeoutError:
                    return False

        async def second() -> None:
            await asyncio.sleep(0.05)
            async with locks.hold_async(keys[1]):
                second_started.set()

        overlapped, _ = await asyncio.gather(first(), second())
        assert len(locks) == 0  # nothing left behind
        return overlapped

    assert asyncio.run(scenario((("u", "a"), ("u", "b")))) is True
    assert asyncio.run(scenario((("u", "a"), ("u", "a")))) is False
    assert asyncio.run(scenario((("u", "a"), ("v", "a")))) is True


# ---------------------------------------------------------------- fuzz


POISON = {
    "session_id": ["", "\udcff", "a\x00b", "a\nb", "x" * 300, 5, None, [], {"a": 1}, True],
    "budget": ["NaN", "Infinity", -1, 0, 10, 10**12, 1e308, "lots", [], True],
    "messages": [
        "hi", 7, {"role": "user"}, [7], [{"role": "robot", "content": "x"}], [tool("nope", "x")],
        [{"role": "user", "content": "\udcff"}], [{"role": "user", "content": [{"type": "text", "v": "NaN"}]}],
        [{"role": "user", "content": "DEEP"}], [assistant(None, {"id": "", "function": {"name": "x"}})],
        [{"role": "user", "content": 5}], [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}],
    ],
    "params": [{"decay": 1e308}, {"encoding": "nope"}, {"first_user_clip": -1}, {"recent_turns": 10**12}, {"unknown": 1},
               {"decay": "NaN"}, "x", [1], {"selector": "magic"}, {"fold_target": 2}],
    "format": ["svg", "", 5, None],
    "limit": [-5, 0, "x", "Infinity"],
    "include_messages": ["yes", 2, []],
    "selectr": [1],
}
WALKERS = {
    "render_context": {"session_id": "kept", "messages": [user("fuzz")], "budget": 300, "params": {}},
    "ingest_events": {"session_id": "kept", "messages": [user("fuzz")], "append": True},
    "configure_session": {"session_id": "kept", "params": {"decay": 0.2}},
    "explain_render": {"session_id": "kept"},
    "get_session": {"session_id": "kept", "include_messages": True},
    "export_graph": {"session_id": "kept", "format": "json", "limit": 10},
    "delete_session": {"session_id": "kept"},
    "list_sessions": {},
    "health": {},
}
WRITERS = {"render_context", "ingest_events", "configure_session", "delete_session"}
READERS = set(WALKERS) - WRITERS


def _encode(body: dict) -> bytes:
    """JSON, with the placeholders for what json.dumps cannot write: NaN/Infinity tokens, and a
    value nested 3,000 deep."""
    text = json.dumps(body)
    for token in ("NaN", "Infinity"):
        text = text.replace(f'"{token}"', token)
    return text.replace('"DEEP"', "[" * 3000 + "]" * 3000).encode()


def _fuzz_request(rng: random.Random, ids: dict) -> tuple[str, bytes]:
    """A request that is wrong in at least one way."""
    kind = rng.random()
    if kind < 0.08:
        return f"/walker/{rng.choice(list(WALKERS))}/{rng.choice([ids['Session'], 'notanid', '../x'])}", b"{}"
    if kind < 0.12:
        path = rng.choice(["/function/jobj", "/function/session_node", "/admin/users", "/admin/login", "/cl/__error__", "/user/login"])
        return path, rng.choice([b"{}", b'{"identity": NaN}', b"[" * 3000, _encode({"identity": {"type": "username", "value": "\udcff"}})])
    walker = rng.choice(list(WALKERS))
    body = dict(WALKERS[walker])
    if kind < 0.2:
        raw = _encode(body)
        return f"/walker/{walker}", rng.choice([raw[: rng.randrange(1, len(raw))], b"", b"[]", b"null", b"\xff\xfe", raw + b"}"])
    fields = [f for f in POISON if f in body or f == "selectr" or (walker in WRITERS and f in ("messages", "budget"))] or ["selectr"]
    for field in rng.sample(fields, k=rng.randint(1, min(2, len(fields)))):
        body[field] = rng.choice(POISON[field])
    return f"/walker/{walker}", _encode(body)


# A fixed count, so a slow machine tests the same cases (the seeded sequence) as a fast one.
FUZZ_REQUESTS = 400


def test_fuzz_every_endpoint_answers_4xx_and_changes_nothing(jac_server, alice, bob):
    rng = random.Random(9)
    before = snapshot(alice, bob)
    ids = graph_ids(bob, "bobs")
    statuses: dict[int, int] = {}
    started = time.monotonic()
    requests = 0
    with httpx.Client(timeout=60) as http:
        for _ in range(FUZZ_REQUESTS):
            path, body = _fuzz_request(rng, ids)
            response = http.post(f"{jac_server.url}{path}", content=body, headers=headers(alice))
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            requests += 1
            assert response.status_code < 500, (path, body[:300], response.text[:300])
            # Every request is wrong in some way: only a read may still answer (FastAPI turns
            # `"include_messages": "yes"` into true).
            assert response.status_code >= 400 or path.removeprefix("/walker/") in READERS, (path, body[:300])
            assert "Traceback" not in response.text
    print(f"\nfuzz: {requests} requests in {time.monotonic() - started:.1f} s, statuses {dict(sorted(statuses.items()))}")
    assert snapshot(alice, bob) == before


# ---------------------------------------------------------------- 6, 7, 4. the proxy


class RawUpstream:
    """A TCP server on loopback that reads one request per connection and then, by `mode`:
    "hang" (answers nothing), "stream" (SSE headers and one chunk, then nothing), or "cut" (a
    JSON answer that closes after 10 of its 1,000 declared bytes). It records when the proxy
    closes each connection."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(connection,), daemon=True).start()

    def _handle(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(60)
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
            while len(body) < length:
                body += connection.recv(65536)
            if self.mode == "stream":
                connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                chunk = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]}\n\n'
                connection.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            elif self.mode == "cut":
                connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"id\": \"x")
                return
            try:
                while connection.recv(65536):  # until the proxy closes its side
                    pass
            except OSError:
                pass
            self.closed.set()

    def close(self) -> None:
        self.listener.close()


def chat(messages: list[dict] | None = None, **fields) -> dict:
    return {"model": "m", "messages": messages or conversation(), **fields}


def test_proxy_answers_504_when_the_upstream_hangs(engine, monkeypatch):
    monkeypatch.setenv("CONTEXTRENDER_UPSTREAM_TIMEOUT", "1")
    upstream = RawUpstream("hang")
    try:
        with LoopbackServer(create_app(engine, upstream.base_url, 600)) as proxy:
            started = time.monotonic()
            response = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat(), timeout=60)
        assert response.status_code == 504 and response.json()["error"]["type"] == "upstream_timeout", response.text
        assert time.monotonic() - started < 30
    finally:
        upstream.close()
    from contextrender.cli import build_parser

    args = build_parser().parse_args(["proxy", "--upstream", "u", "--budget", "100", "--port", "1", "--upstream-timeout", "5"])
    assert args.upstream_timeout == 5.0


@pytest.mark.parametrize("mode", ["hang", "stream"])
def test_proxy_cancels_the_upstream_call_when_the_client_leaves(engine, mode):
    upstream = RawUpstream(mode)
    try:
        with LoopbackServer(create_app(engine, upstream.base_url, 600, upstream_timeout=600)) as proxy:
            with httpx.Client(timeout=httpx.Timeout(60, read=1)) as client:
                if mode == "stream":
                    with client.stream("POST", f"{proxy.url}/v1/chat/completions", json=chat(stream=True)) as response:
                        assert response.status_code == 200
                        next(response.iter_raw())  # the first chunk came through; then the client leaves
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        client.post(f"{proxy.url}/v1/chat/completions", json=chat())
            # The upstream sees its connection closed long before the proxy's own 600 s timeout.
            assert upstream.closed.wait(timeout=15), "the upstream call went on after the client left"
    finally:
        upstream.close()


def test_proxy_answers_502_when_the_upstream_cuts_an_answer_short(engine):
    upstream = RawUpstream("cut")
    try:
        with LoopbackServer(create_app(engine, upstream.base_url, 600)) as proxy:
            response = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat(), timeout=60)
        assert response.status_code == 502 and "closed its answer before the end" in response.json()["error"]["message"]
    finally:
        upstream.close()


def test_proxy_refuses_bad_input_in_openai_shape_and_never_silently_unmanages(engine, upstream, caplog):
    deep = b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    bad = chat([user("fine"), assistant("ok"), user("tool output \udcff broken")])
    with LoopbackServer(create_app(engine, upstream.base_url, 600, fail_closed=True)) as proxy:
        response = httpx.post(f"{proxy.url}/v1/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
        response = httpx.post(f"{proxy.url}/v1/chat/completions", content=json.dumps(bad), headers={SESSION_HEADER: "broken"})
        assert response.status_code == 400 and "messages[2].content has a lone UTF-16 surrogate" in response.json()["error"]["message"]
    assert engine.list_sessions() == []
    before = len(upstream.requests)
    with LoopbackServer(create_app(engine, upstream.base_url, 600)) as proxy, caplog.at_level("WARNING", "contextrender.proxy"):
        post = lambda body: httpx.post(f"{proxy.url}/v1/chat/completions", content=json.dumps(body), headers={SESSION_HEADER: "broken"})
        # Fail-open: forwarded as sent, marked unmanaged; one warning for the session, not one a call.
        for _ in range(3):
            response = post(bad)
            assert response.status_code == 200 and response.headers[STATUS_HEADER] == "unmanaged; reason=InvalidRequest"
        assert upstream.requests[-1].body == json.dumps(bad).encode() and len(upstream.requests) == before + 3
        assert len([r for r in caplog.records if "broken" in r.getMessage()]) == 1
        good = post(chat([user("fine"), assistant("ok"), user("now readable")]))
        assert good.status_code == 200 and good.headers[STATUS_HEADER] == "managed"
        post(bad)  # broken again after working: warned again
        assert len([r for r in caplog.records if "broken" in r.getMessage()]) == 2
        # Without what the protocol needs: refused, not forwarded.
        not_chat = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "m"})
        assert not_chat.status_code == 400 and "`messages`" in not_chat.json()["error"]["message"]
        assert len(upstream.requests) == before + 5
    # Stored: the readable list only (and the answer to it, ingested after the response).
    assert [m["content"] for m in engine.get_session("broken", include_messages=True)["messages"]][:3] == ["fine", "ok", "now readable"]


# ---------------------------------------------------------------- tokens that end, no cross-site use, accounts


def _login(server: JacServer, name: str, password: str = SECRET_PASSWORD) -> httpx.Response:
    return httpx.post(f"{server.url}/user/login", json={"identity": {"type": "username", "value": name},
                                                        "credential": {"type": "password", "password": password}}, timeout=60)


def _reads(server: JacServer, token: str) -> int:
    return httpx.post(f"{server.url}/walker/list_sessions", json={}, headers={"Authorization": f"Bearer {token}"}, timeout=60).status_code


def test_a_password_change_revokes_earlier_tokens_and_logout_revokes_its_own(jac_server):
    name = f"tokens_{uuid.uuid4().hex[:8]}"
    account(jac_server, name).close()
    first, second = (_login(jac_server, name).json()["data"]["token"] for _ in range(2))
    assert _reads(jac_server, first) == _reads(jac_server, second) == 200
    # Logout revokes the token it is sent with, and only that one.
    out = httpx.post(f"{jac_server.url}/user/logout", headers={"Authorization": f"Bearer {first}"})
    assert out.status_code == 200 and out.json()["data"]["revoked"] == "token"
    assert _reads(jac_server, first) == 401 and _reads(jac_server, second) == 200
    assert httpx.post(f"{jac_server.url}/user/refresh-token", json={"token": first}).status_code == 401
    # A password change revokes every earlier token; refreshing one gets nothing.
    changed = httpx.put(f"{jac_server.url}/user/password", headers={"Authorization": f"Bearer {second}"},
                        json={"current_password": SECRET_PASSWORD, "new_password": "another-long-password-2"})
    assert changed.status_code == 200, changed.text
    assert _reads(jac_server, second) == 401
    assert httpx.post(f"{jac_server.url}/user/refresh-token", json={"token": second}).status_code == 401
    assert _login(jac_server, name).status_code == 401
    fresh = _login(jac_server, name, "another-long-password-2").json()["data"]["token"]
    assert _reads(jac_server, fresh) == 200
    # Logging out everywhere revokes the user's every token.
    other = _login(jac_server, name, "another-long-password-2").json()["data"]["token"]
    assert httpx.post(f"{jac_server.url}/user/logout", headers={"Authorization": f"Bearer {fresh}"}, json={"all": True}).status_code == 200
    assert _reads(jac_server, fresh) == _reads(jac_server, other) == 401
    assert httpx.post(f"{jac_server.url}/user/logout", headers={"Authorization": f"Bearer {other}"}).status_code == 401


def test_a_refresh_keeps_the_logins_absolute_lifetime(jac_server):
    import jwt

    name = f"refresh_{uuid.uuid4().hex[:8]}"
    account(jac_server, name).close()
    token = _login(jac_server, name).json()["data"]["token"]
    claims = jwt.decode(token, options={"verify_signature": False})
    refreshed = httpx.post(f"{jac_server.url}/user/refresh-token", json={"token": token})
    assert refreshed.status_code == 200, refreshed.text
    again = jwt.decode(refreshed.json()["data"]["token"], options={"verify_signature": False})
    # The same login: its auth_time, and an expiry no later than 30 days (the default) after it.
    assert again["auth_time"] == claims["auth_time"] and again["jti"] != claims["jti"]
    assert again["exp"] <= claims["auth_time"] + 30 * 86400 + 1
    # A token past that lifetime (forged here with the server's secret) is not refreshed, and one
    # whose signature is wrong is refused outright.
    secret = jac_server.env["CONTEXTRENDER_JWT_SECRET"]
    old = jwt.encode(dict(claims, auth_time=time.time() - 31 * 86400, jti="old-login"), secret, algorithm="HS256")
    assert _reads(jac_server, old) == 200  # still within its own expiry
    assert httpx.post(f"{jac_server.url}/user/refresh-token", json={"token": old}).status_code == 401
    forged = jwt.encode(dict(claims, jti="forged"), "not-the-secret-" * 4, algorithm="HS256")
    assert httpx.post(f"{jac_server.url}/user/refresh-token", json={"token": forged}).status_code == 401


def test_short_passwords_are_refused_at_registration_and_change(jac_server):
    name = f"short_{uuid.uuid4().hex[:8]}"
    response = httpx.post(f"{jac_server.url}/user/register", json={"identities": [{"type": "username", "value": name}],
                                                                   "credential": {"type": "password", "password": "a"}})
    assert response.status_code == 400 and "CONTEXTRENDER_MIN_PASSWORD_LENGTH" in response.json()["error"]["message"]
    assert _login(jac_server, name, "a").status_code == 401  # no account was made
    with account(jac_server, name) as client:
        response = httpx.put(f"{jac_server.url}/user/password", headers={"Authorization": f"Bearer {client.token}"},
                             json={"current_password": SECRET_PASSWORD, "new_password": "short-11ch"})
        assert response.status_code == 400 and "at least 12 characters" in response.json()["error"]["message"]
        assert _reads(jac_server, client.token) == 200 and _login(jac_server, name).status_code == 200


def test_failed_logins_are_throttled_with_429_and_retry_after(jac_server):
    name = f"guessed_{uuid.uuid4().hex[:8]}"
    account(jac_server, name).close()
    statuses = [_login(jac_server, name, f"guess-number-{i:04d}").status_code for i in range(5)]
    assert statuses == [401] * 5
    throttled = _login(jac_server, name, "guess-number-0005")
    assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) >= 1
    assert "try again in" in throttled.json()["error"]["message"]
    # Even the right password waits (the guesser cannot tell), then works and clears the count.
    assert _login(jac_server, name).status_code == 429
    time.sleep(int(throttled.headers["retry-after"]) + 0.5)
    assert _login(jac_server, name).status_code == 200
    assert _login(jac_server, name, "guess-number-0006").status_code == 401
    assert _login(jac_server, name).status_code == 200


def test_cors_is_off_by_default_and_no_origin_is_reflected(jac_server, alice):
    preflight = httpx.options(f"{jac_server.url}/walker/list_sessions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert "access-control-allow-origin" not in preflight.headers and "access-control-allow-credentials" not in preflight.headers
    answer = httpx.post(f"{jac_server.url}/walker/list_sessions", json={}, headers={**headers(alice), "Origin": "https://evil.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_cors_origins_allow_only_the_named_origins_without_credentials(monkeypatch):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.testclient import TestClient

    from contextrender.server.cors import settle_cors

    monkeypatch.setenv("CONTEXTRENDER_CORS_ORIGINS", "https://app.example.com")
    app = Starlette()
    app.user_middleware.insert(0, Middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"], allow_headers=["*"]))
    settle_cors(app.user_middleware)
    with TestClient(app) as http:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        good = http.options("/x", headers={"Origin": "https://app.example.com", **ask})
        assert good.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "access-control-allow-credentials" not in good.headers
        bad = http.options("/x", headers={"Origin": "https://evil.example", **ask})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    monkeypatch.setenv("CONTEXTRENDER_CORS_ORIGINS", "*")
    with pytest.raises(SystemExit, match="may not be"):
        settle_cors([])


# ---------------------------------------------------------------- slow or stuck clients are bounded


def slowloris(port: int, count: int, seconds: float, trickle: bool = True) -> list[tuple[bytes, float]]:
    """A bounded slowloris run on loopback: `count` sockets open a request and send its headers a
    line at a time, one per second, never finishing them, for at most `seconds`. Returns, per
    socket, what the server answered and when it closed the socket (seconds from the start; inf
    if it was still open at the end)."""
    import selectors

    started = time.monotonic()
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /walker/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.setblocking(False)
        sockets.append(sock)
    answers = {s: b"" for s in sockets}
    closed: dict[socket.socket, float] = {}
    selector = selectors.DefaultSelector()
    for sock in sockets:
        selector.register(sock, selectors.EVENT_READ)
    next_line = time.monotonic() + 1
    while len(closed) < count and time.monotonic() - started < seconds:
        for (key, _) in selector.select(timeout=0.2):
            try:
                data = key.fileobj.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data:
                answers[key.fileobj] += data
            else:
                closed[key.fileobj] = time.monotonic() - started
                selector.unregister(key.fileobj)
        if trickle and time.monotonic() >= next_line:
            next_line += 1
            for sock in sockets:
                if sock not in closed:
                    try:
                        sock.send(b"X-Slow-%d: 1\r\n" % int(time.monotonic() * 1000))
                    except OSError:
                        pass
    for sock in sockets:
        sock.close()
    return [(answers[s], closed.get(s, float("inf"))) for s in sockets]


def test_the_server_bounds_a_slowloris_run(jac_server):
    # 40 sockets trickling headers (CONTEXTRENDER_HEADER_TIMEOUT=5 in conftest): served meanwhile,
    # and each answered 408 and closed soon after 5 s, however long it goes on sending.
    import threading as _threading

    served: list[int] = []
    prober = _threading.Timer(2.0, lambda: served.append(httpx.post(f"{jac_server.url}/walker/health", json={}, timeout=30).status_code))
    prober.start()
    run = slowloris(jac_server.port, 40, seconds=40)
    prober.join()
    assert served == [200]
    assert all(answer.startswith(b"HTTP/1.1 408") and b"CONTEXTRENDER_HEADER_TIMEOUT" in answer for (answer, _) in run), run[0]
    assert max(when for (_, when) in run) < 25, sorted(when for (_, when) in run)[-3:]
    # One client holding more than 64 connections (the default cap): the rest are refused at once.
    run = slowloris(jac_server.port, 72, seconds=30, trickle=False)
    refused = [answer for (answer, when) in run if answer.startswith(b"HTTP/1.1 429")]
    assert 8 <= len(refused) <= 20 and all(b"retry-after: 1" in a.lower() for a in refused), len(refused)
    assert httpx.post(f"{jac_server.url}/walker/health", json={}, timeout=30).status_code == 200


def test_the_proxy_bounds_a_slowloris_run(engine, upstream, monkeypatch):
    from contextrender.limits import uvicorn_settings

    monkeypatch.setenv("CONTEXTRENDER_HEADER_TIMEOUT", "2")
    monkeypatch.setenv("CONTEXTRENDER_MAX_CONNECTIONS_PER_CLIENT", "30")
    with LoopbackServer(create_app(engine, upstream.base_url, 600), **uvicorn_settings()) as proxy:
        run = slowloris(proxy.port, 40, seconds=30)
        refused = [a for (a, _) in run if a.startswith(b"HTTP/1.1 429")]
        timed_out = [(a, when) for (a, when) in run if a.startswith(b"HTTP/1.1 408")]
        assert len(refused) == 10 and len(timed_out) == 30, [a[:40] for (a, _) in run]
        assert max(when for (_, when) in timed_out) < 15
        response = httpx.post(f"{proxy.url}/v1/chat/completions", json=chat(), timeout=60)
        assert response.status_code == 200
