"""Restore rounds on OpenAI Responses (adapters/proxy/responses/restore.py) end to end: an OpenAI Agents
SDK run and the `openai` SDK through the proxy, the fake upstream as a model that calls the
restore tool with the handle its stub names, plain and streamed."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from contextrender.testing.fake_upstream import LoopbackServer, named_handles
from contextrender.proxy import RESTORE_ROUNDS_HEADER, SESSION_HEADER, create_app
from contextrender.proxy.responses.restore import tool_definition
from contextrender.proxy.chat.restore import RESTORE_TOOL
from tests.conftest import call, responses_input
from tests.proxy_fixtures import proxy_url_at
from tests.test_proxy import conversation, wait_for_usage
from tests.test_restore_loop import STUBS, restored_edges

MODEL = "gpt-5"
BUDGET = 3000
# conversation(words=10) as Responses input at this B, prose share off: ten results stubbed, none
# folded (at B = 1,200 its reasoning items fold most turns: no stub names their handles).
STUBBED = 2000


proxy_url = proxy_url_at(BUDGET)


def read_file_text(path: str) -> str:
    return "\n".join(f"{path}:{n}: value_{path}_{n} = compute_{n}()" for n in range(150))


def output_of(bodies: list[dict], call_id: str) -> str:
    """The complete output of `call_id` as the agent's read_file tool gave it (the forwarded
    requests may show it cut: a result of the newest step larger than what B leaves)."""
    called = next(i for body in bodies for i in body["input"] if i.get("type") == "function_call" and i["call_id"] == call_id)
    return read_file_text(json.loads(called["arguments"])["path"])


def stub_call(body: dict, handle: str) -> str:
    """The call whose output, a stub or cut, names `handle`."""
    return next(i["call_id"] for i in body["input"] if i.get("type") == "function_call_output" and f'handle "{handle}"' in i["output"])


def agents_run(upstream, proxy_url: str, streamed: bool):
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    @function_tool
    def read_file(path: str) -> str:
        """Read a file of the repository."""
        return read_file_text(path)

    for i in range(5):
        upstream.enqueue(content=None, thinking=f"Read file {i} next.", tool_calls=[call(f"call_agent_{i}", "read_file", {"path": f"src/m{i}.py"})])
    upstream.enqueue_restore(thinking="The first file had the value I need.")
    upstream.enqueue(content="The value is compute_7.")
    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="sk-test", max_retries=0))
    agent = Agent(name="reader", instructions="You read files for the user.", tools=[read_file], model=model)
    config = RunConfig(tracing_disabled=True)
    if not streamed:
        return Runner.run_sync(agent, "Read five files.", run_config=config)

    async def run():
        result = Runner.run_streamed(agent, "Read five files.", run_config=config)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(run())


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agents_run_restores_an_omitted_result(engine, upstream, proxy_url, streamed):
    result = agents_run(upstream, proxy_url, streamed)
    # The agent: one ordinary answer, no restore call in anything it got.
    assert result.final_output == "The value is compute_7."
    got = [item for response in result.raw_responses for item in response.output]
    assert not any(getattr(i, "name", None) == RESTORE_TOOL for i in got)
    bodies = [r.json for r in upstream.requests if r.path == "/v1/responses"]
    assert len(bodies) == 7 and len(result.raw_responses) == 6
    (asked, again) = bodies[-2:]
    # The 6th call offered the tool; the model called the handle a stub named; the 7th call is the
    # 6th plus the round: the answer's items as sent (its reasoning too), and the stored output.
    assert asked["tools"][-1] == tool_definition() and again["tools"] == asked["tools"]
    # Every call: the tool offered exactly when a stub names a handle for it.
    assert all((RESTORE_TOOL in json.dumps(b.get("tools", []))) == bool(named_handles(b)) for b in bodies)
    assert not named_handles(bodies[0])
    handle = named_handles(asked)[0]
    answered = json.loads(upstream.requests[-2].sent)["output"] if not streamed else None
    (reasoning, restore, output) = again["input"][len(asked["input"]):]
    assert again["input"][:len(asked["input"])] == asked["input"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"][0]["text"] == "The first file had the value I need."
    assert (restore["name"], json.loads(restore["arguments"])) == (RESTORE_TOOL, {"handle": handle})
    if answered is not None:
        assert [reasoning, restore] == answered
    assert output == {"type": "function_call_output", "call_id": restore["call_id"], "output": output_of(bodies, stub_call(asked, handle))}
    # The store: the restore, and the usage of both calls of the request (request bytes / 4 each).
    (session,) = engine.list_sessions()
    sid = session["session_id"]
    assert restored_edges(engine, sid) == 1
    usage = wait_for_usage(engine, sid, 6)
    assert usage["requests"] == 6 and usage["input_tokens"] == sum(len(r.body) // 4 for r in upstream.requests if r.path == "/v1/responses")


def test_text_streamed_before_a_restore_call_is_continued(engine, upstream):
    (instructions, items) = responses_input(conversation(words=10))
    engine.configure("text-first", policy="per-call", **STUBS)
    upstream.enqueue_restore(content="Let me look at that output again. ")
    upstream.enqueue(content="It says value_4_3.")
    with LoopbackServer(create_app(engine, upstream.base_url, STUBBED)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0)
        with client.responses.stream(model=MODEL, instructions=instructions, input=items,
                                     extra_headers={SESSION_HEADER: "text-first"}) as stream:
            events = list(stream)
            final = stream.get_final_response()
    # One response: the text before the call, then the next answer's items numbered after it.
    assert [i.content[0].text for i in final.output] == ["Let me look at that output again. ", "It says value_4_3."]
    assert final.output_text == "Let me look at that output again. It says value_4_3."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert sum(e.type == "response.created" for e in events) == 1 and final.id == events[0].response.id
    assert restored_edges(engine, "text-first") == 1


@pytest.mark.parametrize("options, extra", [({}, {"tool_choice": "none"}), ({"restore_rounds": 0}, {}),
                                            ({}, {"tool_choice": {"type": "function", "name": "read_file"}})])
def test_the_restore_tool_is_named_only_where_it_is_offered(engine, upstream, options, extra):
    (instructions, items) = responses_input(conversation(words=10))
    engine.configure("unoffered", policy="per-call", **STUBS)
    tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    upstream.enqueue_restore()
    with LoopbackServer(create_app(engine, upstream.base_url, STUBBED, **options)) as server:
        response = httpx.post(f"{server.url}/v1/responses", headers={SESSION_HEADER: "unoffered"},
                              json={"model": MODEL, "instructions": instructions, "input": items, "tools": tools} | extra)
    sent = upstream.requests[-1].json
    assert sent["tools"] == tools and RESTORE_TOOL not in json.dumps(sent) and RESTORE_ROUNDS_HEADER not in response.headers
    assert 'It is stored as \\"r' in json.dumps(sent)
    assert response.json()["output"][0]["content"][0]["text"] == "[fake model: cannot restore: no restore hint names a handle]"


def test_an_agent_call_first_is_relayed_without_the_restore_call(upstream):
    from contextrender.testing.fake_upstream import _Script
    from contextrender.proxy.responses.restore import StreamRound

    calls = [call("call_a", "read_file", {"path": "a"}), call("call_r", RESTORE_TOOL, {"handle": "r1"}), call("call_b", "read_file", {"path": "b"})]
    response = upstream._response(1, _Script(content=None, tool_calls=calls, thinking="Two files."), {"model": MODEL}, 400)
    stream = b"".join(upstream._response_events(response))
    reader = StreamRound(True, {})
    out = [f for i in range(0, len(stream), 11) for f in reader.feed(stream[i:i + 11])] + reader.close()
    assert not reader.restore_round
    events = [json.loads(f.split(b"data: ", 1)[1]) for f in out]
    assert RESTORE_TOOL not in json.dumps(events)
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "function_call"), (2, "function_call")]
    assert [i["call_id"] for i in events[-1]["response"]["output"] if i["type"] == "function_call"] == ["call_a", "call_b"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
