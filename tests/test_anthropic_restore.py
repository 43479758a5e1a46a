"""Restore rounds on Anthropic Messages (adapters/proxy/messages/restore.py) end to end: the pinned
`anthropic` SDK through the proxy, the fake upstream as a model that calls the restore tool with
the handle its stub names, plain and streamed."""

from __future__ import annotations

import copy
import json

import anthropic
import httpx
import pytest

from contextrender.proxy.messages.restore import tool_definition
from contextrender.testing.fake_upstream import LoopbackServer, named_handles, signature
from contextrender.proxy import RESTORE_ROUNDS_HEADER, RESTORE_USAGE_HEADER, SESSION_HEADER, create_app
from contextrender.proxy.chat.restore import RESTORE_TOOL
from tests.conftest import anthropic_conversation, call
from tests.proxy_fixtures import proxy_url_at
from tests.test_anthropic import sdk
from tests.test_proxy import conversation, wait_for_events, wait_for_usage
from tests.test_restore_loop import B, STUBS, restored_edges

MODEL = "claude-sonnet-4-5"
TOOLS = [{"name": "read_file", "description": "Read a file.", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
EPHEMERAL = {"type": "ephemeral"}


def request() -> tuple[list[dict], list[dict]]:
    """conversation(words=10) as Claude Code sends it, with breakpoints on the system prompt and
    the last user turn; without thinking in the history (its prose would fold the turns whose
    stubs name the handles, not stub them: B = 1,200), the answers think."""
    (system, turns) = anthropic_conversation(conversation(words=10), thinking=False)
    system[-1]["cache_control"] = EPHEMERAL
    turns[-1]["content"][-1]["cache_control"] = EPHEMERAL
    return system, turns


def result_of(turns: list[dict], handle_call: str) -> object:
    return next(b["content"] for t in turns if isinstance(t["content"], list) for b in t["content"]
                if b.get("type") == "tool_result" and b["tool_use_id"] == handle_call)


def stub_call(body: dict, handle: str) -> str:
    """The tool_use id of the stub that names `handle` in a forwarded request."""
    return next(b["tool_use_id"] for t in body["messages"] if isinstance(t["content"], list) for b in t["content"]
                if b.get("type") == "tool_result" and isinstance(b.get("content"), str) and f'handle "{handle}"' in b["content"])


proxy_url = proxy_url_at(B)


def test_a_restore_round_on_messages_returns_one_ordinary_answer(engine, upstream, proxy_url):
    (system, turns) = request()
    engine.configure("claude", policy="per-call", **STUBS)
    upstream.enqueue_restore(thinking="The third file's output matters here.")
    upstream.enqueue(content="The failing line is line_2_7.")
    raw = sdk(proxy_url).messages.with_raw_response.create(
        model=MODEL, max_tokens=512, system=system, messages=turns, tools=TOOLS, extra_headers={SESSION_HEADER: "claude"})
    answer = raw.parse()
    wait_for_events(engine, "claude", 1)
    # The agent: the model's last answer, byte for byte; one round taken.
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == "The failing line is line_2_7."
    assert answer.stop_reason == "end_turn" and raw.http_response.content == upstream.requests[-1].sent
    assert raw.headers[RESTORE_ROUNDS_HEADER] == "1"
    (first, second) = [r.json for r in upstream.requests]
    # The tool is offered after the agent's, and the model called the handle its stub names.
    assert first["tools"] == TOOLS + [tool_definition()] and second["tools"] == first["tools"]
    handle = named_handles(first)[0]
    called = json.loads(upstream.requests[0].sent)["content"]
    assert [b["type"] for b in called] == ["thinking", "tool_use"] and called[1]["input"] == {"handle": handle}
    # The round: the answer as the model sent it (thinking and signature unchanged), then the
    # stored result; everything before it, cache breakpoints included, as the first request.
    assert second["messages"][:-2] == first["messages"] and second["system"] == first["system"] == system
    assert second["messages"][-2] == {"role": "assistant", "content": called}
    assert called[0]["signature"] == signature("The third file's output matters here.")
    assert second["messages"][-1] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": called[1]["id"], "content": result_of(turns, stub_call(first, handle))}]}
    assert second["messages"][-3]["content"][-1]["cache_control"] == EPHEMERAL
    # The store: the restore recorded, usage of both calls (the fake counts request bytes / 4).
    assert restored_edges(engine, "claude") == 1
    usage = wait_for_usage(engine, "claude", 1)
    assert usage["requests"] == 1 and usage["input_tokens"] == sum(len(r.body) // 4 for r in upstream.requests)
    assert usage["output_tokens"] == 14
    # The proxy's estimate counts both calls too (the second is the first plus the round, counted
    # in normal form): of the size of their reported input (request bytes / 4).
    ratio = usage["estimated_input_tokens"] / (usage["input_tokens"] or 1)
    assert 0.5 < ratio < 2.0, usage
    assert json.loads(raw.headers[RESTORE_USAGE_HEADER])["input_tokens"] == len(upstream.requests[0].body) // 4


def test_a_streamed_restore_round_on_messages(engine, upstream, proxy_url):
    (system, turns) = request()
    engine.configure("claude-stream", policy="per-call", **STUBS)
    upstream.enqueue_restore(thinking="I need that output again.")
    upstream.enqueue(content="Reading the fix.", thinking="Now I know the line.", tool_calls=[call("toolu_next", "read_file", {"path": "fix.py"})])
    with sdk(proxy_url).messages.stream(model=MODEL, max_tokens=512, system=system, messages=turns, tools=TOOLS,
                                        extra_headers={SESSION_HEADER: "claude-stream"}) as stream:
        final = stream.get_final_message()
    wait_for_events(engine, "claude-stream", 1)
    # The agent got the second answer only: its thinking (signed), text and call; no restore call.
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].signature == signature("Now I know the line.") and final.stop_reason == "tool_use"
    assert (final.content[2].id, final.content[2].input) == ("toolu_next", {"path": "fix.py"})
    (first, second) = [r.json for r in upstream.requests]
    handle = named_handles(first)[0]
    (thinking, restore) = second["messages"][-2]["content"]
    assert thinking == {"type": "thinking", "thinking": "I need that output again.", "signature": signature("I need that output again.")}
    assert (restore["name"], restore["input"]) == (RESTORE_TOOL, {"handle": handle})
    assert second["messages"][-1]["content"][0]["content"] == result_of(turns, stub_call(first, handle))
    # Stored as the agent got it: its echo in the next request does not fork the session.
    assert restored_edges(engine, "claude-stream") == 1
    echo = turns + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_next", "content": "def fix(): pass"}]}]
    upstream.enqueue(content="Done.")
    sdk(proxy_url).messages.create(model=MODEL, max_tokens=512, system=system, messages=echo, tools=TOOLS,
                                   extra_headers={SESSION_HEADER: "claude-stream"})
    assert [s["branch"] for s in engine.list_sessions() if s["session_id"] == "claude-stream"] == [0]


def test_text_streamed_before_a_restore_call_is_continued(engine, upstream, proxy_url):
    (system, turns) = request()
    engine.configure("claude-text", policy="per-call", **STUBS)
    upstream.enqueue_restore(content="Let me look at that output again. ")
    upstream.enqueue(content="It says value_4_3.")
    with httpx.stream("POST", f"{proxy_url}/v1/messages", headers={SESSION_HEADER: "claude-text"},
                      json={"model": MODEL, "max_tokens": 512, "system": system, "messages": turns, "tools": TOOLS, "stream": True}) as response:
        received = b"".join(response.iter_bytes())
    assert received.count(b"event: message_start") == 1 and RESTORE_TOOL.encode() not in received
    engine.configure("claude-text-sdk", policy="per-call", **STUBS)
    upstream.enqueue_restore(content="Let me look at that output again. ")
    upstream.enqueue(content="It says value_4_3.")
    with sdk(proxy_url).messages.stream(model=MODEL, max_tokens=512, system=system, messages=turns, tools=TOOLS,
                                        extra_headers={SESSION_HEADER: "claude-text-sdk"}) as stream:
        final = stream.get_final_message()
    # One message: the text before the call, then the next answer's blocks numbered after it.
    assert [(b.type, b.text) for b in final.content] == [("text", "Let me look at that output again. "), ("text", "It says value_4_3.")]
    assert final.stop_reason == "end_turn"


def test_the_restore_tool_is_named_only_where_it_is_offered(engine, upstream):
    (system, turns) = request()
    for (options, extra) in [({}, {"tool_choice": {"type": "none"}}), ({}, {"tool_choice": {"type": "tool", "name": "read_file"}}),
                             ({"restore_rounds": 0}, {})]:
        session = f"claude-unoffered-{len(upstream.requests)}"
        engine.configure(session, policy="per-call", **STUBS)
        upstream.enqueue_restore()
        with LoopbackServer(create_app(engine, upstream.base_url, B, **options)) as server:
            answer = sdk(server.url).messages.create(model=MODEL, max_tokens=512, system=system, messages=copy.deepcopy(turns),
                                                     tools=TOOLS, extra_headers={SESSION_HEADER: session}, **extra)
        sent = upstream.requests[-1].json
        # No tool named that the request does not offer; the stubs still name their handles.
        assert sent["tools"] == TOOLS and RESTORE_TOOL not in json.dumps(sent)
        assert 'is omitted to fit the history budget. It is stored as \\"r' in json.dumps(sent)
        assert answer.content[0].text == "[fake model: cannot restore: no restore hint names a handle]"


def test_a_tool_of_the_reserved_name_is_refused_in_anthropic_shape(engine, upstream, proxy_url):
    (system, turns) = request()
    mine = {"name": RESTORE_TOOL, "input_schema": {"type": "object", "properties": {}}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        sdk(proxy_url).messages.create(model=MODEL, max_tokens=512, system=system, messages=turns, tools=TOOLS + [mine])
    assert "Rename your tool" in refused.value.body["error"]["message"] and upstream.requests == []


# ---------------------------------------------------------------- reading a stream


def events_of(upstream, blocks: list[dict]) -> list[bytes]:
    """The fake upstream's Messages events for an answer of these blocks."""
    message = {"id": "msg_x", "type": "message", "role": "assistant", "model": MODEL, "content": blocks,
               "stop_reason": "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn",
               "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 3}}
    return upstream._message_events(message)


def relayed(stream: list[bytes], may_restore: bool = True, step: int | None = None, carry: dict | None = None):
    from contextrender.proxy.messages.restore import StreamRound

    reader = StreamRound(may_restore, {} if carry is None else carry)
    data = b"".join(stream)
    pieces = [data[i:i + step] for i in range(0, len(data), step)] if step else stream
    out = [f for piece in pieces for f in reader.feed(piece)] + reader.close()
    return out, reader


def read_back(out: list[bytes]) -> list[dict]:
    from contextrender.proxy.messages.restore import MESSAGES_ROUNDS

    seen = MESSAGES_ROUNDS.fmt.reader()
    seen.feed(b"".join(out))
    return [dict(b) for b in seen._blocks.values()]


def restore_use(call_id: str, handle: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": RESTORE_TOOL, "input": {"handle": handle}}


@pytest.mark.parametrize("step", [None, 1, 9])
def test_a_restore_answer_is_held_whole_and_its_thinking_kept(upstream, step):
    thinking = {"type": "thinking", "thinking": "Which file?", "signature": signature("Which file?")}
    (out, reader) = relayed(events_of(upstream, [thinking, restore_use("toolu_r", "r4")]), step=step)
    assert out == [] and reader.restore_round
    answer = reader.answer()
    assert answer.restore_first and answer.parts[0] == thinking and answer.restore_calls[0]["input"] == {"handle": "r4"}


def test_an_agent_call_first_goes_through_with_the_restore_call_removed_and_blocks_renumbered(upstream):
    blocks = [{"type": "tool_use", "id": "toolu_a", "name": "read_file", "input": {"path": "a"}}, restore_use("toolu_r", "r1"),
              {"type": "tool_use", "id": "toolu_b", "name": "read_file", "input": {"path": "b"}}]
    (out, reader) = relayed(events_of(upstream, blocks), step=7)
    assert not reader.restore_round
    assert [(b["id"], b["input"]) for b in read_back(out)] == [("toolu_a", {"path": "a"}), ("toolu_b", {"path": "b"})]
    indices = [json.loads(f.split(b"data: ", 1)[1])["index"] for f in out if b'"content_block_start"' in f]
    assert indices == [0, 1]
    # Without the tool offered, a lone restore call is withheld and the answer ends as text.
    (out, reader) = relayed(events_of(upstream, [{"type": "text", "text": "Ok."}, restore_use("toolu_r", "r1")]), may_restore=False)
    assert [b["type"] for b in read_back(out)] == ["text"] and b'"stop_reason": "end_turn"' in b"".join(out)
