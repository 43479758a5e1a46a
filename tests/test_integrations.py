"""The integration recipes (docs/proxy-and-protocols.md), each run for real on loopback: the OpenAI Python SDK and
litellm through the proxy, the OpenClaw provider entry, and the opencode plugin run by Node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from contextrender_adapters.checks import pairing_problems
from contextrender_adapters.client import Client
from contextrender_adapters.fakeupstream import FakeUpstream, LoopbackServer
from contextrender_adapters.proxy import create_app
from engine.measure import get_tokenizer
from tests.conftest import call
from tests.test_proxy import BUDGET, SYSTEM, conversation, history

ROOT = Path(__file__).resolve().parent.parent
TOK = get_tokenizer()


@pytest.fixture
def node():
    """Node, which runs the opencode plugin: without it these tests skip on a developer's machine,
    and fail where `CI` is set (a CI machine without Node would otherwise test no plugin at all)."""
    if shutil.which("node") is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set and Node is not on PATH: the opencode plugin's tests need it (install Node.js, e.g. apt-get install nodejs)")
        pytest.skip("needs Node (v20 is at /usr/bin/node on the dev machines)")


@pytest.fixture
def proxy_url(engine, upstream):
    with LoopbackServer(create_app(engine, upstream.base_url, BUDGET)) as server:
        yield server.url


def assert_rendered(upstream: FakeUpstream, sent: list[dict]) -> None:
    rendered = upstream.requests[-1].json["messages"]
    assert rendered[0] == SYSTEM and rendered[-1] == sent[-1]
    assert TOK.history_tokens(history(sent)) > BUDGET >= TOK.history_tokens(history(rendered))
    assert pairing_problems(rendered) == []


# ---------------------------------------------------------------- OpenAI SDK and litellm


def test_openai_sdk_through_the_proxy(proxy_url, upstream):
    import openai

    client = openai.OpenAI(base_url=f"{proxy_url}/v1", api_key="sk-test")
    messages = conversation()
    upstream.enqueue(content="Here is the fix.")
    answer = client.chat.completions.create(model="gpt-4.1", messages=messages, temperature=0.1)
    assert answer.choices[0].message.content == "Here is the fix."
    assert upstream.requests[-1].headers["authorization"] == "Bearer sk-test"
    assert_rendered(upstream, messages)

    upstream.enqueue(content="Streamed through the proxy.", tool_calls=[call("call_sdk", "read_file", {"path": "a.py"})])
    stream = client.chat.completions.create(model="gpt-4.1", messages=messages, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Streamed through the proxy."
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert json.loads(arguments) == {"path": "a.py"}
    assert upstream.requests[-1].json["stream"] is True
    assert_rendered(upstream, messages)


def test_litellm_through_the_proxy(proxy_url, upstream):
    import litellm

    messages = conversation()
    upstream.enqueue(content="litellm answer")
    answer = litellm.completion(model="openai/gpt-4.1", api_base=f"{proxy_url}/v1", api_key="sk-lite", messages=messages)
    assert answer.choices[0].message.content == "litellm answer"
    assert upstream.requests[-1].headers["authorization"] == "Bearer sk-lite"
    assert_rendered(upstream, messages)

    upstream.enqueue(content="litellm streamed answer")
    stream = litellm.completion(model="openai/gpt-4.1", api_base=f"{proxy_url}/v1", api_key="sk-lite", messages=messages, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == "litellm streamed answer"
    assert upstream.requests[-1].json["stream"] is True
    assert_rendered(upstream, messages)


# ---------------------------------------------------------------- OpenClaw


def test_openclaw_provider_entry_points_at_the_proxy_and_its_api_works(proxy_url, upstream):
    import openai

    config = json.loads((ROOT / "integrations" / "openclaw" / "openclaw.json").read_text())
    provider = config["models"]["providers"]["contextrender"]
    assert provider["api"] == "openai-completions"
    assert provider["baseUrl"] == "http://127.0.0.1:8800/v1"  # the recipe's `contextrender proxy --port 8800`
    model = provider["models"][0]
    assert config["agents"]["defaults"]["model"]["primary"] == f"contextrender/{model['id']}"
    # "openai-completions": OpenAI chat completions at baseUrl, streamed, with the key as a bearer token.
    base_url = provider["baseUrl"].replace("http://127.0.0.1:8800", proxy_url)
    client = openai.OpenAI(base_url=base_url, api_key="sk-claw")
    messages = conversation()
    upstream.enqueue(content="claw")
    stream = client.chat.completions.create(model=model["id"], messages=messages, stream=True, max_tokens=model["maxTokens"])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "claw"
    assert upstream.requests[-1].json["model"] == model["id"]
    assert_rendered(upstream, messages)


# ---------------------------------------------------------------- opencode

def opencode_session(results: int = 10, words: int = 120) -> list[dict]:
    """An opencode session as the transform hook gets it: {info, parts} per message."""
    session = "ses_test1"
    messages = []

    def message(role: str, parts: list[dict]) -> None:
        mid = f"msg_{len(messages):03d}"
        info = {"id": mid, "sessionID": session, "role": role, "time": {"created": len(messages)}}
        for i, part in enumerate(parts):
            part.update(id=f"prt_{mid}_{i}", sessionID=session, messageID=mid)
        messages.append({"info": info, "parts": parts})

    message("user", [{"type": "text", "text": "Fix the failing test in module_alpha."}])
    for i in range(results):
        output = " ".join(f"line_{i}_{j} = value_{i}_{j}" for j in range(words))
        message("assistant", [
            {"type": "step-start"},
            {"type": "text", "text": f"Reading file {i}."},
            {"type": "tool", "callID": f"toolu_{i}", "tool": "read",
             "state": {"status": "completed", "input": {"filePath": f"src/file_{i}.py"}, "output": output,
                       "title": f"src/file_{i}.py", "metadata": {}, "time": {"start": 0, "end": 1}}},
        ])
    message("user", [{"type": "text", "text": "Now write the fix."}])
    return messages


def calls_text_as_null(chat: list[dict]) -> list[dict]:
    return [m | {"content": m["content"] or None} if m["role"] == "assistant" and m.get("tool_calls") else m for m in chat]


def run_plugin(url: str, messages: list[dict], token: str) -> dict:
    env = dict(os.environ, CONTEXTRENDER_URL=url, CONTEXTRENDER_TOKEN=token, CONTEXTRENDER_BUDGET=str(BUDGET))
    done = subprocess.run(
        ["node", str(ROOT / "tests" / "node" / "opencode_transform.mjs"), str(ROOT / "integrations" / "opencode" / "contextrender.js")],
        input=json.dumps({"messages": messages}), capture_output=True, text=True, env=env, timeout=60, check=True,
    )
    return json.loads(done.stdout) | {"stderr": done.stderr}


def test_opencode_plugin_renders_the_history_through_the_server(node, jac_server):
    messages = opencode_session()
    with Client(jac_server.url) as client:
        client.register("opencode-user", "secret-password-1")
        out = run_plugin(jac_server.url, messages, client.token)
        sent = out["sent"]
        assert TOK.history_tokens(history(sent)) > 4 * BUDGET
        # What opencode now sends is exactly the server's render of the session.
        expected = client.render("opencode-ses_test1", sent, budget=BUDGET).messages
        # opencode has no null text: an assistant turn holding only calls comes back with "".
        assert calls_text_as_null(out["chat"]) == expected
        assert TOK.history_tokens(history(out["chat"])) <= BUDGET
        assert pairing_problems(out["chat"]) == []
        # opencode's own objects: ids kept; omitted results carry the stub as their output.
        by_id = {m["info"]["id"]: m for m in messages}
        stubbed = 0
        for m in out["messages"]:
            if m["info"]["id"] not in by_id:  # the fold marker: a synthetic user message
                assert m["info"]["role"] == "user" and m["parts"][0]["synthetic"] is True
                continue
            original = by_id[m["info"]["id"]]
            assert m["info"] == original["info"]
            for part in m["parts"]:
                if part["type"] == "tool":
                    before = next(p for p in original["parts"] if p["id"] == part["id"])
                    stubbed += part["state"]["output"] != before["state"]["output"]
        assert stubbed > 0
        # Fail-open: the server refuses the token, the history goes unchanged.
        refused = run_plugin(jac_server.url, messages, token="wrong")
        assert refused["messages"] == messages
        assert "history sent unchanged" in refused["stderr"]


def test_opencode_plugin_reads_the_server_envelope(node):
    script = (
        "import { ContextRender } from " + json.dumps((ROOT / "integrations" / "opencode" / "contextrender.js").as_uri()) + ";\n"
        "const m = [{role: 'user', content: 'x'}];\n"
        "const ok = JSON.stringify(ContextRender.parseRender({ok: true, data: {result: {}, reports: [{messages: m}]}})) === JSON.stringify(m);\n"
        "let threw = false; try { ContextRender.parseRender({ok: false, error: {message: 'no'}}) } catch { threw = true }\n"
        "process.stdout.write(JSON.stringify({ok, threw}));\n"
    )
    done = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(done.stdout) == {"ok": True, "threw": True}
