"""The OpenAI-compatible proxy over real HTTP on loopback: a fake upstream records what it got."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from contextrender import UnknownSession
from contextrender.testing.checks import pairing_problems
from contextrender.testing.fake_upstream import FakeUpstream, LoopbackServer, free_port
from contextrender.proxy import (
    BUDGET_HEADER, SELECTOR_HEADER, SESSION_HEADER, SESSION_NAME_HEADER, STATUS_HEADER, UNMANAGED_HEADER, create_app, derive_session,
    named_session,
)
from engine.measure import get_tokenizer
from engine.notices import restore_tool
from tests.conftest import assistant, call, tool, user
from tests.proxy_fixtures import all_met, objects_met

TOK = get_tokenizer()
BUDGET = 600
SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools."}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def conversation(results: int = 12, words: int = 120) -> list[dict]:
    """A run whose tool results far exceed BUDGET, ending with the current user message."""
    messages = [SYSTEM, user("Fix the failing test in module_alpha.")]
    for i in range(results):
        call_id = f"call_{i}"
        messages.append(assistant(f"Reading file {i}.", call(call_id, "read_file", {"path": f"src/file_{i}.py"})))
        body = " ".join(f"line_{i}_{j} = value_{i}_{j}" for j in range(words))
        messages.append(tool(call_id, body))
    messages.append(user("Now write the fix."))
    return messages


def history(messages: list[dict]) -> list[dict]:
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return rest[:-1] if rest and rest[-1]["role"] == "user" else rest


def _events(engine, session_id: str) -> int:
    try:
        return engine.get_session(session_id)["events"]
    except UnknownSession:
        return 0


def wait_for_events(engine, session_id: str, events: int) -> None:
    """Until the session's chain holds `events` events (the answer is ingested after the response)."""
    deadline = time.monotonic() + 10
    while _events(engine, session_id) < events:
        assert time.monotonic() < deadline, f"session {session_id} never reached {events} events"
        time.sleep(0.02)


def wait_for_usage(engine, session_id: str, requests: int) -> dict:
    """The session's usage once `requests` forwarded requests are counted (the answer, with its
    usage, is ingested after the response: the request's own events are stored before it)."""
    deadline = time.monotonic() + 10
    while (usage := engine.get_session(session_id)["usage"]).get("requests", 0) < requests:
        assert time.monotonic() < deadline, f"session {session_id} never counted {requests} requests: {usage}"
        time.sleep(0.02)
    return usage


@pytest.fixture
def proxy(engine, upstream):
    """The proxy with the engine in-process, in front of the fake upstream."""

    def start(**options):
        app = create_app(engine, upstream.base_url, options.pop("budget", BUDGET), **options)
        return LoopbackServer(app)

    return start


def test_history_is_rendered_within_budget_and_everything_else_is_forwarded(engine, upstream, proxy):
    messages = conversation()
    body = {"model": "fake-model", "messages": messages, "tools": TOOLS, "temperature": 0.25, "max_tokens": 77, "user": "u-1"}
    headers = {"Authorization": "Bearer sk-test-123", "X-Custom": "kept", SESSION_HEADER: "run-1"}
    with proxy() as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    got = upstream.requests[-1]
    sent = got.json
    # Rendered: system prompt and current user message untouched, history within B, pairs valid.
    rendered = sent["messages"]
    assert rendered[0] == SYSTEM and rendered[-1] == messages[-1]
    assert TOK.history_tokens(history(messages)) > 4 * BUDGET
    assert TOK.history_tokens(history(rendered)) <= BUDGET
    assert pairing_problems(rendered) == []
    assert rendered != messages
    # The rendered list is the engine's render of this session.
    assert rendered == engine.render("run-1", messages, budget=BUDGET).messages
    # Every other field and header forwarded unchanged (results were omitted, so the tools gain
    # the restore tool: docs/restores.md); the session header is the proxy's own.
    assert {k: v for k, v in sent.items() if k not in ("messages", "tools")} == {k: v for k, v in body.items() if k not in ("messages", "tools")}
    assert sent["tools"] == TOOLS + [restore_tool()]
    assert list(sent) == list(body)
    assert got.headers["authorization"] == "Bearer sk-test-123"
    assert got.headers["x-custom"] == "kept"
    assert SESSION_HEADER not in got.headers
    assert got.headers["content-length"] == str(len(got.body))


def test_non_streaming_answer_comes_back_unchanged_and_is_ingested(engine, upstream, proxy):
    messages = conversation(results=3, words=10)
    answer_call = call("call_next", "read_file", {"path": "src/fix.py"})
    upstream.enqueue(content="Let me look.", tool_calls=[answer_call])
    with proxy() as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages}, headers={SESSION_HEADER: "run-2"})
        assert response.status_code == 200
        assert response.content == upstream.requests[-1].sent
        assert response.headers["x-fake-upstream"] == "1"
        assert response.headers["content-type"] == "application/json"
        wait_for_events(engine, "run-2", len(messages))  # the chain (system prompt apart) + the answer
        # The agent sends the answer back re-serialised (null fields as an SDK's model_dump writes
        # them) with its tool result: the stored answer stands in for it, the session does not fork.
        echoed = {"role": "assistant", "content": "Let me look.", "refusal": None, "function_call": None,
                  "tool_calls": [answer_call], "annotations": []}
        follow = messages + [echoed, tool("call_next", "def fix(): pass"), user("Apply it.")]
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": follow}, headers={SESSION_HEADER: "run-2"})
        assert response.status_code == 200
        wait_for_events(engine, "run-2", len(follow))
    stored_answer = {"role": "assistant", "content": "Let me look.", "tool_calls": [answer_call]}
    done = {"role": "assistant", "content": "Done."}
    stored = engine.ingest("run-2", messages + [stored_answer, follow[-2], follow[-1], done])
    assert stored.added == 0 and stored.forked_at == -1
    rendered = upstream.requests[-1].json["messages"]
    assert rendered[-3] == stored_answer and rendered[-2]["content"] == "def fix(): pass"


def test_streaming_chunks_pass_through_byte_for_byte_and_the_answer_is_ingested(engine, upstream, proxy):
    messages = conversation(results=4, words=10)
    answer_call = call("call_streamed", "read_file", {"path": "src/streamed_module.py"})
    upstream.enqueue(content="Streaming a longer answer in many small pieces.", tool_calls=[answer_call])
    with proxy() as server:
        received = []
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions",
            json={"model": "m", "messages": messages, "stream": True}, headers={SESSION_HEADER: "run-3"},
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for chunk in response.iter_raw():
                received.append(chunk)
        sent = upstream.requests[-1].sent
        assert b"".join(received) == sent
        assert sent.count(b"data: ") > 10
        # The answer, rebuilt from the stream, is in the session right after the request's messages.
        wait_for_events(engine, "run-3", len(messages))
    follow = messages + [
        {"role": "assistant", "content": "Streaming a longer answer in many small pieces.", "tool_calls": [answer_call]},
    ]
    stored = engine.ingest("run-3", follow)
    assert stored.added == 0 and stored.forked_at == -1


class ForkSpy:
    """The engine, recording whether each request's message list rewrote the stored history."""

    def __init__(self, engine):
        self.engine, self.forks = engine, []

    def render(self, session_id, messages, **options):
        self.forks.append(self.engine.ingest(session_id, messages).forked_at)
        return self.engine.render(session_id, messages, **options)

    def ingest(self, session_id, messages, **options):
        return self.engine.ingest(session_id, messages, **options)

    def __getattr__(self, name):  # get_session, configure
        return getattr(self.engine, name)


def test_answers_echoed_over_many_turns_never_fork_the_session(engine, upstream):
    spy = ForkSpy(engine)
    messages = conversation(results=2, words=10)[:-1]
    with LoopbackServer(create_app(spy, upstream.base_url, BUDGET)) as server:
        for turn in range(4):
            call_id = f"call_turn_{turn}"
            upstream.enqueue(content=None if turn % 2 else "", tool_calls=[call(call_id, "read_file", {"path": f"t{turn}.py"})])
            body = {"model": "m", "messages": messages, "stream": turn % 2 == 1}
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={SESSION_HEADER: "loop"})
            assert response.status_code == 200
            # As an SDK user appends the answer: every field of the message, nulls included.
            if body["stream"]:
                echoed = {"role": "assistant", "content": "", "function_call": None, "refusal": None,
                          "tool_calls": [dict(call(call_id, "read_file", {"path": f"t{turn}.py"}), index=0)]}
            else:
                echoed = response.json()["choices"][0]["message"] | {"annotations": [], "audio": None}
            messages = messages + [echoed, tool(call_id, f"contents of t{turn}.py")]
            wait_for_events(engine, "loop", len(messages) - 2)  # system prompt and new tool result apart
    assert spy.forks == [-1, -1, -1, -1]


def test_the_next_request_s_history_meets_the_objects_the_engine_kept_of_the_last(engine, upstream, monkeypatch):
    # The proxy never changes a message it sent (tests/test_proxy_bodies.py, test_5) and says so
    # (interfaces.sent_unchanged): the in-process engine's index keeps the proxy's own messages,
    # and each later request's resent history is, object for object, what the index holds (the
    # comparison asks `is` first). Without the promise the index keeps copies: none the same.
    met = objects_met(monkeypatch)
    messages = conversation(results=2, words=10)[:-1]
    with LoopbackServer(create_app(engine, upstream.base_url, BUDGET)) as server:
        for turn in range(4):
            call_id = f"call_turn_{turn}"
            upstream.enqueue(content=None, tool_calls=[call(call_id, "read_file", {"path": f"t{turn}.py"})])
            response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages},
                                  headers={SESSION_HEADER: "owned"})
            assert response.status_code == 200
            messages = messages + [response.json()["choices"][0]["message"], tool(call_id, f"contents of t{turn}.py")]
            wait_for_events(engine, "owned", len(messages) - 2)
    # The renders after the first compare a stored history (an answer appended alone compares none).
    assert all_met(met, 3), met
    assert engine.get_session("owned")["branch"] == 0


def test_session_comes_from_the_header_or_the_stable_prefix(engine, upstream, proxy):
    first = conversation(results=2, words=5)
    later = first[:-1] + [assistant("ok"), user("next step")]
    other = [SYSTEM, user("A different task."), assistant("ok"), user("go")]
    assert derive_session(first) == derive_session(later) != derive_session(other)
    assert derive_session([{"role": "developer", "content": "x"}, user("y")]) != derive_session([SYSTEM, user("y")])
    # Agents stamp the date or time into their system prompt: the session stays the same.
    dated = [{"role": "system", "content": "Today is 2026-11-29 10:00."}, user("Fix the bug.")]
    later_that_day = [{"role": "system", "content": "Today is 2026-11-29 10:01."}, user("Fix the bug."), assistant("ok"), user("go")]
    assert derive_session(dated) == derive_session(later_that_day)
    with proxy() as server:
        for messages in (first, other):
            assert httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages}).status_code == 200
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": other}, headers={SESSION_HEADER: "named"})
    # Each session holds its own conversation (plus the answer ingested after it).
    assert engine.ingest(derive_session(first), first).added == 0
    assert engine.ingest(derive_session(other), other).added == 0
    assert engine.ingest("named", other).added == 0


# Session header values the engine cannot store as they stand: longer than 256 characters, a tab,
# bytes that are not UTF-8 (a client that sent Latin-1), and the name shown for each.
AWKWARD_NAMES = [
    pytest.param(b"agent-" + b"x" * 300, "agent-" + "x" * 300, id="over-256"),
    pytest.param(b"my\tsession", "my\tsession", id="tab"),
    pytest.param("sesi\u00f3n-\u00fc".encode("latin-1"), "sesi\u00f3n-\u00fc", id="latin-1-bytes"),
]


@pytest.mark.parametrize(("sent", "name"), AWKWARD_NAMES)
def test_any_session_header_is_managed_and_keeps_its_name(engine, upstream, proxy, sent, name):
    """A session header that is not a valid session id as it stands is stored under a digest of
    it, managed like any other, and shown with the name as sent."""
    messages = [SYSTEM, user("Say hello."), assistant("Hello."), user("Again.")]
    with proxy() as server:
        first = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages},
                           headers={SESSION_HEADER: sent})
        again = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages + [assistant("ok"), user("go")]},
                           headers={SESSION_HEADER: sent})
    key = first.headers["x-contextrender-session"]
    for response in (first, again):
        assert response.status_code == 200
        assert response.headers["x-contextrender-status"] == "managed" and UNMANAGED_HEADER not in response.headers
        assert response.headers["x-contextrender-session"] == key == named_session(sent)[0]
        assert response.headers.raw[[k for (k, _) in response.headers.raw].index(SESSION_NAME_HEADER.encode())][1] == name.encode()
    assert key.startswith("proxy-named-") and named_session(sent) == (key, name)
    wait_for_events(engine, key, len(messages) + 2)
    assert [s["session_id"] for s in engine.list_sessions()] == [key]  # one session: the second request found it
    # The session keeps the name as sent, for get_session, list_sessions and the inspector.
    assert engine.get_session(key)["name"] == name and engine.list_sessions()[0]["name"] == name
    # Two names never share a key.
    assert named_session(sent + b"2")[0] != key


def test_non_ascii_session_names_are_stored_as_sent(engine, upstream, proxy):
    """A UTF-8 session name is the session id itself, not its Latin-1 reading (`sesiÃ³n-Ã¼`)."""
    messages = [SYSTEM, user("Hola."), assistant("Hola."), user("Otra vez.")]
    names = ["sesi\u00f3n-\u00fc", "\u4f1a\u8bdd-1"]
    with proxy() as server:
        for name in names:
            response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages},
                                  headers={SESSION_HEADER: name.encode()})
            assert response.status_code == 200 and response.headers["x-contextrender-status"] == "managed"
            assert response.headers["x-contextrender-session"] == name and SESSION_NAME_HEADER not in response.headers
            wait_for_events(engine, name, len(messages))
    assert sorted(s["session_id"] for s in engine.list_sessions()) == sorted(names)
    assert [s["name"] for s in engine.list_sessions()] == ["", ""]  # the key is the name: nothing more to keep
    assert engine.ingest(names[0], messages).added == 0


def test_engine_failure_forwards_the_original_request_unless_fail_closed(engine, upstream, proxy):
    # A tool message answering a call nobody made: the engine rejects it.
    broken = [SYSTEM, user("hi"), tool("call_missing", "orphan"), user("go")]
    body = {"model": "m", "messages": broken, "temperature": 0}
    raw = json.dumps(body).encode()
    with proxy() as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 200
        assert upstream.requests[-1].body == raw
    with proxy(fail_closed=True) as server:
        calls = len(upstream.requests)
        response = httpx.post(f"{server.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert "call_missing" in response.json()["error"]["message"]
        assert len(upstream.requests) == calls


class BrokenBackend:
    """A backend whose server is down."""

    def render(self, *args, **kwargs):
        raise ConnectionError("server unreachable")

    def ingest(self, *args, **kwargs):
        raise ConnectionError("server unreachable")

    get_session = configure = ingest


def test_fail_closed_answers_502_when_the_engine_itself_fails(upstream):
    with LoopbackServer(create_app(BrokenBackend(), upstream.base_url, BUDGET, fail_closed=True)) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": conversation(1, 5)})
    assert response.status_code == 502 and "server unreachable" in response.json()["error"]["message"]
    assert upstream.requests == []


def test_fields_a_request_does_not_take_are_not_sent_back(engine, upstream, proxy):
    """DeepSeek answers with `reasoning_content` and refuses requests that send it back; it is
    also no part of the history budget. The proxy stores and forwards answers without it."""
    messages = conversation(results=2, words=5)
    upstream.enqueue(content="Looking.")
    with proxy() as server:
        headers = {SESSION_HEADER: "reasoner"}
        assert httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages}, headers=headers).status_code == 200
        wait_for_events(engine, "reasoner", len(messages))
        echoed = {"role": "assistant", "content": "Looking.", "reasoning_content": "step by step " * 200, "refusal": None}
        follow = messages + [echoed, user("Go on.")]
        assert httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": follow}, headers=headers).status_code == 200
    sent = upstream.requests[-1].json["messages"]
    assert sent[-2] == {"role": "assistant", "content": "Looking."}
    assert all("reasoning_content" not in m for m in sent)
    stored = engine.get_session("reasoner", include_messages=True)["messages"]
    assert stored[: len(follow)] == messages + [{"role": "assistant", "content": "Looking."}, user("Go on.")]


def test_head_and_other_paths_keep_the_upstream_length(upstream, proxy):
    with proxy() as server:
        head = httpx.head(f"{server.url}/v1/models")
        get = httpx.get(f"{server.url}/v1/models")
    assert head.status_code == get.status_code == 200
    assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))


def test_other_paths_and_upstream_errors_pass_through(engine, upstream, proxy):
    with proxy() as server:
        models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer k"})
        assert models.status_code == 200 and models.json() == FakeUpstream.MODELS
        assert models.headers["x-fake-upstream"] == "models"
        assert upstream.requests[-1].headers["authorization"] == "Bearer k"
        upstream.enqueue(status=429)
        failed = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": conversation(2, 5)})
        assert failed.status_code == 429
        assert failed.json()["error"]["message"] == "scripted failure"
        missing = httpx.get(f"{server.url}/v1/nothing-here")
        assert missing.status_code == 404
        assert upstream.requests[-1].path == "/v1/nothing-here"


def test_full_selector_forwards_the_history_as_is(engine, upstream, proxy):
    messages = conversation(results=6, words=60)
    with proxy(selector="full") as server:
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages}, headers={SESSION_HEADER: "full"})
    assert upstream.requests[-1].json["messages"] == messages


def test_request_headers_choose_budget_and_selector_and_the_summary_comes_back(engine, upstream, proxy):
    messages = conversation()
    cl100k = get_tokenizer("cl100k_base")
    with proxy() as server:
        url = f"{server.url}/v1/chat/completions"
        response = httpx.post(url, json={"model": "gpt-4-0613", "messages": messages}, headers={SESSION_HEADER: "hdr", BUDGET_HEADER: "300"})
        assert response.status_code == 200
        sent = upstream.requests[-1]
        assert not [h for h in sent.headers if h.startswith("x-contextrender-")]
        # Counted with the model family's encoding (GPT-4: cl100k), within the request's budget.
        assert cl100k.history_tokens(history(sent.json["messages"])) <= 300
        wait_for_events(engine, "hdr", len(messages))
        info = engine.get_session("hdr")
        assert info["config"] == {"encoding": "cl100k_base"}
        last = info["last_render"]
        assert last["budget"] == 300
        for (header, key) in (("history-tokens", "history_tokens"), ("kept", "kept"), ("omitted", "omitted"), ("folded", "folded_messages")):
            assert response.headers[f"x-contextrender-{header}"] == str(last[key])
        assert response.headers["x-contextrender-session"] == "hdr"
        # The upstream's usage, recorded beside the proxy's estimate of the same input.
        assert info["usage"]["input_tokens"] == 1 and info["usage"]["output_tokens"] == 1 and info["usage"]["requests"] == 1
        assert info["usage"]["estimated_input_tokens"] > last["history_tokens"]
        httpx.post(url, json={"model": "gpt-4-0613", "messages": messages}, headers={SESSION_HEADER: "hdr", SELECTOR_HEADER: "full"})
        assert upstream.requests[-1].json["messages"] == messages
        forwarded = len(upstream.requests)
        for (header, value) in ((BUDGET_HEADER, "12"), (BUDGET_HEADER, "1e4"), (SELECTOR_HEADER, "magic")):
            refused = httpx.post(url, json={"model": "m", "messages": messages}, headers={header: value})
            assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
            assert ("Budget" if header == BUDGET_HEADER else "Selector") in refused.json()["error"]["message"]
        assert len(upstream.requests) == forwarded


def test_unreachable_upstream_is_a_502(engine):
    app = create_app(engine, f"http://127.0.0.1:{free_port()}/v1", BUDGET)
    with LoopbackServer(app) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": conversation(1, 5)})
        # The error answer carries the render's headers, a name beyond Latin-1 included (UTF-8).
        named = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": conversation(1, 5)},
                           headers={SESSION_HEADER: "\u4f1a\u8bdd-502".encode()})
    assert response.status_code == 502 == named.status_code
    assert "upstream" in response.json()["error"]["message"]
    assert named.headers["x-contextrender-session"] == "\u4f1a\u8bdd-502"


def test_the_command_runs_the_engine_in_process(tmp_path, upstream):
    """`contextrender proxy ...`: one command, nothing else to start; it says it is ready once it
    answers, then logs one line per request and nothing of httpx's."""
    port = free_port()
    env = dict(os.environ, CONTEXTRENDER_STORE=str(tmp_path / "store"))
    command = [sys.executable, "-m", "contextrender.cli", "proxy", "--upstream", upstream.base_url,
               "--budget", str(BUDGET), "--port", str(port)]
    process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 180  # the engine loads first: slow on a busy machine
        while not any(" ready on " in line for line in lines):
            line = process.stdout.readline()
            assert line or process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "the proxy did not start"
            lines.append(line)
        # "ready" only once the port answers (jac start and uvicorn said it before).
        assert httpx.get(f"http://127.0.0.1:{port}/contextrender/ready").json() == {"ready": True}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m", "messages": conversation()})
        assert response.status_code == 200
        assert TOK.history_tokens(history(upstream.requests[-1].json["messages"])) <= BUDGET
        assert (tmp_path / "store" / ".jac").exists()
        logged = ""
        while " INFO " not in logged:  # after the start's last lines
            logged = process.stdout.readline()
            assert logged, "the proxy logged nothing for the request"
        rendered = int(response.headers["x-contextrender-history-tokens"])
        assert " INFO contextrender.proxy: session " in logged and f" chat: history " in logged and f" -> {rendered} tokens, " in logged
    finally:
        process.terminate()
        rest = process.communicate(timeout=20)[0]
    assert "HTTP Request" not in "".join(lines) + logged + rest  # httpx's line per upstream call


def test_the_readiness_endpoint_answers_with_the_upstream_down(engine):
    app = create_app(engine, f"http://127.0.0.1:{free_port()}/v1", BUDGET, inspect=False)
    with LoopbackServer(app) as server:
        ready = httpx.get(f"{server.url}/contextrender/ready")
        models = httpx.get(f"{server.url}/v1/models")  # forwarded: the upstream is down
    assert ready.status_code == 200 and ready.json() == {"ready": True}
    assert models.status_code == 502


def test_proxy_with_a_server_backend(jac_server, upstream):
    """`--server`: the proxy renders through a running `jac start` server with the client."""
    from contextrender.client import Client

    client = Client(jac_server.url)
    client.register("proxy-user", "secret-password-1")
    messages = conversation()
    upstream.enqueue(content="Found it.")
    with LoopbackServer(create_app(client, upstream.base_url, BUDGET)) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages},
                              headers={SESSION_HEADER: "via-server"})
        assert response.status_code == 200 and response.content == upstream.requests[-1].sent
    sent = upstream.requests[-1].json["messages"]
    assert TOK.history_tokens(history(sent)) <= BUDGET < TOK.history_tokens(history(messages))
    assert pairing_problems(sent) == [] and sent[0] == messages[0] and sent[-1] == messages[-1]
    deadline = time.monotonic() + 10
    while client.get_session("via-server")["events"] < len(messages):  # the answer, ingested after the response
        assert time.monotonic() < deadline, "the answer was never ingested"
        time.sleep(0.05)
    info = client.get_session("via-server", include_messages=True)
    assert info["messages"][-1] == {"role": "assistant", "content": "Found it."}
    assert info["usage"]["requests"] == 1 and info["usage"]["input_tokens"] == 1  # the upstream's report, through the server


def test_a_non_ascii_session_name_round_trips_through_a_server_backend(jac_server, upstream):
    """`--server`: the name reaches the server as sent (UTF-8 in the JSON body) and comes back so."""
    from contextrender.client import Client

    client = Client(jac_server.url)
    client.register("proxy-utf8-user", "secret-password-1")
    messages = [SYSTEM, user("Hola."), assistant("Hola."), user("Otra vez.")]
    name = "sesi\u00f3n-\u00fc"
    with LoopbackServer(create_app(client, upstream.base_url, BUDGET)) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages},
                              headers={SESSION_HEADER: name.encode()})
    assert response.status_code == 200 and response.headers["x-contextrender-status"] == "managed"
    assert response.headers["x-contextrender-session"] == name
    deadline = time.monotonic() + 10
    while client.get_session(name)["events"] < len(messages):
        assert time.monotonic() < deadline, "the session was never stored under its name"
        time.sleep(0.05)
    assert [s["session_id"] for s in client.list_sessions()] == [name]


def test_the_command_refuses_an_unknown_selector_before_serving(tmp_path):
    done = subprocess.run([sys.executable, "-m", "contextrender.cli", "proxy", "--upstream", "http://127.0.0.1:9",
                           "--budget", "1000", "--port", str(free_port()), "--selector", "magic"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "unknown selector 'magic'" in done.stderr


def test_an_empty_answer_keeps_a_content_string():
    """A provider requires assistant content unless the message has tool calls."""
    from engine.messages import normal_form

    assert normal_form({"role": "assistant", "content": None, "reasoning_content": "thinking"}) == {"role": "assistant", "content": ""}
    assert normal_form({"role": "assistant", "content": ""}) == normal_form({"role": "assistant", "content": None})
    with_call = {"role": "assistant", "content": "", "tool_calls": [call("c1", "f", {})]}
    assert normal_form(with_call)["content"] is None and normal_form(dict(with_call, content=None)) == normal_form(with_call)


def test_the_answers_the_proxy_keeps_stay_within_their_share_of_memory(engine, upstream):
    app = create_app(engine, upstream.base_url, BUDGET)
    state = app.state.proxy.sessions
    state.max_state_bytes = 6000  # about three sessions with one answer each
    answers = {}
    with LoopbackServer(app) as server:
        for n in range(8):
            upstream.enqueue(content=f"answer number {n} " * 10)
            response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": [SYSTEM, user(f"task {n}")]},
                                  headers={SESSION_HEADER: f"s{n}"})
            answers[n] = response.json()["choices"][0]["message"]
            wait_for_events(engine, f"s{n}", 2)
            assert state.state_bytes <= state.max_state_bytes
        assert 1 < len(state._sessions) < 8 and "s0" not in state._sessions
        assert state.state_bytes == sum(s.size for s in state._sessions.values())
        # A forgotten session's answer, echoed back with SDK fields, is still its stored answer.
        echoed = answers[0] | {"refusal": None, "annotations": []}
        upstream.enqueue(content="next")
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": [SYSTEM, user("task 0"), echoed, user("more")]},
                   headers={SESSION_HEADER: "s0"})
        wait_for_events(engine, "s0", 4)
    assert engine.get_session("s0")["branch"] == 0


def test_an_in_process_engine_is_warmed_up_before_the_first_request(engine, upstream, monkeypatch):
    """The tokenizer and the local embedding model load at start, not in the first agent's call,
    and the start-up heap is frozen out of the garbage collector's full walks."""
    import gc

    warmed: list[bool] = []
    real = engine.warm_up
    monkeypatch.setattr(engine, "warm_up", lambda: warmed.append(True) or real())
    gc.unfreeze()
    with LoopbackServer(create_app(engine, upstream.base_url, 1000)):
        assert warmed == [True]
        assert gc.get_freeze_count() > 0
    gc.unfreeze()


class IngestSpy:
    """The engine, counting the answers the proxy stores: alone (an ingestion after the response)
    or with the next request's render (which then carries the answer's usage report)."""

    def __init__(self, engine):
        self.engine, self.answers, self.with_render = engine, 0, 0

    def ingest(self, session_id, messages, **options):
        summary = self.engine.ingest(session_id, messages, **options)
        self.answers += bool(messages)
        return summary

    def render(self, session_id, messages, **options):
        result = self.engine.render(session_id, messages, **options)
        if options.get("usage"):
            (self.answers, self.with_render) = (self.answers + 1, self.with_render + 1)
        return result

    def __getattr__(self, name):  # get_session, configure
        return getattr(self.engine, name)


# 0: each answer stored alone right after its response; None: the default delay, an answer the
# next request re-sends stored with its render, one it does not re-send alone where it belongs.
@pytest.mark.parametrize("delay", [0, None])
def test_a_retried_turn_does_not_fork_and_its_answer_follows_its_own_request(engine, upstream, delay):
    spy = IngestSpy(engine)
    first = conversation(results=2, words=10)[:-1]  # ends with a tool result

    def answered(count: int) -> None:
        deadline = time.monotonic() + 10
        while spy.answers < count:
            assert time.monotonic() < deadline, f"only {spy.answers} answers ingested"
            time.sleep(0.02)

    with LoopbackServer(create_app(spy, upstream.base_url, BUDGET, answer_delay=delay)) as server:
        def post(messages):
            body = {"model": "m", "messages": messages}
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={SESSION_HEADER: "retry"})
            assert response.status_code == 200
            return response.json()["choices"][0]["message"]["content"]

        upstream.enqueue(content="First answer.")
        post(first)
        second = first + [assistant("First answer."), user("And the other file?")]
        upstream.enqueue(content="Second answer.")
        post(second)
        answered(2)
        stored = engine.get_session("retry")
        assert (stored["events"], stored["branch"]) == (len(second), 0)  # system apart, answer in
        # The client retries its first request and the model answers as before: nothing changes.
        upstream.enqueue(content="First answer.")
        post(first)
        answered(3)
        assert (engine.get_session("retry")["events"], engine.get_session("retry")["branch"]) == (len(second), 0)
        # Retried again, answered otherwise: a real rewrite, forked right after the request it answers.
        upstream.enqueue(content="Another first answer.")
        post(first)
        answered(4)
        now = engine.get_session("retry")
        assert (now["events"], now["branch"]) == (len(first), 1)
        rendered = engine.render("retry", [], budget=BUDGET * 10)
        assert rendered.messages[-1]["content"] == "Another first answer."
    # Only the first answer was re-sent after its own request's list: stored with the second render.
    assert spy.with_render == (0 if delay == 0 else 1)


def test_an_answer_the_next_request_resends_is_stored_by_its_render_and_the_last_one_when_the_proxy_stops(engine, upstream):
    spy = IngestSpy(engine)
    first = conversation(results=2, words=10)[:-1]
    second = first + [assistant("First answer."), user("And the other file?")]
    # A delay no test waits out: only the next request or the proxy's stop stores an answer.
    with LoopbackServer(create_app(spy, upstream.base_url, BUDGET, answer_delay=600)) as server:
        for (messages, text) in ((first, "First answer."), (second, "Second answer.")):
            upstream.enqueue(content=text)
            response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages},
                                  headers={SESSION_HEADER: "later"})
            assert response.status_code == 200
        # One Engine call a request: the first answer and its usage came with the second render.
        (stored, usage) = (engine.get_session("later", include_messages=True), engine.get_session("later")["usage"])
        assert (spy.with_render, spy.answers, usage["requests"]) == (1, 1, 1)
        assert stored["messages"][len(first)] == {"role": "assistant", "content": "First answer."}
        assert stored["events"] == len(second) - 1  # the system message apart
    # Stopped: the last answer, never re-sent, is stored alone with its usage.
    info = engine.get_session("later", include_messages=True)
    assert (info["events"], info["usage"]["requests"], spy.with_render, spy.answers) == (len(second), 2, 1, 2)
    assert info["messages"][-1] == {"role": "assistant", "content": "Second answer."}


class FailingRenderWithUsage(IngestSpy):
    def render(self, session_id, messages, **options):
        if options.get("usage"):
            raise RuntimeError("the engine failed")
        return self.engine.render(session_id, messages, **options)


def test_an_answer_whose_render_fails_is_stored_alone(engine, upstream):
    spy = FailingRenderWithUsage(engine)
    first = conversation(results=2, words=10)[:-1]
    second = first + [assistant("First answer."), user("And the other file?")]
    with LoopbackServer(create_app(spy, upstream.base_url, BUDGET, answer_delay=600)) as server:
        upstream.enqueue(content="First answer.")
        assert httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": first},
                          headers={SESSION_HEADER: "failing"}).status_code == 200
        upstream.enqueue(content="Second answer.")
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": second},
                              headers={SESSION_HEADER: "failing"})
        assert response.headers[STATUS_HEADER].startswith("unmanaged")  # fail-open
        # The answer its render would have stored is stored alone, before the response.
        info = engine.get_session("failing", include_messages=True)
        assert (info["events"], info["usage"]["requests"], spy.answers) == (len(first), 1, 1)
        assert info["messages"][-1] == {"role": "assistant", "content": "First answer."}


# ---------------------------------------------------------------- bounded requests, no cross-site use


def _raw_exchange(port: int, request: bytes, timeout: float = 30) -> bytes:
    """Send `request` on a new connection and read until the proxy closes it (or `timeout`)."""
    import socket

    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return answer


def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(engine, upstream, proxy):
    before = len(upstream.requests)
    with proxy(max_body=1024 * 1024) as server:
        # A declared length over the limit: answered at once, with nothing of the body sent.
        started = time.monotonic()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 10737418240\r\n\r\n")
        answer = _raw_exchange(server.port, head)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
        assert b"exceeds 1048576 bytes" in answer and time.monotonic() - started < 10
        # A chunked body that grows past it: 413 once it does (the rest is never read).
        def chunks():
            for _ in range(64):
                yield b"x" * 65536
        response = httpx.post(f"{server.url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert response.status_code == 413 and "CONTEXTRENDER_MAX_BODY_MB" in response.json()["error"]["message"]
        # The passthrough routes too, in the protocol's error shape.
        response = httpx.post(f"{server.url}/v1/messages/count_tokens", content=b"x" * (1024 * 1024 + 1))
        assert response.status_code == 413 and response.json()["type"] == "error"
        # Within the limit, served as before.
        assert httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": conversation(2)}).status_code == 200
    assert len(upstream.requests) == before + 1


def test_requests_from_other_origins_are_refused_and_nothing_is_forwarded(engine, upstream, proxy):
    body = {"model": "m", "messages": conversation(2)}
    with proxy() as server:
        for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example", "file://"):
            for path in ("/v1/chat/completions", "/v1/models", "/v1/messages"):
                response = httpx.post(f"{server.url}{path}", content=json.dumps(body), headers={"origin": origin, "content-type": "text/plain"})
                assert response.status_code == 403 and "--allow-origin" in str(response.json()), (origin, path, response.text)
        # A loopback page (and agents, which send no Origin) are served.
        for origin in ("http://127.0.0.1:5173", "http://localhost:3000", "http://[::1]:8080"):
            assert httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"origin": origin}).status_code == 200
    assert len(upstream.requests) == 3
    with proxy(allowed_origins=["https://app.example.com"]) as server:
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"origin": "https://app.example.com"}).status_code == 200
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"origin": "https://evil.example"}).status_code == 403
    assert len(upstream.requests) == 4


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/chat/completions", b"messages=hello", "must be JSON"),
    ("/v1/chat/completions", b'{"model": "m"}', "with `messages`, a list"),
    ("/v1/chat/completions", b'[{"role": "user", "content": "hi"}]', "a JSON object with `messages`"),
    ("/v1/messages", b'{"model": "m", "messages": "hi"}', "with `messages`, a list of turns"),
    ("/v1/responses", b'{"model": "m"}', "with `input`"),
    ("/v1/responses", b"not json", "must be JSON"),
])
def test_a_conversation_body_that_is_not_json_or_lacks_what_the_protocol_needs_is_400(engine, upstream, proxy, path, body, words):
    with proxy() as server:
        response = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "text/plain"})
    assert response.status_code == 400 and words in str(response.json()), response.text
    assert upstream.requests == [] and engine.list_sessions() == []


def test_sigterm_stops_the_proxy_within_seconds_with_requests_in_flight(tmp_path):
    """A body half sent and a call waiting on an upstream that never answers: SIGTERM still stops it."""
    import signal
    import socket
    import threading

    hanging = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.extend(iter(lambda: hanging.accept()[0], None)), daemon=True).start()
    port = free_port()
    command = [sys.executable, "-m", "contextrender.cli", "proxy", "--upstream", f"http://127.0.0.1:{hanging.getsockname()[1]}/v1",
               "--budget", str(BUDGET), "--port", str(port), "--no-inspector"]
    process = subprocess.Popen(command, env=dict(os.environ, CONTEXTRENDER_STORE=str(tmp_path / "store")), cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    clients = []
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "the proxy did not start"
                time.sleep(0.2)
        clients[0].sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n\r\n" + b"{" * 1000)
        waiting = threading.Thread(target=lambda: httpx.post(f"http://127.0.0.1:{port}/v1/models", content=b"{}", timeout=60), daemon=True)
        waiting.start()
        deadline = time.monotonic() + 30
        while not held and time.monotonic() < deadline:  # the second request reached the upstream
            time.sleep(0.05)
        assert held, "the passthrough request never reached the upstream"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
        assert time.monotonic() - started < 10, f"stopped after {time.monotonic() - started:.1f} s"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for sock in clients + held:
            sock.close()
        hanging.close()


def _samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, from Prometheus' text format."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_renders_tokens_prefix_share_and_unmanaged(engine, upstream, proxy, monkeypatch):
    from contextrender.metrics import metrics_problem

    messages = conversation()
    with proxy() as server:
        for turn in range(2):  # the second request repeats the first's rendered history as a prefix
            upstream.enqueue(content=f"answer {turn}")
            sent = messages + ([assistant("answer 0"), user("and then?")] if turn else [])
            assert httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": sent},
                              headers={SESSION_HEADER: "metered"}).status_code == 200
        httpx.post(f"{server.url}/v1/chat/completions", content=b"not json")
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages}, headers={"origin": "https://evil.example"})
        httpx.get(f"{server.url}/v1/models")
        scrape = httpx.get(f"{server.url}/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    samples = _samples(scrape.text)
    chat = (("endpoint", "/v1/chat/completions"), ("protocol", "chat"))
    assert samples[("contextrender_requests_total", chat + (("status", "200"),))] == 2
    assert samples[("contextrender_requests_total", chat + (("status", "400"),))] == 1
    assert samples[("contextrender_requests_total", chat + (("status", "403"),))] == 1
    assert samples[("contextrender_requests_total", (("endpoint", "passthrough"), ("protocol", ""), ("status", "200")))] == 1
    assert samples[("contextrender_proxy_render_seconds_count", (("protocol", "chat"),))] == 2
    assert samples[("contextrender_proxy_time_in_proxy_seconds_count", (("protocol", "chat"),))] == 2
    before = samples[("contextrender_proxy_history_tokens_before_total", (("protocol", "chat"),))]
    after = samples[("contextrender_proxy_history_tokens_after_total", (("protocol", "chat"),))]
    assert after <= 2 * BUDGET < before  # the history was rendered down
    assert samples[("contextrender_proxy_cached_prefix_share_count", (("protocol", "chat"),))] == 1
    assert samples[("contextrender_proxy_cached_prefix_share_sum", (("protocol", "chat"),))] > 0.5
    # Loopback clients only, unless configured.
    assert "loopback clients only" in metrics_problem("192.0.2.7") and metrics_problem("127.0.0.1") == ""
    monkeypatch.setenv("CONTEXTRENDER_METRICS_CLIENTS", "any")
    assert metrics_problem("192.0.2.7") == ""


def test_metrics_count_unmanaged_requests_by_reason(engine, upstream, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the store is gone")

    monkeypatch.setattr(engine, "render", broken)
    with LoopbackServer(create_app(engine, upstream.base_url, BUDGET)) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": conversation(2)})
        assert response.status_code == 200
        samples = _samples(httpx.get(f"{server.url}/metrics").text)
    assert samples[("contextrender_proxy_unmanaged_total", (("protocol", "chat"), ("reason", "RuntimeError")))] == 1


def test_reconcile_puts_in_normal_form_only_what_the_last_request_did_not_send(monkeypatch):
    from contextrender.core import normal_form
    from contextrender.proxy import sessions

    normalised: list = []
    monkeypatch.setattr(sessions, "normal_form", lambda m: normalised.append(m) or normal_form(m))
    echoed = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "read", "arguments": "{}"}, "index": 0}]}
    turn = [user("read it"), echoed, tool("c1", "TEXT_1")]
    kept = sessions.Sessions(backend=None)
    kept.remember(kept.session("s"), 1, normal_form(echoed))  # the answer the proxy forwarded
    first = kept.reconcile("s", turn)
    assert len(normalised) == 3 and first == [normal_form(m) for m in turn]
    assert first[1] is kept.session("s").answers[1]
    # The next request re-sends the same messages (new objects, as a body parsed again) and adds two.
    later = json.loads(json.dumps(turn + [assistant("done"), user("thanks")]))
    normalised.clear()
    second = kept.reconcile("s", later)
    assert normalised == later[3:]
    assert second == [normal_form(m) for m in later] and second[1] is kept.session("s").answers[1]
    # A message changed in place: from it on, all are put in normal form again.
    edited = json.loads(json.dumps(later))
    edited[2]["content"] = "TEXT_2"
    normalised.clear()
    assert kept.reconcile("s", edited) == [normal_form(m) for m in edited] and normalised == edited[2:]


def test_reconcile_compares_a_stored_answer_again_only_when_it_or_its_place_changed(monkeypatch):
    from contextrender.core import normal_form, same_event
    from contextrender.proxy import sessions

    compared: list = []
    monkeypatch.setattr(sessions, "same_event", lambda a, b: compared.append(a) or same_event(a, b))
    answer = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "read", "arguments": "{}"}, "index": 0}]}
    turn = [user("read it"), answer, tool("c1", "TEXT_1")]
    kept = sessions.Sessions(backend=None)
    state = kept.session("s")
    kept.remember(state, 1, normal_form(answer))
    assert kept.reconcile("s", turn)[1] is state.answers[1] and len(compared) == 1
    # Re-sent with more (a body parsed again): the answer at the same place is not compared again.
    later = json.loads(json.dumps(turn + [assistant("done"), user("thanks")]))
    assert kept.reconcile("s", later)[1] is state.answers[1] and len(compared) == 1
    # A new answer is compared once; the old one stays matched.
    kept.remember(state, 3, normal_form(later[3]))
    assert kept.reconcile("s", json.loads(json.dumps(later)))[3] is state.answers[3] and len(compared) == 2
    # Its place changed (the agent rewrote the history there): compared, refused, forgotten with the later ones.
    edited = json.loads(json.dumps(later))
    edited[1]["tool_calls"][0]["function"]["arguments"] = '{"path": "b"}'
    out = kept.reconcile("s", edited)
    assert out[1] == normal_form(edited[1]) and out[1] is not answer and len(compared) == 3
    assert state.answers == {} and state.matched == {}


def test_a_session_whose_encoding_and_name_are_settled_takes_one_worker_thread_a_request(engine, upstream, monkeypatch):
    from contextrender.proxy import app as proxy_app

    hops: list = []
    real = proxy_app.run_in_threadpool
    monkeypatch.setattr(proxy_app, "run_in_threadpool", lambda f, *a, **k: hops.append(f) or real(f, *a, **k))
    messages = conversation(results=2, words=5)
    with LoopbackServer(create_app(engine, upstream.base_url, BUDGET, answer_delay=0)) as server:
        for (n, name) in enumerate(["a name\twith a tab", "a name\twith a tab", "a name\twith a tab"]):
            response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "claude-x", "messages": messages[:4 + n]},
                                  headers={SESSION_HEADER: name})
            assert response.status_code == 200 and response.headers[STATUS_HEADER] == "managed"
    # The first request names the session and sets its encoding (a hop), then renders (another);
    # the next two only render (the engine's warm-up at the start aside).
    assert len([f for f in hops if getattr(f, "__name__", "") != "warm_up"]) == 4
    key = response.headers[SESSION_HEADER]
    assert engine.get_session(key)["name"] == "a name\twith a tab" and engine.get_session(key)["config"]["encoding"] == "claude"
