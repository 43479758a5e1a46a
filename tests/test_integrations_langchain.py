"""The LangChain middleware (integrations/langchain) in a real `create_agent` run: langchain 1.5,
LangGraph's checkpointer, langchain-openai's ChatOpenAI talking to the fake upstream on loopback."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("langchain")

from langchain.agents import create_agent
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool as lc_tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from contextrender.testing.checks import pairing_problems
from contextrender.client import Client
from contextrender.testing.fake_upstream import free_port, named_handles
from contextrender.tools import RESTORE_TOOL, restored_text
from contextrender_integrations.langchain import ContextRenderMiddleware
from tests.conftest import call
from tests.integration_runs import BUDGET, READS, TOK, body, handles_of, history_of, script_reads, unnamed


@lc_tool
def read_file(path: str) -> str:
    """Read a file of the repository."""
    return body(path)


def agent_for(upstream, middleware):
    model = ChatOpenAI(model="fake-model", base_url=upstream.base_url, api_key="sk-test", max_retries=0)
    return create_agent(model, [read_file], middleware=[middleware], checkpointer=InMemorySaver(),
                        system_prompt="You are a coding agent. Use the tools.")


def test_every_model_call_sees_at_most_b_with_valid_pairing_and_a_restore_returns_the_result(engine, upstream):
    agent = agent_for(upstream, ContextRenderMiddleware(engine, budget=BUDGET))
    config = {"configurable": {"thread_id": "t-1"}}
    script_reads(upstream, READS)
    upstream.enqueue(content="I read them all.")
    state = agent.invoke({"messages": [HumanMessage("Read the eight files.")]}, config)
    assert state["messages"][-1].content == "I read them all."
    assert len(upstream.requests) == READS + 1

    full = TOK.history_tokens(history_of({"messages": [m for m in _chat(state["messages"])]}))
    assert full > 2 * BUDGET  # the budget forces omissions
    for request in upstream.requests:
        sent = request.json
        assert TOK.history_tokens(history_of(sent)) <= BUDGET
        assert pairing_problems(sent["messages"]) == []
        assert RESTORE_TOOL in [t["function"]["name"] for t in sent["tools"]]  # the middleware's tool
    # The agent's own state keeps every result whole: the render changes only what is sent.
    results = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert [m.content for m in results] == [body(f"src/f{i}.py") for i in range(READS)]
    # The last call names each result it leaves out (a stub, or the fold index's entry).
    last, owners = upstream.requests[-1].json, handles_of(engine, "langchain-t-1")
    handles = named_handles(last)
    originals = {m.tool_call_id: m.content for m in results}
    assert handles and unnamed(last, originals, owners) == [], "the last call should name every result it leaves out"
    # The session is named by LangGraph's thread id.
    assert engine.get_session("langchain-t-1")["events"] >= 2 * READS

    # Next turn on the same thread: the model restores the first handle the last call named.
    handle = handles[0]
    original = restored_text(engine.restore("langchain-t-1", handle))
    assert original == originals[next(c for (c, h) in owners.items() if h == handle)]
    upstream.enqueue(content=None, tool_calls=[call("call_restore", RESTORE_TOOL, {"handle": handle})])
    upstream.enqueue(content="Found it.")
    state = agent.invoke({"messages": [HumanMessage("What was in the first file?")]}, config)
    assert state["messages"][-1].content == "Found it."
    restored = next(m for m in state["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == "call_restore")
    assert restored.content == original and original in {body(f"src/f{i}.py") for i in range(READS)}
    sent = upstream.requests[-1].json
    assert pairing_problems(sent["messages"]) == []
    assert TOK.history_tokens(history_of(sent)) <= BUDGET
    assert any(m["role"] == "tool" and m["tool_call_id"] == "call_restore" and m["content"] == original for m in sent["messages"])

    # A handle the session does not hold is answered with a sentence, not an exception.
    upstream.enqueue(content=None, tool_calls=[call("call_bad", RESTORE_TOOL, {"handle": "r99999"})])
    upstream.enqueue(content="OK.")
    state = agent.invoke({"messages": [HumanMessage("And r99999?")]}, config)
    bad = next(m for m in state["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == "call_bad")
    assert "no stored result" in bad.content


def test_async_run_renders_the_same_way(engine, upstream):
    import asyncio

    agent = agent_for(upstream, ContextRenderMiddleware(engine, budget=BUDGET))
    script_reads(upstream, 4)
    upstream.enqueue(content="Done async.")
    state = asyncio.run(agent.ainvoke({"messages": [HumanMessage("Read four files.")]}, {"configurable": {"thread_id": "a-1"}}))
    assert state["messages"][-1].content == "Done async."
    for request in upstream.requests:
        assert TOK.history_tokens(history_of(request.json)) <= BUDGET
        assert pairing_problems(request.json["messages"]) == []
    assert engine.get_session("langchain-a-1")["events"] >= 8


def test_contextrender_down_the_run_completes_with_the_agents_own_messages(upstream, caplog):
    down = Client(f"http://127.0.0.1:{free_port()}", timeout=2)
    agent = agent_for(upstream, ContextRenderMiddleware(down, budget=BUDGET))
    script_reads(upstream, 3)
    upstream.enqueue(content="Finished without ContextRender.")
    with caplog.at_level(logging.WARNING, logger="contextrender.langchain"):
        state = agent.invoke({"messages": [HumanMessage("Read three files.")]}, {"configurable": {"thread_id": "d-1"}})
    assert state["messages"][-1].content == "Finished without ContextRender."
    # Unchanged: the last call got every result whole.
    sent = upstream.requests[-1].json["messages"]
    assert [m["content"] for m in sent if m["role"] == "tool"] == [body(f"src/f{i}.py") for i in range(3)]
    assert sum("history sent unchanged for session langchain-d-1" in r.getMessage() for r in caplog.records) == 4


def _chat(messages):
    from langchain_core.messages import convert_to_openai_messages

    return convert_to_openai_messages(messages)
