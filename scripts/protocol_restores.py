"""One restore round on each protocol the proxy speaks, run for real on loopback: the proxy with an
in-process engine in front of the fake upstream (adapters/testing/fake_upstream.py, as a model that calls
the restore tool with the handle its stub names), driven by the real SDKs. Prints, per protocol,
what the model is sent (a stub, the tool), what it calls, the round the proxy appends, and what
the agent gets: the excerpts of docs/protocols.md.

    python scripts/protocol_restores.py > /tmp/restores.md
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anthropic  # noqa: E402
import openai  # noqa: E402

from contextrender import Engine  # noqa: E402
from contextrender.testing.fake_upstream import FakeUpstream, LoopbackServer  # noqa: E402
from contextrender.proxy import SESSION_HEADER, create_app  # noqa: E402

B = 2000
SETTINGS = {"policy": "per-call", "prose_share": 1.0, "condense": False}
RESULTS = 12


def chat_history() -> list[dict]:
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the failing test."}]
    for i in range(RESULTS):
        messages.append({"role": "assistant", "content": f"Reading file {i}.", "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/f{i}.py"})}}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": " ".join(f"line_{i}_{j} = value_{i}_{j}" for j in range(20))})
    return messages + [{"role": "user", "content": "Now write the fix."}]


def anthropic_history() -> tuple[str, list[dict]]:
    turns: list[dict] = []
    for m in chat_history()[1:]:
        if m["role"] == "assistant":
            c = m["tool_calls"][0]
            turns.append({"role": "assistant", "content": [{"type": "text", "text": m["content"]}, {
                "type": "tool_use", "id": c["id"], "name": "read_file", "input": json.loads(c["function"]["arguments"])}]})
        elif m["role"] == "tool":
            turns.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]})
        elif turns and turns[-1]["role"] == "user":
            turns[-1]["content"].append({"type": "text", "text": m["content"]})
        else:
            turns.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
    return "You are a coding agent.", turns


def responses_history() -> list[dict]:
    items: list[dict] = []
    for m in chat_history()[1:]:
        if m["role"] == "assistant":
            c = m["tool_calls"][0]
            items.append({"type": "function_call", "call_id": c["id"], "name": "read_file", "arguments": c["function"]["arguments"]})
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append({"role": "user", "content": m["content"]})
    return items


def _cut(value: object) -> object:
    """Long strings cut for reading (marked with ...); everything else as sent."""
    if isinstance(value, str):
        return value if len(value) <= 170 else value[:120] + f" ... ({len(value)} characters)"
    if isinstance(value, dict):
        return {k: _cut(v) for (k, v) in value.items()}
    if isinstance(value, list):
        return [_cut(v) for v in value]
    return value


def show(title: str, value: object) -> None:
    items = value if isinstance(value, list) else [value]
    lines = "\n".join(json.dumps(_cut(item), ensure_ascii=False) for item in items)
    print(f"{title}:\n\n```json\n{lines}\n```\n")


def report(name: str, upstream: FakeUpstream, stub: object, tool: object, call: object, round_: object, agent: object) -> None:
    print(f"## {name}\n")
    show("A stub the model is sent (an omitted result)", stub)
    show("The restore tool, after the agent's own tools", tool)
    show("The model's answer: a restore call", call)
    show("What the proxy appends before it asks again", round_)
    show("What the agent gets", agent)


def main() -> None:
    engine = Engine(Path(tempfile.mkdtemp()) / "store")
    with FakeUpstream() as upstream, LoopbackServer(create_app(engine, upstream.base_url, B)) as proxy:
        # Chat completions, the openai SDK.
        engine.configure("chat", **SETTINGS)
        upstream.enqueue_restore()
        upstream.enqueue(content="The failing line is line_3_7.")
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="sk-demo", max_retries=0)
        tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
        answer = client.chat.completions.create(model="gpt-4o", messages=chat_history(), tools=tools, extra_headers={SESSION_HEADER: "chat"})
        (first, second) = [r.json for r in upstream.requests[-2:]]
        stub = next(m for m in first["messages"] if m.get("role") == "tool" and "omitted" in m["content"])
        report("Chat completions (`POST /v1/chat/completions`)", upstream, stub, first["tools"][-1],
               json.loads(upstream.requests[-2].sent)["choices"][0]["message"], second["messages"][-2:],
               answer.choices[0].message.model_dump(exclude_none=True))
        # Anthropic Messages, the anthropic SDK, streamed.
        engine.configure("messages", **SETTINGS)
        upstream.enqueue_restore(thinking="I need the output of that read again.")
        upstream.enqueue(content="The failing line is line_3_7.")
        (system, turns) = anthropic_history()
        claude = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-demo", max_retries=0)
        with claude.messages.stream(model="claude-sonnet-4-5", max_tokens=512, system=system, messages=turns,
                                    tools=[{"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
                                    extra_headers={SESSION_HEADER: "messages"}) as stream:
            final = stream.get_final_message()
        (first, second) = [r.json for r in upstream.requests[-2:]]
        stub = next(b for t in first["messages"] if isinstance(t["content"], list) for b in t["content"]
                    if b.get("type") == "tool_result" and "omitted" in str(b.get("content")))
        report("Anthropic Messages (`POST /v1/messages`, streamed)", upstream, stub, first["tools"][-1],
               second["messages"][-2]["content"], second["messages"][-2:], [b.model_dump(exclude_none=True) for b in final.content])
        # Responses, the openai SDK.
        engine.configure("responses", **SETTINGS)
        upstream.enqueue_restore()
        upstream.enqueue(content="The failing line is line_3_7.")
        response = client.responses.create(model="gpt-5", instructions="You are a coding agent.", input=responses_history(),
                                           tools=[{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
                                           extra_headers={SESSION_HEADER: "responses"})
        (first, second) = [r.json for r in upstream.requests[-2:]]
        stub = next(i for i in first["input"] if i.get("type") == "function_call_output" and "omitted" in i["output"])
        report("Responses (`POST /v1/responses`)", upstream, stub, first["tools"][-1],
               json.loads(upstream.requests[-2].sent)["output"], second["input"][-2:], [i.model_dump(exclude_none=True) for i in response.output])
        # Not offered: tool_choice none.
        engine.configure("none", **SETTINGS)
        client.chat.completions.create(model="gpt-4o", messages=chat_history(), tools=tools, tool_choice="none", extra_headers={SESSION_HEADER: "none"})
        stub = next(m for m in upstream.requests[-1].json["messages"] if m.get("role") == "tool" and "omitted" in m["content"])
        print("## Where the tool is not offered (`tool_choice: \"none\"`)\n")
        show("The same stub", stub)
        print(f"Tools forwarded: {[t['function']['name'] for t in upstream.requests[-1].json['tools']]}")


if __name__ == "__main__":
    main()
