"""The proxy's restore loop (adapters/proxy/chat/restore.py, proxy/restores.py) over real HTTP on loopback: a
scripted fake upstream asks for handles named in stubs, and the agent (the `openai` SDK) gets one
ordinary answer, streamed or not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from contextrender.testing.fake_upstream import LoopbackServer
from contextrender.proxy import RESTORE_ROUNDS_HEADER, RESTORE_USAGE_HEADER, SESSION_HEADER, create_app
from contextrender.proxy import restores as restores_module
from contextrender.proxy.chat.restore import RESTORE_TOOL, StreamRound
from engine.notices import (
    FOLD_INDEX_HEADING, fold_marker, handles_line, index_entry, marker_messages, restore_tool, stub_text, without_restore_tool
)
from tests.conftest import assistant, call, tool, user
from tests.test_proxy import TOOLS, conversation, proxy, wait_for_events  # noqa: F401 (fixture)

RESTORE = restore_tool()
# conversation(words=10): twelve results of 114 tokens; at B = 1,200 with the prose share off
# (STUBS) nothing is folded and r1-r7 at least leave stubs (r7 is omitted: U 0.33 against r8's
# 0.40). Under the default prose share the oldest turns fold away, and a folded result has no stub
# to name its handle.
B = 1200
STUBS = {"prose_share": 1.0, "condense": False}


def restore_call(call_id: str, handle: str) -> dict:
    return call(call_id, RESTORE_TOOL, {"handle": handle})


def result_text(messages: list[dict], call_id: str) -> str:
    return next(m["content"] for m in messages if m.get("tool_call_id") == call_id)


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0)


def restored_edges(engine, session_id: str) -> int:
    return [e["kind"] for e in engine.export_graph(session_id)["edges"]].count("Restored")


def stub_handles(messages: list[dict]) -> dict[str, str]:
    """Call id -> the handle its stub names, for every stub in a forwarded request."""
    out = {}
    for m in messages:
        if m.get("role") == "tool" and m["content"].startswith("[ContextRender: this"):
            out[m["tool_call_id"]] = m["content"].rsplit('handle "', 1)[1].split('"')[0]
    return out


# ---------------------------------------------------------------- the round, not streamed and streamed


def test_a_restore_round_answers_from_the_store_and_the_agent_gets_only_the_final_answer(engine, upstream, proxy):
    messages = conversation(words=10)
    engine.configure("run", policy="per-call", **STUBS)  # r3 (call_2) would be folded by a re-render's headroom
    upstream.enqueue(content=None, tool_calls=[restore_call("call_restore_1", "r3")])
    upstream.enqueue(content="The failing line is line_2_7.")
    with proxy(budget=B) as server:
        raw = sdk(server).chat.completions.with_raw_response.create(
            model="m", messages=messages, tools=TOOLS, extra_headers={SESSION_HEADER: "run"})
        answer = raw.parse()
        wait_for_events(engine, "run", len(messages))
    # The agent: one ordinary answer, the upstream's last answer byte for byte.
    assert answer.choices[0].message.content == "The failing line is line_2_7."
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"
    assert raw.http_response.content == upstream.requests[-1].sent
    assert raw.headers[RESTORE_ROUNDS_HEADER] == "1"
    assert json.loads(raw.headers[RESTORE_USAGE_HEADER]) == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    # The upstream: the stub named r3 (call_2); the restore tool offered after the agent's tools;
    # the second request is the first plus the round, with the complete original result.
    (first, second) = [r.json for r in upstream.requests]
    assert stub_handles(first["messages"])["call_2"] == "r3"
    assert first["tools"] == TOOLS + [RESTORE] and second["tools"] == TOOLS + [RESTORE]
    assert second["messages"][:-2] == first["messages"]
    assert second["messages"][-2] == {"role": "assistant", "content": None, "tool_calls": [restore_call("call_restore_1", "r3")]}
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "call_restore_1", "content": result_text(messages, "call_2")}
    # The graph records the restore; the session stores the agent's history only (no round).
    assert restored_edges(engine, "run") == 1 and engine.get_session("run")["restores"] == 1
    session = engine.get_session("run", include_messages=True)
    assert session["messages"] == messages + [{"role": "assistant", "content": "The failing line is line_2_7."}]
    # The session's usage counts both model calls of the request (the fake reports 1 + 1 each).
    assert (session["usage"]["requests"], session["usage"]["input_tokens"], session["usage"]["output_tokens"]) == (1, 2, 2)


def test_a_streamed_restore_round_streams_only_the_final_answer(engine, upstream, proxy):
    messages = conversation(words=10)
    with proxy(budget=B) as server:
        # Raw bytes first: the agent receives exactly the final answer's bytes.
        upstream.enqueue(content=None, tool_calls=[restore_call("call_r1", "r2")])
        upstream.enqueue(content="Streamed after the restore.", tool_calls=[call("call_next", "read_file", {"path": "fix.py"})])
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={SESSION_HEADER: "stream"},
                          json={"model": "m", "messages": messages, "tools": TOOLS, "stream": True}) as response:
            received = b"".join(response.iter_raw())
            assert response.headers[RESTORE_ROUNDS_HEADER] == "1"
        assert received == upstream.requests[-1].sent
        assert upstream.requests[-1].json["messages"][-1]["content"] == result_text(messages, "call_1")
        wait_for_events(engine, "stream", len(messages))
        # The SDK parses the stream: the final answer, its call, no restore call.
        upstream.enqueue(content=None, tool_calls=[restore_call("call_r2", "r4")])
        upstream.enqueue(content="Parsed by the SDK.", tool_calls=[call("call_sdk", "read_file", {"path": "b.py"})])
        follow = messages + [assistant("Streamed after the restore.", call("call_next", "read_file", {"path": "fix.py"})),
                             tool("call_next", "def fix(): pass")]
        with sdk(server).chat.completions.stream(model="m", messages=follow, tools=TOOLS,
                                                 extra_headers={SESSION_HEADER: "stream"}) as stream:
            final = stream.get_final_completion()
        wait_for_events(engine, "stream", len(follow))
    message = final.choices[0].message
    assert message.content == "Parsed by the SDK."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("call_sdk", "read_file", {"path": "b.py"})]
    assert upstream.requests[-1].json["messages"][-1]["content"] == result_text(messages, "call_3")
    assert restored_edges(engine, "stream") == 2
    # Stored: the agent's history and the answers as the agent got them; the follow-up did not fork.
    answered = follow + [assistant("Parsed by the SDK.", call("call_sdk", "read_file", {"path": "b.py"}))]
    assert engine.ingest("stream", answered).forked_at == -1 and engine.ingest("stream", answered).added == 0


def test_text_streamed_before_a_restore_call_is_continued_by_the_next_answer(engine, upstream, proxy):
    messages = conversation(words=10)
    upstream.enqueue(content="Let me look at that output again. ", tool_calls=[restore_call("call_r", "r5")])
    upstream.enqueue(content="It says value_4_3.")
    with proxy(budget=B) as server:
        with sdk(server).chat.completions.stream(model="m", messages=messages, tools=TOOLS,
                                                 extra_headers={SESSION_HEADER: "text-first"}) as stream:
            final = stream.get_final_completion()
        wait_for_events(engine, "text-first", len(messages))
    # The text had reached the agent before the restore call showed: the answer continues it.
    assert final.choices[0].message.content == "Let me look at that output again. It says value_4_3."
    assert not final.choices[0].message.tool_calls
    round_call = upstream.requests[-1].json["messages"][-2]
    assert round_call["content"] == "Let me look at that output again. " and round_call["tool_calls"][0]["id"] == "call_r"
    stored = engine.get_session("text-first", include_messages=True)["messages"][-1]
    assert stored == {"role": "assistant", "content": "Let me look at that output again. It says value_4_3."}


def test_a_query_call_is_answered_with_matching_handles_then_restored_by_handle(engine, upstream, proxy):
    # The defaults: the oldest turns fold, and the fold index names their results (by handle).
    messages = conversation(words=10)
    upstream.enqueue(content=None, tool_calls=[call("call_q", RESTORE_TOOL, {"query": "value_2_7"})])
    upstream.enqueue(content=None, tool_calls=[restore_call("call_h", "r3")])
    upstream.enqueue(content="Found it: value_2_7.")
    with proxy(budget=B) as server:
        raw = sdk(server).chat.completions.with_raw_response.create(
            model="m", messages=messages, tools=TOOLS, extra_headers={SESSION_HEADER: "query"})
        answer = raw.parse()
        wait_for_events(engine, "query", len(messages))
    assert answer.choices[0].message.content == "Found it: value_2_7." and raw.headers[RESTORE_ROUNDS_HEADER] == "2"
    (first, second, third) = [r.json for r in upstream.requests]
    assert any(FOLD_INDEX_HEADING in str(m.get("content")) for m in first["messages"])  # names the query form
    # The search's answer: the one result holding the value (call_2's, r3), one line, then how to restore.
    searched = second["messages"][-1]
    assert searched["tool_call_id"] == "call_q"
    lines = searched["content"].splitlines()
    assert len(lines) == 3 and lines[1].startswith("r3 read_file (src/file_2.py): ") and "value_2_7" in lines[1]
    assert third["messages"][-1] == {"role": "tool", "tool_call_id": "call_h", "content": result_text(messages, "call_2")}
    # Only the handle's restore is recorded; the search wrote nothing.
    assert restored_edges(engine, "query") == 1 and engine.get_session("query")["restores"] == 1


def test_every_protocol_reads_a_handle_or_a_query_from_a_restore_call():
    from contextrender.proxy.messages.restore import MESSAGES_ROUNDS
    from contextrender.proxy.responses.restore import RESPONSES_ROUNDS
    from contextrender.proxy.chat.restore import CHAT_ROUNDS

    def shapes(arguments: dict) -> list:
        return [(CHAT_ROUNDS, call("c", RESTORE_TOOL, arguments)), (MESSAGES_ROUNDS, {"type": "tool_use", "input": arguments}),
                (RESPONSES_ROUNDS, {"type": "function_call", "arguments": json.dumps(arguments)})]

    for (rounds, given) in shapes({"query": " ledger.py "}):
        assert rounds.ask(given) == ("query", "ledger.py")
    for (rounds, given) in shapes({"handle": "r3", "query": "ledger.py"}):
        assert rounds.ask(given) == ("handle", "r3")
    for (rounds, given) in shapes({"query": ""}):
        with pytest.raises(ValueError, match='a string "handle".*or a "query"'):
            rounds.ask(given)


def test_the_fake_model_restores_the_handle_a_stub_names_else_the_fold_indexs_first():
    """The scripted model (contextrender.testing.fake_upstream) reads a request as a model would:
    the handles its stubs name, then those its fold index names (engine/notices.jac writes both),
    and none where the request does not offer the tool."""
    from contextrender.testing.fake_upstream import named_handles

    entries = [index_entry("r2", json.dumps({"path": "src/r9.py"}), 16), index_entry("r5", json.dumps({"id": "r8"}), 16)]
    marker = fold_marker(600, [handles_line("bash", ["r7"]), handles_line("read_file", entries)], 3)
    (opening, index) = marker_messages(marker, True)
    stub = tool("c9", stub_text("read_file", 400, "r9"))
    assert named_handles({"messages": [user("Fix it."), opening, index, stub]}) == ["r9", "r7", "r2", "r5"]
    assert named_handles({"messages": [opening, index]}) == ["r7", "r2", "r5"]
    assert named_handles({"messages": [opening]}) == []
    stored = {"role": "user", "content": without_restore_tool(index["content"])}
    assert named_handles({"messages": [opening, stored]}) == []


# ---------------------------------------------------------------- failures and limits


def test_an_unknown_or_malformed_handle_gets_a_tool_error_and_nothing_is_written(engine, upstream, proxy):
    messages = conversation(words=10)
    upstream.enqueue(content=None, tool_calls=[restore_call("call_a", "r999"), call("call_b", RESTORE_TOOL, "not json")])
    upstream.enqueue(content="Going on without it.")
    with proxy(budget=B) as server:
        answer = sdk(server).chat.completions.create(model="m", messages=messages, extra_headers={SESSION_HEADER: "bad"})
        wait_for_events(engine, "bad", len(messages))
    assert answer.choices[0].message.content == "Going on without it."
    (unknown, malformed) = upstream.requests[-1].json["messages"][-2:]
    assert unknown["tool_call_id"] == "call_a" and "could not restore r999" in unknown["content"]
    assert "no tool result 'r999'" in unknown["content"] and unknown["content"].endswith("Continue without it.]")
    assert malformed["tool_call_id"] == "call_b" and 'a string "handle"' in malformed["content"]
    assert restored_edges(engine, "bad") == 0 and engine.get_session("bad")["restores"] == 0


class RestoreFails:
    """The engine, except that restores fail (the server went away between two calls)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def restore(self, *args, **kwargs):
        raise ConnectionError("server unreachable")


def test_a_failing_backend_is_a_tool_error_not_a_crash(engine, upstream):
    upstream.enqueue(content=None, tool_calls=[restore_call("call_a", "r1")])
    upstream.enqueue(content="Fine.")
    with LoopbackServer(create_app(RestoreFails(engine), upstream.base_url, B)) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": conversation(words=10)})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "Fine."
    assert "server unreachable" in upstream.requests[-1].json["messages"][-1]["content"]


def test_after_the_last_round_the_tool_is_withdrawn(engine, upstream, proxy):
    messages = conversation(words=10)
    upstream.enqueue(content=None, tool_calls=[restore_call("call_1", "r1")])
    upstream.enqueue(content=None, tool_calls=[restore_call("call_2", "r2")])
    # Without the tool the model still calls it, beside a call of the agent's: only the latter is shown.
    upstream.enqueue(content=None, tool_calls=[restore_call("call_3", "r3"), call("call_x", "read_file", {"path": "x.py"})])
    with proxy(budget=B, restore_rounds=2) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages, "tools": TOOLS})
    assert [r.json.get("tools") for r in upstream.requests] == [TOOLS + [RESTORE], TOOLS + [RESTORE], TOOLS]
    assert response.headers[RESTORE_ROUNDS_HEADER] == "2"
    message = response.json()["choices"][0]["message"]
    assert [c["id"] for c in message["tool_calls"]] == ["call_x"]
    assert restored_edges(engine, derive(messages)) == 2
    # A request without tools of its own gets none in the last call either.
    upstream.enqueue(content=None, tool_calls=[restore_call("call_4", "r4")])
    upstream.enqueue(content="Done.")
    with proxy(budget=B, restore_rounds=1) as server:
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages})
    assert "tools" not in upstream.requests[-1].json and upstream.requests[-2].json["tools"] == [RESTORE]


def derive(messages: list[dict]) -> str:
    from contextrender.proxy import derive_session

    return derive_session(messages)


def test_an_upstream_failure_in_a_round_reaches_the_agent(engine, upstream, proxy):
    upstream.enqueue(content=None, tool_calls=[restore_call("call_1", "r1")])
    upstream.enqueue(status=429)
    with proxy(budget=B) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": conversation(words=10)})
    assert response.status_code == 429 and response.json()["error"]["message"] == "scripted failure"
    assert response.headers[RESTORE_ROUNDS_HEADER] == "1"


def test_a_tool_of_the_reserved_name_is_refused_before_anything_is_stored(engine, upstream, proxy):
    mine = {"type": "function", "function": {"name": RESTORE_TOOL, "parameters": {"type": "object", "properties": {}}}}
    body = {"model": "m", "messages": conversation(results=1, words=5), "tools": TOOLS + [mine]}
    with proxy(budget=B) as server:
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "contextrender_reserved_tool_name" and error["param"] == "tools"
    assert "Rename your tool" in error["message"] and "--restore-rounds 0" in error["message"]
    assert upstream.requests == [] and engine.list_sessions() == []
    # With restores off the name is the agent's: forwarded as sent, nothing added, and no stub
    # tells the model to call it.
    body["messages"] = conversation(words=10)
    engine.configure("off", policy="per-call", **STUBS)
    with proxy(budget=B, restore_rounds=0) as server:
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={SESSION_HEADER: "off"}).status_code == 200
    assert upstream.requests[-1].json["tools"] == TOOLS + [mine]
    assert "omitted to fit" in json.dumps(upstream.requests[-1].json["messages"])
    assert RESTORE_TOOL not in json.dumps(upstream.requests[-1].json["messages"])


@pytest.mark.parametrize("extra, messages", [
    ({"tool_choice": "none"}, conversation(words=10)),
    ({"n": 2}, conversation(words=10)),
    ({}, conversation(results=2, words=5)),  # nothing omitted
])
def test_the_tool_is_offered_only_when_it_can_serve(engine, upstream, proxy, extra, messages):
    engine.configure("served", policy="per-call", **STUBS)
    with proxy(budget=B) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages, "tools": TOOLS} | extra,
                              headers={SESSION_HEADER: "served"})
    assert upstream.requests[-1].json["tools"] == TOOLS and RESTORE_ROUNDS_HEADER not in response.headers
    # No text names the tool the request is not given; the stubs name their handles still.
    forwarded = json.dumps(upstream.requests[-1].json["messages"])
    assert RESTORE_TOOL not in forwarded
    assert ('It is stored as \\"r' in forwarded) == ("omitted to fit" in forwarded)


# ---------------------------------------------------------------- answers that mix restore calls with the agent's


def test_a_restore_call_first_is_a_round_and_the_agents_calls_are_decided_again(engine, upstream, proxy):
    upstream.enqueue(content=None, tool_calls=[restore_call("call_r", "r1"), call("call_early", "read_file", {"path": "a.py"})])
    upstream.enqueue(content=None, tool_calls=[call("call_late", "read_file", {"path": "b.py"})])
    with proxy(budget=B) as server:
        answer = sdk(server).chat.completions.create(model="m", messages=conversation(words=10), tools=TOOLS)
    assert [c.id for c in answer.choices[0].message.tool_calls] == ["call_late"]
    round_call = upstream.requests[-1].json["messages"][-2]
    assert [c["id"] for c in round_call["tool_calls"]] == ["call_r"]  # the early call is not sent back unanswered


@pytest.mark.parametrize("stream", [False, True])
def test_an_agent_call_first_goes_to_the_agent_without_the_restore_calls(engine, upstream, proxy, stream):
    calls = [call("call_a", "read_file", {"path": "a.py"}), restore_call("call_r", "r1"), call("call_b", "read_file", {"path": "b.py"})]
    upstream.enqueue(content="Reading two files.", tool_calls=calls)
    with proxy(budget=B) as server:
        client = sdk(server)
        if stream:
            with client.chat.completions.stream(model="m", messages=conversation(words=10), tools=TOOLS) as events:
                answer = events.get_final_completion()
        else:
            answer = client.chat.completions.create(model="m", messages=conversation(words=10), tools=TOOLS)
    message = answer.choices[0].message
    assert message.content == "Reading two files."
    assert [(c.id, json.loads(c.function.arguments)) for c in message.tool_calls] == [("call_a", {"path": "a.py"}), ("call_b", {"path": "b.py"})]
    assert len(upstream.requests) == 1 and restored_edges(engine, derive(conversation(words=10))) == 0


# ---------------------------------------------------------------- the signal


def test_a_restored_result_is_kept_at_the_next_render(engine, upstream, proxy):
    messages = conversation(words=10)
    engine.configure("kept", **STUBS)
    upstream.enqueue(content=None, tool_calls=[restore_call("call_r", "r7")])
    upstream.enqueue(content="Here is the fix.")
    with proxy(budget=B) as server:
        headers = {SESSION_HEADER: "kept"}
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages}, headers=headers)
        assert stub_handles(upstream.requests[0].json["messages"])["call_6"] == "r7"
        wait_for_events(engine, "kept", len(messages))
        follow = messages + [{"role": "assistant", "content": "Here is the fix."}, user("Thanks, go on.")]
        httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": follow}, headers=headers)
    shown = upstream.requests[-1].json["messages"]
    assert "call_6" not in stub_handles(shown) and result_text(shown, "call_6") == result_text(messages, "call_6")
    decisions = {d.handle: d for d in engine.explain("kept").decisions}
    assert decisions["r7"].status == "kept" and decisions["r7"].restores == 1


# ---------------------------------------------------------------- reading a stream


def frames(*deltas: dict, finish: str = "tool_calls") -> list[bytes]:
    chunk = lambda delta, reason=None: {"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}  # noqa: E731
    out = [f"data: {json.dumps(chunk(d))}\n\n".encode() for d in deltas]
    return out + [f"data: {json.dumps(chunk({}, finish))}\n\n".encode(), b"data: [DONE]\n\n"]


def part(index: int, name: str | None = None, arguments: str = "", call_id: str | None = None) -> dict:
    function = {"arguments": arguments} | ({"name": name} if name else {})
    return {"tool_calls": [{"index": index, "function": function} | ({"id": call_id, "type": "function"} if call_id else {})]}


def relay(stream: list[bytes], may_restore: bool = True, step: int | None = None) -> tuple[list[bytes], StreamRound]:
    reader = StreamRound(may_restore=may_restore)
    data = b"".join(stream)
    pieces = [data[i:i + step] for i in range(0, len(data), step)] if step else stream
    out = [f for piece in pieces for f in reader.feed(piece)] + reader.close()
    return out, reader


def test_text_is_relayed_at_once_and_the_role_frame_only_waits_for_it():
    stream = frames({"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, finish="stop")
    reader = StreamRound(may_restore=True)
    assert reader.feed(stream[0]) == []  # a role alone: the answer may still open with a restore call
    assert reader.feed(stream[1]) == stream[:2]
    assert reader.feed(stream[2]) == [stream[2]]
    assert [f for piece in stream[3:] for f in reader.feed(piece)] + reader.close() == stream[3:]
    assert not reader.restore_round and reader.answer().content == "Hello"


@pytest.mark.parametrize("step", [None, 1, 7])
def test_a_restore_answer_is_held_whole_however_the_bytes_are_cut(step):
    stream = frames({"role": "assistant", "content": ""}, part(0, RESTORE_TOOL, "", "call_r"), part(0, None, '{"handle":'), part(0, None, ' "r4"}'))
    (out, reader) = relay(stream, step=step)
    assert out == [] and reader.restore_round
    answer = reader.answer()
    assert answer.restore_first and [c["function"]["arguments"] for c in answer.restore_calls] == ['{"handle": "r4"}']


def test_restore_parts_are_withheld_and_later_calls_renumbered():
    stream = frames(part(0, "read_file", '{"path": "a"}', "call_a"), part(1, RESTORE_TOOL, '{"handle": "r1"}', "call_r"),
                    part(2, "read_file", '{"path": "b"}', "call_b"))
    (out, reader) = relay(stream, step=5)
    shown = [json.loads(f[6:]) for f in out if f.startswith(b"data: {")]
    parts = [p for chunk in shown for p in chunk["choices"][0]["delta"].get("tool_calls", [])]
    assert [(p["index"], p["id"]) for p in parts] == [(0, "call_a"), (1, "call_b")]
    assert out[0] == stream[0] and out[-1] == stream[-1] and not reader.restore_round
    # Without the tool offered, a lone restore call is withheld and the answer ends as text.
    (out, _) = relay(frames({"content": "Ok."}, part(0, RESTORE_TOOL, '{"handle": "r1"}', "call_r")), may_restore=False)
    finish = json.loads(out[-2][6:])["choices"][0]
    assert finish["finish_reason"] == "stop" and len(out) == 3


def test_crlf_separated_events_are_read_too():
    stream = [f.replace(b"\n\n", b"\r\n\r\n") for f in frames(part(0, RESTORE_TOOL, '{"handle": "r2"}', "call_r"))]
    (out, reader) = relay(stream, step=3)
    assert out == [] and reader.restore_round and reader.answer().restore_calls[0]["id"] == "call_r"


def test_restore_rounds_with_a_server_backend(jac_server, upstream):
    """`--server`: the round's restore goes through the client to a running `jac start` server."""
    from contextrender.client import Client

    client = Client(jac_server.url)
    client.register("restore-proxy-user", "secret-password-1")
    messages = conversation(words=10)
    upstream.enqueue(content=None, tool_calls=[restore_call("call_a", "r2"), restore_call("call_b", "r77")])
    upstream.enqueue(content="Found it.")
    with LoopbackServer(create_app(client, upstream.base_url, B)) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages},
                              headers={SESSION_HEADER: "via-server"})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "Found it."
    (found, unknown) = upstream.requests[-1].json["messages"][-2:]
    assert found["content"] == result_text(messages, "call_1")
    assert "no tool result 'r77'" in unknown["content"]
    assert client.get_session("via-server")["restores"] == 1


@pytest.mark.parametrize("options, extra", [({}, {"tool_choice": "none"}), ({"restore_rounds": 0}, {})])
def test_no_text_names_the_tool_where_it_is_not_offered_folded_history_included(engine, upstream, proxy, options, extra):
    """Under the default prose share the oldest turns fold (B = 1,200): whatever the fold marker
    and the stubs say, a request not given the tool reads no text that names it."""
    messages = conversation(words=10)
    with proxy(budget=B, **options) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "messages": messages, "tools": TOOLS} | extra)
    assert response.status_code == 200 and int(response.headers["x-contextrender-folded"]) > 0
    sent = upstream.requests[-1].json
    assert sent["tools"] == TOOLS and RESTORE_TOOL not in json.dumps(sent["messages"])


@pytest.mark.parametrize("stream", [False, True])
def test_the_rendered_body_is_encoded_once_an_upstream_call(engine, upstream, proxy, monkeypatch, stream):
    # The body of the first upstream call is encoded where the request was rendered (its nesting
    # checked there: a 400 when it is too deep), not encoded once for the check and again to send.
    encoded: list = []
    real = json.dumps

    def counting(value, *args, **kwargs):
        if isinstance(value, dict) and "model" in value and "messages" in value:
            encoded.append(value)
        return real(value, *args, **kwargs)

    messages = conversation(words=10)
    engine.configure("run", policy="per-call", **STUBS)
    upstream.enqueue(content=None, tool_calls=[restore_call("call_restore_1", "r3")])
    upstream.enqueue(content="The failing line is line_2_7.")
    def counting_body(value, kept):  # the first call's body: its history's texts kept for the next
        encoded.append(value)
        return real_body(value, kept)

    real_body = restores_module.encoded_body
    body = json.dumps({"model": "m", "messages": messages, "tools": TOOLS, "stream": stream}).encode()
    with proxy(budget=B) as server:
        monkeypatch.setattr(json, "dumps", counting)
        monkeypatch.setattr(restores_module, "encoded_body", counting_body)
        response = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={SESSION_HEADER: "run"}, timeout=60)
        monkeypatch.undo()
        assert response.status_code == 200 and response.headers[RESTORE_ROUNDS_HEADER] == "1"
    (first, second) = [r.json for r in upstream.requests]
    assert first["tools"] == TOOLS + [RESTORE] and second["messages"][:-2] == first["messages"]
    assert encoded == [first, second]


def test_a_rendered_body_too_deep_to_encode_is_a_400_with_the_tool_offered(upstream):
    # Its nesting is checked where the first upstream call's body is encoded: nothing is sent.
    from types import SimpleNamespace

    deep: list = []
    for _ in range(5000):
        deep = [deep]

    class Deep:
        def render(self, session_id, messages, **params):
            kept = messages[:-1] + [dict(messages[-1], deep=deep)]
            return SimpleNamespace(messages=kept, full_history_tokens=900, history_tokens=100, kept=len(kept), omitted=1,
                                   folded_messages=0, compacted=0, mode="stable")

        def get_session(self, session_id):
            return {"events": 0, "config": {"encoding": "o200k_base"}}

    with LoopbackServer(create_app(Deep(), upstream.base_url, B)) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", headers={SESSION_HEADER: "deep"},
                              json={"model": "m", "messages": conversation(words=10), "tools": TOOLS})
    assert response.status_code == 400 and "nested too deeply" in response.text
    assert upstream.requests == []
