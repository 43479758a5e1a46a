"""Anthropic Messages through the proxy: the pinned `anthropic` SDK against a fake Anthropic
upstream on loopback, which refuses unanswered `tool_use` blocks and altered thinking signatures
as the real service does."""

from __future__ import annotations

import copy
import json
import re

import anthropic
import httpx
import pytest

from contextrender.proxy.messages.wire import MAX_BREAKPOINTS, breakpoints, to_normal
from contextrender.testing.fake_upstream import LoopbackServer, free_port, signature
from contextrender.proxy import BUDGET_HEADER, SELECTOR_HEADER, SESSION_HEADER, create_app
from engine.errors import InvalidRequest
from engine.measure import CALL_OVERHEAD, MESSAGE_OVERHEAD, PART_TOKENS, get_tokenizer
from tests.conftest import anthropic_conversation, call, scripted_tool_loop, trace_prefix
from tests.proxy_fixtures import all_met, objects_met, proxy_url_at, without_restore_tool
from tests.test_proxy import wait_for_events

BUDGET = 3000
MODEL = "claude-sonnet-4-5"
CLAUDE = get_tokenizer("claude")
EPHEMERAL = {"type": "ephemeral"}
# Assistant prose shortened to fit its share of B (engine/notices.jac, engine/measure.jac).
SHORTENED = re.compile(r"tokens cut by ContextRender|\[ContextRender: the rest of this message is left out")


def recorded(turns: int = 30) -> tuple[list[dict], list[dict]]:
    """A recorded SWE run as Claude Code sends it: parallel calls, results with a reminder text,
    thinking blocks, breakpoints on the system prompt, the previous user turn and the last one."""
    system, messages = anthropic_conversation(trace_prefix(turns=turns), parallel=3)
    system[-1]["cache_control"] = EPHEMERAL
    users = [k for (k, m) in enumerate(messages) if m["role"] == "user"]
    for k in users[-2:]:
        messages[k]["content"][-1]["cache_control"] = EPHEMERAL
    return system, messages


def history_tokens(body: dict) -> int:
    """Tok of the history of a Messages request: its normal form without the system prompt and
    the current user message (outside B)."""
    normal, _ = to_normal(body)
    rest = [m for m in normal if m["role"] != "system"]
    return CLAUDE.history_tokens(rest[:-1] if rest[-1]["role"] == "user" else rest)


def blocks(turns: list[dict]) -> list[dict]:
    return [b for t in turns for b in (t["content"] if isinstance(t["content"], list) else [{"type": "text", "text": t["content"]}])]


def without_cache(block: dict) -> dict:
    return {k: v for (k, v) in block.items() if k != "cache_control"}


def pairing(turns: list[dict]) -> list[str]:
    """Anthropic's rule, checked independently of the proxy: each turn's tool_use ids are all
    answered by tool_result blocks at the start of the next turn, a user turn; no other result."""
    problems = []
    for (k, turn) in enumerate(turns):
        content = turn["content"] if isinstance(turn["content"], list) else []
        called = [b["id"] for b in content if b["type"] == "tool_use"]
        after = turns[k + 1]["content"] if k + 1 < len(turns) and isinstance(turns[k + 1]["content"], list) else []
        leading = []
        for b in after:
            if b["type"] != "tool_result":
                break
            leading.append(b["tool_use_id"])
        if called and (turns[k + 1]["role"] != "user" or sorted(leading) != sorted(called)):
            problems.append(f"turn {k}: calls {called} answered by {leading}")
        if turn["role"] == "user" and k > 0:
            before = turns[k - 1]["content"] if isinstance(turns[k - 1]["content"], list) else []
            expected = {b["id"] for b in before if b["type"] == "tool_use"}
            got = {b["tool_use_id"] for b in content if b["type"] == "tool_result"}
            if got - expected:
                problems.append(f"turn {k}: results {sorted(got - expected)} answer no call")
    return problems


def turns_as_json(turns: list[dict]) -> list[dict]:
    """Turns holding the SDK's own block objects, as the SDK sends them."""
    return [t if isinstance(t["content"], (str, list)) and all(isinstance(b, dict) for b in t["content"]) or isinstance(t["content"], str)
            else {"role": t["role"], "content": [b.model_dump(exclude_none=True) for b in t["content"]]} for t in turns]


def agents_tools(sent: dict) -> dict:
    """A forwarded request with the agent's tools only: the restore tool the proxy adds after them
    when the render left a result out is taken away (tests/test_anthropic_restore.py tests it), and
    no text names it where it is not offered."""
    from contextrender.proxy.messages.restore import tool_definition

    return without_restore_tool(sent, tool_definition(), "messages")


def check_forwarded(system: list[dict], turns: list[dict], request: dict, sent: dict) -> dict:
    """What every managed Messages request must satisfy; returns counts of what was done."""
    assert {k: v for (k, v) in agents_tools(sent).items() if k != "messages"} == {k: v for (k, v) in request.items() if k != "messages"}
    assert sent["system"] == system  # outside B, untouched, its breakpoint kept
    out = sent["messages"]
    assert pairing(out) == []
    assert history_tokens(sent) <= BUDGET < history_tokens(request)
    original = blocks(turns)
    plain_original = [without_cache(b) for b in original]
    calls = {b["id"] for b in original if b["type"] == "tool_use"}
    from engine.notices import FOLD_INDEX_HEADING

    stubs = marker = shortened = index = 0
    for block in blocks(out):
        if block in original:
            continue  # kept exactly as the client sent it (thinking and signatures included)
        if without_cache(block) in plain_original:
            assert block["cache_control"] == EPHEMERAL  # the proxy's breakpoint on a kept block
            continue
        if block["type"] == "tool_result":
            assert block["tool_use_id"] in calls and "omitted to fit the history budget" in block["content"]
            stubs += 1
            continue
        if block["type"] == "tool_use":
            # A call over results of a folded turn, its arguments cut (`folded_call_room`).
            assert block["id"] in calls and "tokens cut by ContextRender" in json.dumps(block["input"]), block
            shortened += 1
            continue
        assert block["type"] == "text", block
        if block["text"].startswith("[ContextRender: the oldest messages"):
            marker += 1
        elif block["text"].startswith(FOLD_INDEX_HEADING):
            index += 1  # the fold index: the handles of the folded turns' results
        else:
            # Assistant prose shortened to its share of B: condensed, or cut in the middle.
            assert SHORTENED.search(block["text"]), block
            shortened += 1
    assert all(b in original for b in blocks(out) if b["type"] in ("thinking", "redacted_thinking"))
    assert out[-1] == turns[-1]  # the current turn, with its breakpoint
    markers = sum(1 for b in blocks(out) + system if b.get("cache_control"))
    assert markers <= MAX_BREAKPOINTS
    assert index <= marker
    return {"stubs": stubs, "marker": marker, "shortened": shortened, "index": index}


proxy_url = proxy_url_at(BUDGET)


def sdk(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="sk-ant-test", max_retries=0)


def test_the_history_count_the_budget_checks_use_is_the_count_by_hand():
    """`history_tokens` above (the count every budget check here uses, through the adapter's own
    `to_normal`) on one body holding each kind of block, against a count written out by hand
    from the body's strings: a block the conversion dropped or doubled would change it."""
    args = '{"path": "tests/test_app.py"}'
    body = {"model": MODEL, "max_tokens": 100, "system": [{"type": "text", "text": "You are a coding agent."}], "messages": [
        {"role": "user", "content": "Fix the failing test."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Read the test first.", "signature": signature("Read the test first.")},
            {"type": "redacted_thinking", "data": "ENCRYPTED=="},
            {"type": "text", "text": "Reading it."},
            {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "tests/test_app.py"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "def test_app(): assert add(1, 2) == 3"},
            {"type": "text", "text": "Also check add."},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "add returns 4."}]},
        {"role": "user", "content": "Fix it."},
    ]}
    # Each message: its overhead and text; a thinking block its text; any other non-text block
    # (redacted thinking, an image) PART_TOKENS; a call its overhead, name and input as JSON. The
    # system prompt and the current user message are outside B.
    count = CLAUDE.count
    by_hand = (
        MESSAGE_OVERHEAD + count("Fix the failing test.")
        + MESSAGE_OVERHEAD + count("Read the test first.") + PART_TOKENS + count("Reading it.")
        + CALL_OVERHEAD + count("read") + count(args)
        + MESSAGE_OVERHEAD + count("def test_app(): assert add(1, 2) == 3")
        + MESSAGE_OVERHEAD + count("Also check add.") + PART_TOKENS
        + MESSAGE_OVERHEAD + count("add returns 4.")
    )
    assert history_tokens(body) == by_hand


def test_a_recorded_conversation_is_rendered_within_budget(engine, upstream, proxy_url):
    system, turns = recorded()
    tools = [{"name": "bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    answer_call = call("toolu_next", "bash", {"command": "pytest -x"})
    upstream.enqueue(content="Running the tests.", tool_calls=[answer_call], thinking="The fix is in; run the tests.")
    raw = sdk(proxy_url).messages.with_raw_response.create(
        model=MODEL, max_tokens=1024, system=system, messages=turns, tools=tools, stop_sequences=["<stop>"],
        thinking={"type": "enabled", "budget_tokens": 512}, metadata={"user_id": "u-1"},
    )
    answer = raw.parse()
    got = upstream.requests[-1]
    request = {"model": MODEL, "max_tokens": 1024, "system": system, "messages": turns, "tools": tools,
               "stop_sequences": ["<stop>"], "thinking": {"type": "enabled", "budget_tokens": 512}, "metadata": {"user_id": "u-1"}}
    done = check_forwarded(system, turns, request, got.json)
    # Managed: under the default prose share the oldest turns are folded (their results leave no
    # stub), newer omitted results leave stubs.
    assert done["marker"] == 1 or done["stubs"] > 0
    # The answer comes back unchanged; the summary headers describe the render.
    assert raw.http_response.content == got.sent
    assert [b.type for b in answer.content] == ["thinking", "text", "tool_use"]
    assert answer.content[0].signature == signature("The fix is in; run the tests.")
    session = raw.headers["x-contextrender-session"]
    # The engine's count (merging turns only saves the overhead of the messages merged).
    assert history_tokens(got.json) <= int(raw.headers["x-contextrender-history-tokens"]) <= BUDGET
    # Omitted: the stubs, and the results of folded turns (gone with their turns).
    assert int(raw.headers["x-contextrender-omitted"]) >= done["stubs"]
    assert int(raw.headers["x-contextrender-folded"]) > 0 and done["marker"] == 1
    assert int(raw.headers["x-contextrender-kept"]) > 0
    # Counted with the Claude estimate; the upstream's usage is recorded beside the estimate.
    wait_for_events(engine, session, len(to_normal({"messages": turns})[0]) + 1)
    info = engine.get_session(session)
    assert info["config"]["encoding"] == "claude"
    assert info["usage"]["requests"] == 1
    assert info["usage"]["input_tokens"] == len(got.body) // 4  # what the fake reports
    assert info["usage"]["estimated_input_tokens"] > history_tokens(got.json)
    assert info["usage"]["estimate_ratio"] == round(info["usage"]["estimated_input_tokens"] / info["usage"]["reported_input_tokens"], 4)


def test_a_streamed_answer_passes_byte_for_byte_and_is_ingested(engine, upstream, proxy_url):
    system, turns = recorded(turns=12)
    body = {"model": MODEL, "max_tokens": 64, "system": system, "messages": turns, "stream": True}
    upstream.enqueue(content="Streaming a longer answer in small pieces.", thinking="Think first.",
                     tool_calls=[call("toolu_s", "bash", {"command": "ls -la src/"})])
    with httpx.stream("POST", f"{proxy_url}/v1/messages", json=body, headers={SESSION_HEADER: "bytes"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-contextrender-session"] == "bytes"
        received = b"".join(response.iter_raw())
    sent = upstream.requests[-1].sent
    assert received == sent and sent.count(b"event: content_block_delta") > 10
    check_forwarded(system, turns, body, upstream.requests[-1].json)
    # The answer, rebuilt from the events, is the session's next event.
    wait_for_events(engine, "bytes", len(to_normal({"messages": turns})[0]) + 1)
    stored = engine.get_session("bytes", include_messages=True)["messages"][-1]
    assert stored == {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Think first.", "signature": signature("Think first.")},
        {"type": "text", "text": "Streaming a longer answer in small pieces."}],
        "tool_calls": [call("toolu_s", "bash", {"command": "ls -la src/"})]}
    assert engine.get_session("bytes")["usage"]["output_tokens"] == 7


def test_answers_echoed_by_the_sdk_never_fork_the_session(engine, upstream, proxy_url):
    system, turns = recorded(turns=12)
    client = sdk(proxy_url)
    headers = {SESSION_HEADER: "claude-loop"}
    for (turn, call_id, streamed) in scripted_tool_loop(upstream, "toolu_loop", lambda t: f"Step {t}.", lambda t: f"Reasoning for step {t}."):
        if streamed:
            with client.messages.stream(model=MODEL, max_tokens=64, system=system, messages=turns, extra_headers=headers) as stream:
                answer = stream.get_final_message()
        else:
            answer = client.messages.create(model=MODEL, max_tokens=64, system=system, messages=turns, extra_headers=headers)
        # As an agent loop appends it: the SDK's own objects, serialised by the SDK.
        turns = turns + [{"role": "assistant", "content": answer.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": f"contents of file_{turn}.py"}]}]
    upstream.enqueue(content="Done.")
    client.messages.create(model=MODEL, max_tokens=64, system=system, messages=turns, extra_headers=headers)
    assert pairing(upstream.requests[-1].json["messages"]) == []
    wait_for_events(engine, "claude-loop", len(to_normal(upstream.requests[-1].json | {"messages": turns_as_json(turns)})[0]))
    info = engine.get_session("claude-loop", include_messages=True)
    assert info["branch"] == 0  # no echo was taken for a rewrite
    assert info["usage"]["requests"] == 5
    stored = [m for m in info["messages"] if m["role"] == "assistant"][-2]
    assert stored["content"][0] == {"type": "thinking", "thinking": "Reasoning for step 3.", "signature": signature("Reasoning for step 3.")}


def test_the_next_request_s_history_meets_the_objects_the_engine_kept_of_the_last(engine, upstream, proxy_url, monkeypatch):
    # As tests/test_proxy.py's test of the same name, in Messages: the turns are put in the
    # engine's normal form at each request, and `reconcile` hands the engine the last request's
    # normal forms for the turns resent unchanged, the objects its index kept under the promise.
    met = objects_met(monkeypatch)
    turns: list[dict] = [{"role": "user", "content": "Fix the failing test in module_alpha."}]
    for (turn, call_id, _streamed) in scripted_tool_loop(upstream, "toolu_owned", lambda t: f"Step {t}.", lambda t: None):
        body = {"model": MODEL, "max_tokens": 64, "system": "You are a coding agent.", "messages": turns}
        response = httpx.post(f"{proxy_url}/v1/messages", json=body, headers={SESSION_HEADER: "owned"})
        assert response.status_code == 200
        turns = turns + [{"role": "assistant", "content": response.json()["content"]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": f"contents of file_{turn}.py"}]}]
    assert all_met(met, 3), met
    assert engine.get_session("owned")["branch"] == 0


def test_kept_turns_round_trip_exactly(engine, upstream, proxy_url):
    """With everything kept (the `full` selector for one request), the forwarded turns are the
    client's, block for block: strings, images, several results plus text in one user turn,
    error results, thinking, cache markers, server tool blocks."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    turns = [
        {"role": "user", "content": "Look at the screenshot and the two files."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two reads at once.", "signature": signature("Two reads at once.")},
            {"type": "text", "text": "Reading both."},
            {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {"path": "a.py"}},
            {"type": "tool_use", "id": "toolu_b", "name": "read", "input": {"path": "b.py"}, "cache_control": EPHEMERAL},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "print('a')"},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": [{"type": "text", "text": "No such file"}], "is_error": True},
            image,
            {"type": "text", "text": "<system-reminder>b.py was moved.</system-reminder>", "cache_control": EPHEMERAL},
        ]},
        {"role": "assistant", "content": [
            {"type": "redacted_thinking", "data": "EuYBCkQYAiJA=="},
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "b.py moved"}},
            {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
            {"type": "text", "text": "Found it."},
        ]},
        {"role": "user", "content": [{"type": "text", "text": "Fix it."}]},
    ]
    body = {"model": MODEL, "max_tokens": 64, "messages": turns}
    upstream.enqueue(content="ok")
    response = httpx.post(f"{proxy_url}/v1/messages", json=body, headers={SELECTOR_HEADER: "full"})
    assert response.status_code == 200
    assert upstream.requests[-1].json == body
    normal, _ = to_normal(body)
    assert [m["role"] for m in normal] == ["user", "assistant", "tool", "tool", "user", "assistant", "user"]
    assert normal[3] == {"role": "tool", "tool_call_id": "toolu_b", "content": [{"type": "text", "text": "No such file"}], "is_error": True}
    # The same conversation rendered under a small budget: results become stubs, the user turn
    # keeps its image and text after them, and every call is still answered.
    turns[2]["content"][0]["content"] = "x = 1\n" * 100
    # The paper's layout (nothing folded, so each omitted result leaves a stub in its turn).
    engine.configure("small", policy="per-call", prose_share=1.0, condense=False)
    upstream.enqueue(content="ok")
    response = httpx.post(f"{proxy_url}/v1/messages", json=body | {"messages": turns}, headers={BUDGET_HEADER: "1000", SESSION_HEADER: "small"})
    assert response.status_code == 200, response.text
    sent = upstream.requests[-1].json["messages"]
    assert pairing(sent) == []
    results = next(t for t in sent if t["role"] == "user" and any(b["type"] == "tool_result" for b in blocks([t])))
    assert [b["type"] for b in results["content"]][:2] == ["tool_result", "tool_result"]
    assert image in results["content"]
    assert "omitted to fit the history budget" in results["content"][0]["content"]


def test_errors_come_back_in_anthropic_shape(engine, upstream, proxy_url):
    client = sdk(proxy_url)
    turns = [{"role": "user", "content": "hi"}]
    for (header, value) in ((BUDGET_HEADER, "lots"), (BUDGET_HEADER, "10"), (SELECTOR_HEADER, "magic")):
        with pytest.raises(anthropic.BadRequestError) as failed:
            client.messages.create(model=MODEL, max_tokens=8, messages=turns, extra_headers={header: value})
        body = failed.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert ("X-ContextRender-Budget" if header == BUDGET_HEADER else "X-ContextRender-Selector") in body["error"]["message"]
    assert upstream.requests == []  # refused before anything was forwarded
    # The upstream's own errors pass through as they are.
    upstream.enqueue(status=529)
    with pytest.raises(anthropic.APIStatusError) as failed:
        client.messages.create(model=MODEL, max_tokens=8, messages=turns)
    assert failed.value.status_code == 529
    assert failed.value.response.json() == {"type": "error", "error": {"type": "api_error", "message": "scripted failure"}}
    # A result answering no call: the engine refuses it; fail-closed says so in Anthropic's shape.
    broken = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "x"}]}]
    with LoopbackServer(create_app(engine, upstream.base_url, BUDGET, fail_closed=True)) as closed:
        response = httpx.post(f"{closed.url}/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": broken})
        assert response.status_code == 400
        assert response.json()["type"] == "error" and "toolu_nobody" in response.json()["error"]["message"]
        response = httpx.post(f"{closed.url}/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [{"text": "no type"}]}]})
        assert response.status_code == 400 and "messages[0].content[0]" in response.json()["error"]["message"]
    with LoopbackServer(create_app(engine, f"http://127.0.0.1:{free_port()}/v1", BUDGET)) as unreachable:
        with pytest.raises(anthropic.APIStatusError) as failed:
            sdk(unreachable.url).messages.create(model=MODEL, max_tokens=8, messages=turns)
        assert failed.value.status_code == 502
        assert failed.value.response.json()["error"]["type"] == "api_error"


def test_headers_are_forwarded_and_other_paths_pass_through(upstream, proxy_url):
    headers = {"x-api-key": "sk-ant-1", "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14",
               SESSION_HEADER: "h", BUDGET_HEADER: "5000", SELECTOR_HEADER: "contextrender"}
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    upstream.enqueue(content="hello")
    assert httpx.post(f"{proxy_url}/v1/messages?beta=true", json=body, headers=headers).status_code == 200
    got = upstream.requests[-1]
    assert got.path == "/v1/messages" and got.json == body
    for name in ("x-api-key", "anthropic-version", "anthropic-beta"):
        assert got.headers[name] == headers[name]
    assert not [h for h in got.headers if h.startswith("x-contextrender-")]
    counted = httpx.post(f"{proxy_url}/v1/messages/count_tokens", json=body, headers=headers)
    assert upstream.requests[-1].path == "/v1/messages/count_tokens" and upstream.requests[-1].json == body
    assert counted.status_code == 404  # the fake has no such route: the upstream's answer, unchanged


def test_a_cache_breakpoint_goes_to_the_end_of_the_stable_prefix():
    system = [{"type": "text", "text": "sys", "cache_control": EPHEMERAL}]
    turn = lambda i: [{"role": "user", "content": [{"type": "text", "text": f"question {i}"}]},  # noqa: E731
                      {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}]
    first = [t for i in range(4) for t in turn(i)] + [{"role": "user", "content": "go"}]
    memo = breakpoints({"system": system}, copy.deepcopy(first), None)
    # The next request repeats the first three rounds, then differs (a re-render changed it).
    second = [t for i in range(3) for t in turn(i)] + [t for i in range(10, 12) for t in turn(i)] + [
        {"role": "user", "content": [{"type": "text", "text": "go on", "cache_control": EPHEMERAL}]}]
    second[1]["content"][0]["cache_control"] = EPHEMERAL  # the client's, inside the history
    second[7]["content"][0]["cache_control"] = EPHEMERAL

    def marked(turns):
        return [(k, j) for (k, t) in enumerate(turns) for (j, b) in enumerate(t["content"] if isinstance(t["content"], list) else [])
                if b.get("cache_control")]

    added = [dict(t) for t in second]  # sharing the client's blocks, as the proxy's turns do
    breakpoints({"system": system}, added, memo)
    # 1 on the system prompt + the client's 3 = 4 already: the oldest history one gives way.
    assert marked(added) == [(5, 0), (7, 0), (10, 0)]
    assert added[5]["content"][0] == {"type": "text", "text": "answer 2", "cache_control": EPHEMERAL}
    # Moved: the client's message breakpoints all give way to the one at the stable end.
    moved = [dict(t) for t in second]
    breakpoints({"system": system}, moved, memo, move=True)
    assert marked(moved) == [(5, 0)]
    # The client's own objects are not touched.
    assert marked(second) == [(1, 0), (7, 0), (10, 0)]
    # Nothing stable (the system prompt changed): no breakpoint added, none moved or dropped.
    again = copy.deepcopy(second)
    breakpoints({"system": [{"type": "text", "text": "other"}]}, again, memo, move=True)
    assert again == second
    # Never on a thinking block: the last block before it that can take one.
    thinking = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "thinking", "thinking": "t", "signature": "s"}]}]
    memo = breakpoints({}, copy.deepcopy(thinking), None)
    out = copy.deepcopy(thinking) + [{"role": "user", "content": "next"}]
    breakpoints({}, out, memo)
    assert marked(out) == [(1, 0)]


def test_the_proxy_places_the_breakpoint_between_requests(engine, upstream, proxy_url):
    system, turns = recorded(turns=30)
    headers = {SESSION_HEADER: "cache"}
    upstream.enqueue(content="first")
    httpx.post(f"{proxy_url}/v1/messages", json={"model": MODEL, "max_tokens": 8, "system": system, "messages": turns}, headers=headers)
    first = upstream.requests[-1].json["messages"]
    wait_for_events(engine, "cache", len(to_normal({"messages": turns})[0]) + 1)
    more = turns + [{"role": "assistant", "content": [{"type": "text", "text": "first"}]}, {"role": "user", "content": "And now?"}]
    upstream.enqueue(content="second")
    httpx.post(f"{proxy_url}/v1/messages", json={"model": MODEL, "max_tokens": 8, "system": system, "messages": more}, headers=headers)
    second = upstream.requests[-1].json["messages"]
    stable = 0
    a, b = blocks(first), blocks(second)
    while stable < min(len(a), len(b)) and without_cache(a[stable]) == without_cache(b[stable]):
        stable += 1
    assert 0 < stable < len(b)
    # Re-rendered: the client's message breakpoints moved to the end of the stable prefix (the
    # last block there that takes one); its system breakpoint stays.
    spot = max(p for p in range(stable) if b[p]["type"] not in ("thinking", "redacted_thinking"))
    assert [p for (p, x) in enumerate(b) if x.get("cache_control")] == [spot]
    assert upstream.requests[-1].json["system"] == system and system[-1]["cache_control"] == EPHEMERAL


def test_bad_blocks_are_refused_with_their_place():
    for (body, where) in (
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]}, "messages[0]"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "n"}]}]}, "messages[0].content[0]"),
        ({"system": 5, "messages": []}, "system"),
    ):
        with pytest.raises(InvalidRequest, match=where.replace("[", r"\[").replace("]", r"\]")):
            to_normal(body)


def test_thinking_is_counted_and_the_estimate_is_per_model_family():
    from contextrender.proxy import model_encoding

    assert model_encoding("claude-opus-4-1") == model_encoding("anthropic/claude-3-5-haiku") == "claude"
    assert model_encoding("gpt-4.1") == model_encoding("o3") == "o200k_base"
    assert model_encoding("gpt-4-0613") == "cl100k_base"
    normal, _ = to_normal({"messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "word " * 100, "signature": "x" * 500}, {"type": "text", "text": "ok"}]}]})
    plain = CLAUDE.message_tokens({"role": "assistant", "content": "ok"})
    assert CLAUDE.message_tokens(normal[0]) == plain + CLAUDE.count("word " * 100)


def test_system_turns_inside_the_conversation_stay_where_they_are(engine, upstream, proxy_url):
    turns = [
        {"role": "user", "content": "Fix the build."},
        {"role": "system", "content": [{"type": "text", "text": "# Environment\nplatform: linux"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "make"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "error: missing header"}]},
        {"role": "user", "content": "Go on."},
        {"role": "system", "content": "<total_tokens>9000 tokens left</total_tokens>"},
    ]
    body = {"model": MODEL, "max_tokens": 8, "system": "You are a coding agent.", "messages": turns}
    upstream.enqueue(content="ok")
    response = httpx.post(f"{proxy_url}/v1/messages", json=body, headers={SESSION_HEADER: "system-turns"})
    assert response.status_code == 200
    sent = upstream.requests[-1].json
    # Everything fits: every turn as it was, the system turns where they were.
    assert sent["system"] == body["system"] and sent["messages"] == turns
