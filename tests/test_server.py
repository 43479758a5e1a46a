"""The server over real HTTP on loopback, through the client: endpoints, user isolation, errors
that say what to fix and change nothing, restart after kill -9."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import uuid

import httpx
import pytest

from conftest import assistant, call, tool, user
from contextrender.testing.checks import pairing_problems
from contextrender.client import AsyncClient, Client
from contextrender import ContextRenderError, HistoryConflict, InvalidRequest, UnknownSession
from contextrender.core import IngestSummary, RenderResult, ResultDecision
from jacserver import JAC, REPO, JacServer
from engine.measure import get_tokenizer


def conversation(results: int = 12) -> list[dict]:
    messages = [{"role": "system", "content": "You are a support agent."}, user("Refund order ORD_0001 for jane.doe@example.com")]
    for i in range(results):
        cid = f"call_{i}"
        messages.append(assistant(None, call(cid, "lookup", {"page": i})))
        messages.append(tool(cid, f"page {i} ITEM_{i:04d}_SKU " + "details " * 60))
    messages.append(assistant("Order ITEM_0003_SKU is the one; refunding.", call("call_r", "refund", {"item": "ITEM_0003_SKU"})))
    messages.append(tool("call_r", "refund REF_77_OK issued"))
    messages.append(user("Thanks. What was refunded?"))
    return messages


def account(server: JacServer) -> Client:
    client = Client(server.url)
    client.register(f"user_{uuid.uuid4().hex[:8]}", "secret-password-1")
    return client


@pytest.fixture(scope="module")
def alice(jac_server):
    with account(jac_server) as client:
        yield client


@pytest.fixture(scope="module")
def bob(jac_server):
    with account(jac_server) as client:
        yield client


def test_render_fits_the_budget_and_keeps_pairing(alice):
    messages = conversation()
    # The paper's renderer (the stable policy and the prose share: tests/test_stability.py).
    rendered = alice.render("r1", messages, budget=600, explain=True, policy="per-call", prose_share=1.0, condense=False)
    # The type Engine.render returns: the engine's RenderResult, with ResultDecisions.
    assert type(rendered) is RenderResult and rendered.selected
    assert all(type(d) is ResultDecision for d in rendered.decisions)
    assert rendered.messages[0] == messages[0] and rendered.messages[-1] == messages[-1]
    history = rendered.messages[1:-1]
    assert get_tokenizer().history_tokens(history) == rendered.history_tokens <= 600
    assert pairing_problems(rendered.messages) == []
    # The reused result (ITEM_0003) is kept; decisions explain every result.
    kept = {d.call_id for d in rendered.decisions if d.status == "kept"}
    assert "call_3" in kept and len(rendered.decisions) == 13
    assert alice.explain("r1").summary()["history_tokens"] == rendered.history_tokens


def test_session_endpoints(alice):
    messages = conversation(4)
    summary = alice.ingest("s-endpoints", messages)
    # The type Engine.ingest returns, rebuilt from the server's report.
    assert type(summary) is IngestSummary and summary.session_id == "s-endpoints"
    assert summary.added == len(messages) - 1  # the system prompt is kept on the session
    assert alice.ingest("s-endpoints", messages).added == 0  # idempotent
    variants = alice.render_variants("s-endpoints", [{"budget": 300}, {"budget": 300, "selector": "prune"}], explain=True)
    assert [(type(v), v.selector) for v in variants] == [(RenderResult, "contextrender"), (RenderResult, "prune")]
    assert all(v.history_tokens <= 300 and v.decisions for v in variants)
    session = alice.get_session("s-endpoints", include_messages=True)
    assert session["events"] == len(messages) - 1 and session["tool_results"] == 5
    assert session["messages"] == messages
    assert "s-endpoints" in [s["session_id"] for s in alice.list_sessions()]
    assert alice.configure("s-endpoints", omitted="drop").omitted == "drop"  # a RenderConfig, as from Engine
    graph = alice.export_graph("s-endpoints")
    first = alice.export_graph("s-endpoints", limit=3)
    assert [n["kind"] for n in first["nodes"]] == ["Session", "Message", "Message"]
    assert all(e["from"] in {n["id"] for n in first["nodes"]} and e["to"] in {n["id"] for n in first["nodes"]} for e in first["edges"])
    kinds = {n["kind"] for n in graph["nodes"]}
    assert {"Session", "Message", "ToolCall", "ToolResult"} <= kinds
    reuses = [e for e in graph["edges"] if e["kind"] == "Reuses"]
    assert reuses and all(e["values"] for e in reuses)
    dot = alice.export_graph("s-endpoints", format="jac-dot")["dot"]
    assert dot.startswith("digraph") and "reuses ITEM_0003_SKU" in dot and "result r1 of lookup" in dot
    # What is below the session only (docs/inspector.md): it drew the 64 shelves and the directory too.
    assert 'label="shelf' not in dot and "Root()" not in dot
    # The picture for people (walkers/picture.jac): the chain only, reuse edges with their values.
    people = alice.export_graph("s-endpoints", format="dot")["dot"]
    assert people.startswith("digraph") and "r1 lookup" in people and "ITEM_0003_SKU" in people and "shelf" not in people
    deleted = alice.delete_session("s-endpoints")
    assert deleted["deleted"] and deleted["nodes"] == len(graph["nodes"])
    with pytest.raises(UnknownSession):
        alice.get_session("s-endpoints")


def test_users_are_isolated(alice, bob):
    alice.ingest("private", conversation(2))
    assert "private" not in [s["session_id"] for s in bob.list_sessions()]
    for attempt in (lambda: bob.get_session("private"), lambda: bob.delete_session("private"),
                    lambda: bob.explain("private"), lambda: bob.export_graph("private")):
        with pytest.raises(UnknownSession):
            attempt()
    # Bob's render under the same id makes his own session; Alice's is untouched.
    bob.render("private", [user("bob's own")], budget=500)
    assert alice.get_session("private")["events"] == len(conversation(2)) - 1
    assert bob.get_session("private")["events"] == 1


def test_health_needs_no_login_and_walkers_do(jac_server):
    assert Client(jac_server.url).health()["status"] == "ok"
    with pytest.raises(ContextRenderError) as failure:
        Client(jac_server.url).list_sessions()
    assert failure.value.status == 401


def test_bad_input_gets_4xx_and_changes_nothing(jac_server, alice):
    alice.ingest("guarded", conversation(2))
    before = alice.get_session("guarded", include_messages=True)
    bad_calls = {
        "small budget": (lambda: alice.render("guarded", budget=10), InvalidRequest, "budget must be"),
        "small budget with new events": (lambda: alice.render("guarded", conversation(3), budget=10), InvalidRequest, "budget must be"),
        "orphan tool message": (lambda: alice.ingest("guarded", [tool("nope", "x")], append=True), InvalidRequest, "no earlier assistant message"),
        "unknown selector": (lambda: alice.render("guarded", budget=500, selector="magic"), InvalidRequest, "unknown selector"),
        "unknown parameter": (lambda: alice.render("guarded", budget=500, decayy=0.1), InvalidRequest, "decayy"),
        "bad role": (lambda: alice.ingest("guarded", [{"role": "robot", "content": "x"}], append=True), InvalidRequest, "role"),
        "rewrite with reject": (lambda: alice.render("guarded", [user("different start")], budget=500, on_rewrite="reject"), HistoryConflict, "rewrite"),
        "unknown session": (lambda: alice.export_graph("never-made"), UnknownSession, "no session"),
        "export format": (lambda: alice.export_graph("guarded", format="png"), InvalidRequest, "format must be"),
        "variant not an object": (lambda: alice.render_variants("guarded", ["prune"]), InvalidRequest, "variants must be"),
    }
    for name, (attempt, error, words) in bad_calls.items():
        with pytest.raises(error) as failure:
            attempt()
        assert words in str(failure.value), name
    headers = {"Authorization": f"Bearer {alice.token}", "content-type": "application/json"}
    raw_cases = {
        "not JSON": (b"{not json", 422),
        "messages not a list": (json.dumps({"session_id": "guarded", "messages": "hi", "budget": 500}).encode(), 422),
        "budget not a number": (json.dumps({"session_id": "guarded", "budget": "lots"}).encode(), 422),
        "oversized body": (json.dumps({"session_id": "guarded", "messages": [user("x" * 1_200_000)], "budget": 500}).encode(), 413),
    }
    for name, (body, status) in raw_cases.items():
        response = httpx.post(f"{jac_server.url}/walker/render_context", content=body, headers=headers, timeout=60)
        assert response.status_code == status, (name, response.text[:300])
        assert "Traceback" not in response.text

    def chunked(body: bytes):  # no content-length: the limit applies as the body arrives
        for start in range(0, len(body), 65536):
            yield body[start:start + 65536]

    oversized = raw_cases["oversized body"][0]
    response = httpx.post(f"{jac_server.url}/walker/render_context", content=chunked(oversized), headers=headers, timeout=60)
    assert response.status_code == 413, response.text[:300]
    # A field the walker does not have (misspelt, or `create`, which is not a request field) is
    # refused, not dropped; a read endpoint does not create what it reads.
    for body, field in (({"session_id": "guarded", "budget": 500, "selectr": "prune"}, "selectr"),
                        ({"session_id": "not-made", "create": True}, "create")):
        walker = "render_context" if "budget" in body else "get_session"
        response = httpx.post(f"{jac_server.url}/walker/{walker}", json=body, headers=headers)
        assert response.status_code == 400 and f"no field '{field}'" in response.json()["error"]["message"], response.text
        assert "selector" in response.json()["error"]["message"] or walker == "get_session"
    with pytest.raises(UnknownSession):
        alice.get_session("not-made")
    # Login comes first; no answer carries CORS headers while CONTEXTRENDER_CORS_ORIGINS is unset.
    anonymous = httpx.post(f"{jac_server.url}/walker/get_session", json={"session_id": "x", "selectr": 1})
    assert anonymous.status_code == 401
    refused = httpx.post(f"{jac_server.url}/walker/get_session", json={"session_id": "x", "selectr": 1},
                         headers={**headers, "origin": "http://localhost:3000"})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    with pytest.raises(InvalidRequest, match="session_id"):
        alice.render("", [user("x")], budget=500)
    with pytest.raises(InvalidRequest, match="limit"):
        alice.export_graph("guarded", limit=0)
    assert alice.get_session("guarded", include_messages=True) == before


def test_async_client(jac_server, alice):
    import asyncio

    async def go() -> tuple:
        async with AsyncClient(jac_server.url, token=alice.token) as client:
            rendered = await client.render("async-run", conversation(3), budget=400)
            session = await client.get_session("async-run")
            with pytest.raises(UnknownSession):
                await client.explain("never-rendered")
            return rendered, session

    rendered, session = asyncio.run(go())
    assert rendered.history_tokens <= 400 and pairing_problems(rendered.messages) == []
    assert session["last_render"]["history_tokens"] == rendered.history_tokens


def test_client_logs_in_again_when_its_token_is_refused(jac_server):
    client = Client(jac_server.url)
    client.register("relogin-user", "secret-password-1")
    client.token = client.token[:-4] + "AAAA"  # as good as expired
    assert client.list_sessions() == []
    with pytest.raises(ContextRenderError) as failure:
        Client(jac_server.url, token=client.token[:-4] + "AAAA").list_sessions()  # no password to retry with
    assert failure.value.status == 401


def _documented_jac_dot() -> list[str]:
    """The `jac dot` command docs/server-and-security.md gives (up to its `&&`), as arguments."""
    import re
    import shlex

    text = (REPO / "docs" / "server-and-security.md").read_text(encoding="utf-8")
    (command,) = re.findall(r"`(jac dot [^`]*?)(?: &&[^`]*)?`", text)
    return shlex.split(command)


def test_jac_dot_as_the_docs_give_it_draws_the_session_graph(jac_server, alice, tmp_path):
    alice.ingest("drawn", conversation(5))
    session_id = next(n["id"] for n in alice.export_graph("drawn")["nodes"] if n["kind"] == "Session")
    command = [part.replace("<id>", session_id) for part in _documented_jac_dot()]
    assert command[:2] == ["jac", "dot"] and "session.dot" in command
    # In the server's store folder (the docs name it), as a user runs it: no server secret in the environment.
    env = {k: v for (k, v) in jac_server.env.items() if k != "CONTEXTRENDER_JWT_SECRET"}
    done = subprocess.run([str(JAC), *command[1:]], cwd=jac_server.workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    dot = (jac_server.workdir / "session.dot").read_text()
    assert "Session drawn" in dot and "reuses ITEM_0003_SKU" in dot and "calls" in dot and "answered by" in dot
    assert 'label="shelf' not in dot and "Root()" not in dot  # the session's graph, not the shelves that hold it
    # An id the folder's store does not hold is an error saying where to look (it drew Root() and exited 0).
    missing = [part.replace("<id>", uuid.uuid4().hex) for part in _documented_jac_dot()]
    done = subprocess.run([str(JAC), *missing[1:]], cwd=jac_server.workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "store folder of the `contextrender serve`" in done.stdout + done.stderr


def test_acknowledged_writes_survive_kill_9(tmp_path):
    server = JacServer(tmp_path / "restart").start()
    try:
        client = Client(server.url)
        client.register("durable-user", "secret-password-1")
        messages = conversation(5)
        first = client.render("durable", messages, budget=500)
        client.ingest("durable", [assistant("REF_77_OK confirmed")], append=True)
        server.kill()
        server.start()
        client.login("durable-user", "secret-password-1")  # the account survived too
        session = client.get_session("durable", include_messages=True)
        assert session["messages"] == messages + [assistant("REF_77_OK confirmed")]
        again = client.render("durable", budget=500)
        assert again.history_tokens <= 500 and pairing_problems(again.messages) == []
        assert first.results == 6 and again.results == 6
    finally:
        server.stop()


def test_the_status_comes_from_the_exception_that_ended_the_walker():
    from contextrender.server.app import map_walker_error

    def status(details: str) -> int:
        return map_walker_error({"error": {"message": "m", "details": details}})[0]

    frames = "Traceback (most recent call last):\n  File \"walkers/render.jac\", line 1, in run\n"
    assert status(frames + "engine.errors.InvalidRequest: budget must be >= 64\nsecond line: of the message") == 400
    assert status(frames + "engine.errors.UnknownSession: no session 'x'") == 404
    # An error raised while handling ours is what failed: a 500.
    chained = (frames + "engine.errors.InvalidRequest: bad\n\nDuring handling of the above exception, another exception occurred:\n\n"
               + frames + "sqlite3.OperationalError: database is locked")
    assert status(chained) == 500
    assert status(frames + "KeyError: 'x'") == 500


def test_a_weak_jwt_secret_stops_the_server(tmp_path):
    with pytest.raises(RuntimeError, match="refuses to start: the JWT secret is shorter than 32 characters"):
        JacServer(tmp_path / "weak", CONTEXTRENDER_JWT_SECRET="too-short").start()


def test_the_switch_interval_setting_is_applied(monkeypatch):
    """CONTEXTRENDER_SWITCH_INTERVAL (milliseconds) is the interpreter's switch interval; unset, the default."""
    from contextrender.server.app import DEFAULT_SWITCH_INTERVAL_MS, use_switch_interval

    before = sys.getswitchinterval()
    try:
        monkeypatch.setenv("CONTEXTRENDER_SWITCH_INTERVAL", "0.5")
        assert use_switch_interval() == 0.5
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        monkeypatch.delenv("CONTEXTRENDER_SWITCH_INTERVAL")
        assert use_switch_interval() == DEFAULT_SWITCH_INTERVAL_MS
        assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_MS / 1000)
    finally:
        sys.setswitchinterval(before)


def test_a_bad_switch_interval_stops_the_server(tmp_path):
    server = JacServer(tmp_path / "switch", CONTEXTRENDER_SWITCH_INTERVAL="0")
    try:
        with pytest.raises(RuntimeError, match=r"refuses to start: CONTEXTRENDER_SWITCH_INTERVAL must be a positive "
                                               r"number of milliseconds \(got '0'\)"):
            server.start()
    finally:
        server.stop()  # a server that started anyway is not left running


def test_the_servers_request_contexts_commit_new_anchors_unhashed(tmp_path):
    """jac-scale's request context, as the server's plugin answers for it, has jac-scale's working
    set with the commit pass that does not hash new anchors (adapters/working_set.py ServerMemory); what
    it writes reads back (the other tests here run every walker through it)."""
    probe = (
        "from contextrender.jaclang_setup import import_jaclang\n"
        "import_jaclang()\n"
        "from contextrender.server.plugin import register_server\n"
        "assert register_server()\n"
        "from jaclang.jac0core.runtime import plugin_manager\n"
        "from jac_scale.memory_hierarchy import ScaleTieredMemory\n"
        "from contextrender.working_set import NewAnchorsUnhashed\n"
        "ctx = plugin_manager.hook.create_j_context(user_root=None, base_path_dir=None, full_target_path=None)\n"
        "print(type(ctx).__name__, isinstance(ctx.mem, ScaleTieredMemory), isinstance(ctx.mem, NewAnchorsUnhashed))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "JScaleExecutionContext True True"


def test_explain_and_last_render_survive_a_server_restart(tmp_path):
    """explain_render and get_session's last_render after `jac start` is stopped and
    started again on the same store equal what they were before (the last call re-renders)."""
    server = JacServer(tmp_path / "explained").start()
    try:
        client = Client(server.url)
        client.register("explained-user", "secret-password-1")
        messages = [user("Refund order ORD_0001 for jane.doe@example.com")]
        modes = []
        for i in range(30):
            messages += [assistant(None, call(f"c{i}", "lookup", {"page": i})), tool(f"c{i}", f"page {i} ITEM_{i:04d}_SKU " + "details " * 60)]
            rendered = client.render("explained", messages, budget=900)
            modes.append(rendered.mode)
            if rendered.mode == "re-render" and "append" in modes:
                break  # a scored re-render after appends: what a restart showed as an append

        def shown() -> tuple:
            explained = client.explain("explained")
            decisions = [dataclasses.asdict(d) for d in explained.decisions]
            return explained.messages, explained.summary(), decisions, client.get_session("explained")["last_render"]

        before = shown()
        assert before[1]["mode"] == rendered.mode == "re-render" and before[3]["mode"] == "re-render"
        server.stop()
        server.start()
        client.login("explained-user", "secret-password-1")
        assert shown() == before
    finally:
        server.stop()


def test_metrics_count_requests_by_endpoint_and_status(jac_server, alice):
    from prometheus_client.parser import text_string_to_metric_families

    def count(text: str, endpoint: str, status: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "contextrender_requests_total" and s.labels["endpoint"] == endpoint and s.labels["status"] == status)

    first = httpx.get(f"{jac_server.url}/metrics")
    assert first.status_code == 200 and "contextrender_request_seconds_bucket" in first.text
    alice.list_sessions()
    alice.render("metered", [user("count me")], budget=300)
    httpx.post(f"{jac_server.url}/walker/list_sessions", json={})  # no token: 401
    after = httpx.get(f"{jac_server.url}/metrics").text
    assert count(after, "list_sessions", "200") == count(first.text, "list_sessions", "200") + 1
    assert count(after, "render_context", "200") >= count(first.text, "render_context", "200") + 1
    assert count(after, "list_sessions", "401") == count(first.text, "list_sessions", "401") + 1
    assert "count me" not in after


def test_serve_says_ready_once_it_answers_with_what_to_do_next(tmp_path):
    """`contextrender serve`: one banner, printed once the port answers (jac start said "Server
    ready" 31 s before), with the URL, the two curl lines, the inspector and how to stop; `/`
    answers; none of jac-scale's lines about the admin routes it does not serve."""
    import os
    import time

    from contextrender.testing.loopback import free_port, stop_process

    port = free_port()
    env = dict(os.environ, CONTEXTRENDER_JWT_SECRET="s" * 8 + "-a-strong-enough-test-secret-0123456789")
    process = subprocess.Popen([str(JAC.parent / "contextrender"), "serve", "--port", str(port), "--store", str(tmp_path / "store")],
                               cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any(" ready on " in line for line in lines):
            line = process.stdout.readline()
            assert line or process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        assert httpx.post(f"{url}/walker/health", json={}, timeout=5).status_code == 200  # ready means answering
        front = httpx.get(f"{url}/", timeout=5)
        assert front.status_code == 200 and front.json()["data"]["inspector"] == "/contextrender/"
        for _ in range(6):  # the rest of the banner
            lines.append(process.stdout.readline())
    finally:
        stop_process(process)
    out = "".join(lines)
    assert f"ready on {url}/" in out
    assert f"curl -X POST {url}/user/register" in out and f"curl -X POST {url}/user/login" in out
    assert f"inspector:     {url}/contextrender/" in out and "Ctrl-C" in out
    assert "Admin portal is disabled" not in out and "/admin" not in out and "Server ready" not in out
    assert process.returncode is not None


def test_password_hashes_run_one_core_short_and_answer_the_same():
    """bcrypt lets go of the interpreter: unbounded, thirty registrations at once took every core
    from the server's other calls (adapters/server/accounts.py)."""
    import threading
    import time

    from contextrender.server.accounts import hash_one_core_short

    running, most = [0], [0]
    lock = threading.Lock()

    class Storage:  # jac-scale's IdentityStorage shape: static methods its stores call by class name
        @staticmethod
        def hash_password(password: str) -> str:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1
            return "hash:" + password

        @staticmethod
        def verify_password(password: str, password_hash: str) -> bool:
            return "hash:" + password == password_hash

    hash_one_core_short(Storage, hashes=1)
    hash_one_core_short(Storage, hashes=1)  # once per class
    threads = [threading.Thread(target=Storage.hash_password, args=(f"p{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1
    assert Storage.hash_password("x") == "hash:x" and Storage.verify_password("x", "hash:x")
