"""OpenAI Responses through the proxy: the `openai` SDK's Responses API and an OpenAI Agents SDK
run against a fake upstream on loopback, which refuses function calls and outputs that do not
pair up, as the real service does."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from contextrender.testing.fake_upstream import LoopbackServer
from contextrender.proxy import BUDGET_HEADER, SELECTOR_HEADER, SESSION_HEADER, UNMANAGED_HEADER, create_app
from contextrender.proxy.responses.wire import to_normal
from engine.measure import CALL_OVERHEAD, MESSAGE_OVERHEAD, PART_TOKENS, get_tokenizer
from tests.conftest import call, responses_input, scripted_tool_loop, trace_prefix
from tests.proxy_fixtures import all_met, objects_met, proxy_url_at, without_restore_tool
from tests.test_anthropic import SHORTENED
from tests.test_proxy import wait_for_events

BUDGET = 3000
MODEL = "gpt-5"
TOK = get_tokenizer("o200k_base")


def history_tokens(body: dict) -> int:
    normal, _ = to_normal(body)
    rest = [m for m in normal if m["role"] not in ("system", "developer")]
    return TOK.history_tokens(rest[:-1] if rest[-1]["role"] == "user" else rest)


def recorded(turns: int = 30) -> tuple[str, list[dict]]:
    instructions, items = responses_input(trace_prefix(turns=turns))
    return instructions, items + [{"role": "user", "content": [{"type": "input_text", "text": "Keep going."}]}]


def pairing(items: list[dict]) -> list[str]:
    """Every function call answered by one output after it, every output answering a call
    before it, every reasoning item followed by an item of its model call."""
    problems, open_calls = [], set()
    for (i, item) in enumerate(items):
        kind = item.get("type", "message")
        if kind == "function_call":
            open_calls.add(item["call_id"])
        elif kind == "function_call_output":
            if item["call_id"] not in open_calls:
                problems.append(f"input[{i}] answers {item['call_id']}, not called before")
            open_calls.discard(item["call_id"])
        elif kind == "reasoning":
            after = items[i + 1] if i + 1 < len(items) else {}
            if after.get("type", "message") not in ("function_call", "message") or after.get("role", "assistant") != "assistant":
                problems.append(f"input[{i}]: reasoning with no item of its call after it")
    if open_calls:
        problems.append(f"calls {sorted(open_calls)} have no output")
    return problems


def agents_tools(sent: dict) -> dict:
    """A forwarded request with the agent's tools only: the restore tool the proxy adds after them
    when the render left a result out is taken away (tests/test_responses_restore.py tests it), and
    no text names it where it is not offered."""
    from contextrender.proxy.responses.restore import tool_definition

    return without_restore_tool(sent, tool_definition(), "input")


def assistant_texts(items: list[dict]) -> set[str]:
    """The text of every assistant message item the client sent."""
    return {"".join(p.get("text", "") for p in i["content"] if isinstance(p, dict)) if isinstance(i.get("content"), list)
            else str(i.get("content")) for i in items if i.get("role") == "assistant"}


def check_forwarded(instructions: str, items: list[dict], request: dict, sent: dict) -> int:
    """What every managed Responses request must satisfy; returns the number of items it changed
    (stubs, the fold marker and its index, shortened assistant prose)."""
    from engine.notices import FOLD_INDEX_HEADING

    assert {k: v for (k, v) in agents_tools(sent).items() if k != "input"} == {k: v for (k, v) in request.items() if k != "input"}
    assert sent["instructions"] == instructions
    assert pairing(sent["input"]) == []
    assert history_tokens(sent) <= BUDGET < history_tokens(request)
    calls = {i["call_id"] for i in items if i.get("type") == "function_call"}
    stubs = 0
    for item in sent["input"]:
        if item in items:
            continue  # exactly as the client sent it (reasoning items with their encrypted content)
        if item.get("type") == "function_call_output":
            assert item["call_id"] in calls and "omitted to fit the history budget" in item["output"]
            stubs += 1
            continue
        if item.get("type") == "function_call":
            # A call over results of a folded turn, its arguments cut (`folded_call_room`).
            assert item["call_id"] in calls and "tokens cut by ContextRender" in item["arguments"], item
            stubs += 1
            continue
        if item.get("role") == "assistant":
            # Prose shortened to its share of B, or whole where the turn's calls are not shown with it;
            # its reasoning items are not sent with it.
            assert item == {"role": "assistant", "content": item["content"]}, item
            assert SHORTENED.search(item["content"]) or item["content"] in assistant_texts(items), item
        else:
            # The task cut to its share above the marker, the fold marker, or the fold index after it
            # (a user message of its own).
            assert item == {"role": "user", "content": item["content"]}, item
            assert item["content"].startswith(("[ContextRender: the first user message", "[ContextRender: the oldest",
                                               FOLD_INDEX_HEADING)), item
        stubs += 1
    assert sent["input"][-1] == items[-1]
    return stubs


proxy_url = proxy_url_at(BUDGET)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)


def test_the_history_count_the_budget_checks_use_is_the_count_by_hand():
    """`history_tokens` above (the count every budget check here uses, through the adapter's own
    `to_normal`) on one input holding each kind of item, against a count written out by hand
    from the items' strings: an item the conversion dropped or doubled would change it."""
    args = '{"path": "tests/test_app.py"}'
    body = {"model": MODEL, "instructions": "You are a coding agent.", "input": [
        {"role": "user", "content": "Fix the failing test."},
        {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "Read the test."}], "encrypted_content": "gAAAA1=="},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Reading it.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": args, "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "def test_app(): assert add(1, 2) == 3"},
        {"role": "user", "content": [{"type": "input_text", "text": "Also check add."},
                                     {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
        {"role": "assistant", "content": "add returns 4."},
        {"role": "user", "content": [{"type": "input_text", "text": "Fix it."}]},
    ]}
    # The reasoning item, the message and the call of one model call are one assistant message:
    # its overhead, the reasoning as one non-text part (PART_TOKENS, its content is encrypted),
    # the text, the call's overhead, name and arguments. An image is PART_TOKENS too. The
    # instructions and the current user message are outside B.
    count = TOK.count
    by_hand = (
        MESSAGE_OVERHEAD + count("Fix the failing test.")
        + MESSAGE_OVERHEAD + PART_TOKENS + count("Reading it.") + CALL_OVERHEAD + count("read") + count(args)
        + MESSAGE_OVERHEAD + count("def test_app(): assert add(1, 2) == 3")
        + MESSAGE_OVERHEAD + count("Also check add.") + PART_TOKENS
        + MESSAGE_OVERHEAD + count("add returns 4.")
    )
    assert history_tokens(body) == by_hand


def test_a_recorded_conversation_is_rendered_within_budget(engine, upstream, proxy_url):
    instructions, items = recorded()
    tools = [{"type": "function", "name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    upstream.enqueue(content="Running the tests.", thinking="Run them.", tool_calls=[call("call_next", "bash", {"command": "pytest"})])
    raw = sdk(proxy_url).responses.with_raw_response.create(model=MODEL, instructions=instructions, input=items, tools=tools,
                                                           store=False, include=["reasoning.encrypted_content"])
    response = raw.parse()
    got = upstream.requests[-1]
    request = {"model": MODEL, "instructions": instructions, "input": items, "tools": tools, "store": False,
               "include": ["reasoning.encrypted_content"]}
    assert check_forwarded(instructions, items, request, got.json) > 0
    assert raw.http_response.content == got.sent
    assert [o.type for o in response.output] == ["reasoning", "message", "function_call"]
    session = raw.headers["x-contextrender-session"]
    assert history_tokens(got.json) <= int(raw.headers["x-contextrender-history-tokens"]) <= BUDGET
    assert int(raw.headers["x-contextrender-omitted"]) > 0 and int(raw.headers["x-contextrender-kept"]) > 0
    wait_for_events(engine, session, len(to_normal({"input": items})[0]) + 1)
    info = engine.get_session(session)
    assert info["config"] == {}  # o200k_base, the default, for an OpenAI model
    assert info["usage"]["input_tokens"] == len(got.body) // 4 and info["usage"]["cache_read_input_tokens"] == 0
    assert info["usage"]["estimated_input_tokens"] > history_tokens(got.json)


def test_a_streamed_answer_passes_byte_for_byte_and_is_ingested(engine, upstream, proxy_url):
    instructions, items = recorded(turns=12)
    body = {"model": MODEL, "instructions": instructions, "input": items, "stream": True}
    upstream.enqueue(content="Streaming this answer in pieces.", thinking="First, think.", tool_calls=[call("call_s", "bash", {"command": "ls"})])
    with httpx.stream("POST", f"{proxy_url}/v1/responses", json=body, headers={SESSION_HEADER: "streamed"}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join(response.iter_raw())
    assert received == upstream.requests[-1].sent and received.count(b"response.output_text.delta") > 5
    check_forwarded(instructions, items, body, upstream.requests[-1].json)
    wait_for_events(engine, "streamed", len(to_normal({"input": items})[0]) + 1)
    stored = engine.get_session("streamed", include_messages=True)["messages"][-1]
    assert stored["tool_calls"] == [call("call_s", "bash", {"command": "ls"})]
    assert stored["content"][0]["type"] == "reasoning" and stored["content"][1]["text"] == "Streaming this answer in pieces."


def test_answers_echoed_by_the_sdk_never_fork_the_session(engine, upstream, proxy_url):
    instructions, items = recorded(turns=12)
    client = sdk(proxy_url)
    headers = {SESSION_HEADER: "responses-loop"}
    for (turn, call_id, streamed) in scripted_tool_loop(upstream, "call_loop", lambda t: None if t % 3 else f"Step {t}.", lambda t: f"think {t}"):
        if streamed:
            with client.responses.stream(model=MODEL, instructions=instructions, input=items, extra_headers=headers) as stream:
                output = stream.get_final_response().output
        else:
            output = client.responses.create(model=MODEL, instructions=instructions, input=items, extra_headers=headers).output
        # As an agent loop appends them: the SDK's own output objects, then the call's output.
        items = items + list(output) + [{"type": "function_call_output", "call_id": call_id, "output": f"contents of f{turn}"}]
    upstream.enqueue(content="Done.")
    client.responses.create(model=MODEL, instructions=instructions, input=items, extra_headers=headers)
    assert pairing(upstream.requests[-1].json["input"]) == []
    info = engine.get_session("responses-loop")
    assert info["branch"] == 0


def test_the_next_request_s_history_meets_the_objects_the_engine_kept_of_the_last(engine, upstream, proxy_url, monkeypatch):
    # As tests/test_proxy.py's test of the same name, in Responses: the input items are put in the
    # engine's normal form at each request, and `reconcile` hands the engine the last request's
    # normal forms for the items resent unchanged, the objects its index kept under the promise.
    met = objects_met(monkeypatch)
    items: list[dict] = [{"role": "user", "content": "Fix the failing test in module_alpha."}]
    for (turn, call_id, _streamed) in scripted_tool_loop(upstream, "call_owned", lambda t: f"Step {t}.", lambda t: None):
        body = {"model": MODEL, "instructions": "You are a coding agent.", "input": items}
        response = httpx.post(f"{proxy_url}/v1/responses", json=body, headers={SESSION_HEADER: "owned"})
        assert response.status_code == 200
        items = items + response.json()["output"] + [{"type": "function_call_output", "call_id": call_id, "output": f"contents of file_{turn}.py"}]
    assert all_met(met, 3), met
    assert engine.get_session("owned")["branch"] == 0


def test_requests_on_server_side_state_pass_through_unmanaged(engine, upstream, proxy_url, caplog):
    client = sdk(proxy_url)
    caplog.set_level(logging.WARNING, logger="contextrender.proxy")
    for _ in range(2):
        upstream.enqueue(content="continued")
        raw = client.responses.with_raw_response.create(model=MODEL, input="and then?", previous_response_id="resp_abc",
                                                       extra_headers={SESSION_HEADER: "stateful"})
        assert raw.headers[UNMANAGED_HEADER].startswith("previous_response_id")
        assert "x-contextrender-history-tokens" not in raw.headers
        assert upstream.requests[-1].json == {"model": MODEL, "input": "and then?", "previous_response_id": "resp_abc"}
    assert len([r for r in caplog.records if "stateful" in r.getMessage()]) == 1  # once per session
    upstream.enqueue(content="searched")
    body = {"model": MODEL, "input": [{"role": "user", "content": "find it"}, {"type": "web_search_call", "id": "ws_1", "status": "completed"}]}
    response = httpx.post(f"{proxy_url}/v1/responses", json=body)
    assert "web_search_call" in response.headers[UNMANAGED_HEADER] and upstream.requests[-1].json == body
    assert [s["session_id"] for s in engine.list_sessions()] == []  # nothing stored for them


def test_errors_come_back_in_openai_shape(engine, upstream, proxy_url):
    client = sdk(proxy_url)
    with pytest.raises(openai.BadRequestError) as failed:
        client.responses.create(model=MODEL, input="hi", extra_headers={BUDGET_HEADER: "-5"})
    assert failed.value.body["type"] == "invalid_request_error" and "X-ContextRender-Budget" in failed.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", extra_headers={SELECTOR_HEADER: "nope"})
    assert upstream.requests == []
    broken = [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_nobody", "output": "x"}]
    with LoopbackServer(create_app(engine, upstream.base_url, BUDGET, fail_closed=True)) as closed:
        response = httpx.post(f"{closed.url}/v1/responses", json={"model": MODEL, "input": broken})
    assert response.status_code == 400 and "call_nobody" in response.json()["error"]["message"]


def test_string_input_and_headers_select_the_render(engine, upstream, proxy_url):
    upstream.enqueue(content="hello")
    raw = sdk(proxy_url).responses.with_raw_response.create(model=MODEL, instructions="Be brief.", input="Say hello.")
    assert upstream.requests[-1].json == {"model": MODEL, "instructions": "Be brief.", "input": "Say hello."}
    assert raw.headers["x-contextrender-history-tokens"] == "0"
    instructions, items = recorded()
    upstream.enqueue(content="ok")
    httpx.post(f"{proxy_url}/v1/responses", json={"model": MODEL, "instructions": instructions, "input": items},
               headers={SELECTOR_HEADER: "full", SESSION_HEADER: "everything"})
    assert upstream.requests[-1].json["input"] == items  # `full`: every item exactly as sent
    upstream.enqueue(content="ok")
    response = httpx.post(f"{proxy_url}/v1/responses", json={"model": MODEL, "instructions": instructions, "input": items},
                          headers={BUDGET_HEADER: "1500", SESSION_HEADER: "smaller"})
    assert history_tokens(upstream.requests[-1].json) <= int(response.headers["x-contextrender-history-tokens"]) <= 1500


def test_an_openai_agents_run_through_the_proxy(engine, upstream, proxy_url):
    from agents import Agent, OpenAIResponsesModel, RunConfig, Runner, function_tool

    @function_tool
    def read_file(path: str) -> str:
        """Read a file of the repository."""
        return "\n".join(f"{path}:{n}: value_{path}_{n} = compute_{n}()" for n in range(150))

    for i in range(5):
        upstream.enqueue(content=None, thinking=f"Read file {i} next.", tool_calls=[call(f"call_agent_{i}", "read_file", {"path": f"src/m{i}.py"})])
    upstream.enqueue(content="All five files read.")
    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=f"{proxy_url}/v1", api_key="sk-test", max_retries=0))
    agent = Agent(name="reader", instructions="You read files for the user.", tools=[read_file], model=model)
    result = Runner.run_sync(agent, "Read five files.", run_config=RunConfig(tracing_disabled=True))
    assert result.final_output == "All five files read."
    sent = [r.json for r in upstream.requests if r.path == "/v1/responses"]
    assert len(sent) == 6
    for body in sent:
        assert pairing(body["input"]) == [] and history_tokens(body) <= BUDGET
    # 5 results of ~2,800 tokens: the earlier ones are left out (stubs, or their turns folded behind
    # the marker), the newest, larger than what B leaves, is cut under a note that names its handle.
    last = json.dumps(sent[-1]["input"])
    assert ("omitted to fit the history budget" in last or "left out to fit the" in last) and "[ContextRender: compacted from" in last
    sessions = engine.list_sessions()
    assert len(sessions) == 1 and sessions[0]["branch"] == 0  # the agent's echoes never forked it
