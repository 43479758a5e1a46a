"""The OpenAI Agents SDK filter (integrations/openai_agents) in real `Runner` runs: openai-agents
0.21.1, its Responses model talking to the fake upstream on loopback, an SDK `SQLiteSession`."""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, SQLiteSession, function_tool

from contextrender.client import Client
from contextrender.testing.fake_upstream import free_port, named_handles
from contextrender.proxy.responses.wire import to_normal
from contextrender.tools import RESTORE_TOOL, restored_text
from contextrender_integrations.openai_agents import ContextRender
from tests.conftest import call
from tests.integration_runs import BUDGET, READS, TOK, body, handles_of, script_reads, unnamed
from tests.test_responses import pairing


@function_tool
def read_file(path: str) -> str:
    """Read a file of the repository."""
    return body(path)


def history_tokens(request: dict) -> int:
    normal, _ = to_normal(request)
    rest = [m for m in normal if m["role"] not in ("system", "developer")]
    return TOK.history_tokens(rest[:-1] if rest and rest[-1]["role"] == "user" else rest)


def agent_for(upstream, context: ContextRender | None) -> Agent:
    model = OpenAIResponsesModel(model="fake-model", openai_client=openai.AsyncOpenAI(base_url=upstream.base_url, api_key="sk-test", max_retries=0))
    tools = [read_file] + ([context.restore_tool] if context else [])
    return Agent(name="reader", instructions="You read files for the user.", tools=tools, model=model)


def config(context: ContextRender, **options) -> RunConfig:
    return RunConfig(call_model_input_filter=context, tracing_disabled=True, **options)


def sent(upstream) -> list[dict]:
    return [r.json for r in upstream.requests if r.path == "/v1/responses"]


def test_every_model_call_sees_at_most_b_with_valid_pairing_and_a_restore_returns_the_result(engine, upstream):
    session = SQLiteSession("chat-1")
    context = ContextRender(engine, budget=BUDGET, conversation=session)
    agent = agent_for(upstream, context)
    script_reads(upstream, READS, narrate=False)
    upstream.enqueue(content="I read them all.")
    result = Runner.run_sync(agent, "Read the eight files.", session=session, run_config=config(context))
    assert result.final_output == "I read them all."
    requests = sent(upstream)
    assert len(requests) == READS + 1
    for request in requests:
        assert pairing(request["input"]) == []
        assert history_tokens(request) <= BUDGET
        assert RESTORE_TOOL in [t.get("name") for t in request["tools"]]
    stored = asyncio.run(session.get_items())  # the SDK's own history
    outputs = [i["output"] for i in stored if i.get("type") == "function_call_output"]
    assert outputs == [body(f"src/f{i}.py") for i in range(READS)]  # the SDK's session keeps them whole
    assert history_tokens({"instructions": None, "input": stored}) > 2 * BUDGET  # the budget forced omissions
    # The last call names each result it leaves out (a stub, or the fold index's entry).
    owners = handles_of(engine, "openai-agents-chat-1")
    originals = {i["call_id"]: i["output"] for i in stored if i.get("type") == "function_call_output"}
    handles = named_handles(requests[-1])
    assert handles and unnamed(requests[-1], originals, owners) == [], "the last call should name every result it leaves out"
    assert engine.get_session("openai-agents-chat-1")["events"] >= 2 * READS  # named by the SDK session's id

    handle = handles[0]
    original = restored_text(engine.restore("openai-agents-chat-1", handle))
    assert original == originals[next(c for (c, h) in owners.items() if h == handle)]
    upstream.enqueue(content=None, tool_calls=[call("call_restore", RESTORE_TOOL, {"handle": handle})])
    upstream.enqueue(content="Found it.")
    agent = agent_for(upstream, context)  # a new AsyncOpenAI client: run_sync runs each run in a new event loop
    result = Runner.run_sync(agent, "What was in that file?", session=session, run_config=config(context))
    assert result.final_output == "Found it."
    last = sent(upstream)[-1]
    answer = [i for i in last["input"] if i.get("type") == "function_call_output" and i["call_id"] == "call_restore"]
    assert answer and answer[0]["output"] == original
    assert pairing(last["input"]) == [] and history_tokens(last) <= BUDGET


@pytest.fixture
def local_traces():
    """Tracing on (the trace carries the group id) with no exporter: nothing leaves the machine."""
    from agents.tracing import set_trace_processors
    from agents.tracing.processors import default_processor

    set_trace_processors([])
    yield
    set_trace_processors([default_processor()])


def test_the_trace_group_id_names_the_session_when_no_conversation_is_given(engine, upstream, local_traces):
    context = ContextRender(engine, budget=BUDGET)
    agent = agent_for(upstream, context)
    script_reads(upstream, 2, narrate=False)
    upstream.enqueue(content="Two read.")
    result = Runner.run_sync(agent, "Read two files.", run_config=RunConfig(call_model_input_filter=context, group_id="thread-9"))
    assert result.final_output == "Two read."
    assert engine.get_session("openai-agents-thread-9")["events"] >= 4


def test_contextrender_down_the_run_completes_with_the_sdks_own_input(upstream, caplog):
    context = ContextRender(Client(f"http://127.0.0.1:{free_port()}", timeout=2), budget=BUDGET, conversation="down-1")
    agent = agent_for(upstream, context)
    script_reads(upstream, 3, narrate=False)
    upstream.enqueue(content="Finished without ContextRender.")
    with caplog.at_level(logging.WARNING, logger="contextrender.openai_agents"):
        result = Runner.run_sync(agent, "Read three files.", run_config=config(context))
    assert result.final_output == "Finished without ContextRender."
    last = sent(upstream)[-1]["input"]
    assert [i["output"] for i in last if i.get("type") == "function_call_output"] == [body(f"src/f{i}.py") for i in range(3)]
    assert sum("model input sent unchanged (ServerUnavailable" in r.getMessage() for r in caplog.records) == 4


def test_a_run_that_names_no_conversation_goes_unchanged_and_says_why(upstream, engine, caplog):
    context = ContextRender(engine, budget=BUDGET)
    agent = agent_for(upstream, context)
    upstream.enqueue(content="Hello.")
    with caplog.at_level(logging.WARNING, logger="contextrender.openai_agents"):
        assert Runner.run_sync(agent, "Hi.", run_config=config(context)).final_output == "Hello."
    assert any("no conversation id" in r.getMessage() for r in caplog.records)
    assert engine.list_sessions() == []

