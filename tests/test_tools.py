"""The restore tool for agents that call the engine or the server themselves (adapters/tools.py)."""

from __future__ import annotations

import asyncio
import logging

from contextrender.client import Client
from contextrender.testing.fake_upstream import free_port, named_handles
from contextrender.tools import RESTORE_TOOL, restore_tool
from tests.conftest import assistant, call, tool, user
from tests.integration_runs import handles_of, unnamed


def long_run(results: int = 8) -> list[dict]:
    messages = [user("Read the files.")]
    for i in range(results):
        messages.append(assistant(f"Reading {i}.", call(f"c{i}", "read_file", {"path": f"f{i}.py"})))
        messages.append(tool(f"c{i}", " ".join(f"f{i}_line_{j} = v{j}" for j in range(60))))
    return messages


def test_the_tool_answers_each_handle_a_render_names_with_the_stored_result(engine):
    messages = long_run()
    for end in range(3, len(messages) + 1, 2):  # rendered at every model call, as an agent does
        rendered = engine.render("run-t", messages[:end], budget=1500)
    # Each result the render leaves out is named for the tool: a stub, or the fold index's entry.
    request = {"messages": rendered.messages}
    originals = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    owners = handles_of(engine, "run-t")
    assert named_handles(request) and unnamed(request, originals, owners) == []
    handle = named_handles(request)[0]
    original = originals[next(c for (c, h) in owners.items() if h == handle)]

    restore = restore_tool(engine, "run-t")
    assert restore.name == RESTORE_TOOL == restore.schema["function"]["name"]
    # One of two: a handle restores, a query searches (neither is required on its own).
    assert set(restore.parameters["properties"]) == {"handle", "query"} and "required" not in restore.parameters
    assert restore(handle) == original
    answer = restore.answer(call("x1", RESTORE_TOOL, {"handle": handle}))
    assert answer == {"role": "tool", "tool_call_id": "x1", "content": original}
    assert asyncio.run(restore.acall(handle)) == original
    # The session can also be given per call, or by a function.
    assert restore_tool(engine)(handle, "run-t") == original
    assert restore_tool(engine, lambda: "run-t")(handle) == original


def test_bad_handles_and_a_down_server_are_sentences_for_the_model(engine, caplog):
    engine.ingest("run-b", long_run(2))
    restore = restore_tool(engine, "run-b")
    assert "no stored result" in restore("r99999")
    assert "could not read handle" in restore("not a handle")
    assert "needs a handle" in restore.answer(call("x", RESTORE_TOOL, "{not json"))["content"]
    assert "no stored result" in restore_tool(engine, "no-such-session")("r1")
    down = restore_tool(Client(f"http://127.0.0.1:{free_port()}", timeout=2), "run-b")
    with caplog.at_level(logging.WARNING, logger="contextrender.tools"):
        assert "could not restore 'r1' now (ServerUnavailable)" in down("r1")
    assert any("restore of r1 in session run-b failed" in r.getMessage() for r in caplog.records)


def test_a_query_answers_the_matching_handles_and_restores_nothing(engine):
    engine.ingest("run-q", long_run(4))
    restore = restore_tool(engine, "run-q")
    answer = restore.answer(call("q1", RESTORE_TOOL, {"query": "f2_line_7"}))
    assert answer["tool_call_id"] == "q1"
    lines = answer["content"].splitlines()
    assert lines[1].startswith("r3 read_file (f2.py): ") and "f2_line_7" in lines[1]  # the third result holds it
    assert RESTORE_TOOL in lines[-1]
    assert asyncio.run(restore.acall(query="f2.py")) == restore(query="f2.py")
    assert "no stored result matches" in restore(query="nothing_like_this")
    assert "could not search for 'x'" in restore(query="x")
    # A handle wins over a query; a search counted no restore.
    assert restore.answer(call("q2", RESTORE_TOOL, {"handle": "r1", "query": "f2"}))["content"].startswith("f0_line_0")
    assert engine.get_session("run-q")["restores"] == 1
    assert "needs a handle" in restore.answer(call("q3", RESTORE_TOOL, {"query": "  "}))["content"]
