"""The opencode plugin (integrations/opencode, an npm package on @opencode-ai/plugin 1.18.33) run
by Node as opencode runs its hooks: the `experimental.chat.messages.transform` hook renders each
model call's history through a real server, the `contextrender_restore` tool takes back a result a
stub stands for, and both fail open."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from contextrender.testing.checks import pairing_problems
from contextrender.client import Client
from contextrender.testing.fake_upstream import free_port, named_handles
from engine.measure import get_tokenizer
from engine.notices import restore_tool
from tests.integration_runs import handles_of, unnamed
from tests.npm_package import installed, run_module
from tests.test_proxy import BUDGET, history

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "integrations" / "opencode" / "contextrender.js"
TOK = get_tokenizer()
# The lines of a search answer start with the handle (engine/notices.jac search_line).
HANDLE_LINE = re.compile(r"^([rp][0-9]+) ", re.M)


def query_of(output: str) -> str:
    """A value only that result held: its last word (value_<result>_<last line>)."""
    return output.split()[-1]


@pytest.fixture(scope="module")
def package() -> Path:
    return installed("opencode", "@opencode-ai/plugin")


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


def run_plugin(url: str, messages: list[dict], token: str, budget: int = BUDGET, **settings: str) -> dict:
    env = dict(os.environ, CONTEXTRENDER_URL=url, CONTEXTRENDER_TOKEN=token, CONTEXTRENDER_BUDGET=str(budget), **settings)
    done = subprocess.run(
        ["node", str(PLUGIN.parent / "test" / "transform.mjs"), str(PLUGIN)],
        input=json.dumps({"messages": messages}), capture_output=True, text=True, env=env, timeout=60, check=True,
    )
    return json.loads(done.stdout) | {"stderr": done.stderr}


def test_opencode_plugin_renders_the_history_through_the_server(jac_server, package):
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


def test_opencode_plugin_reads_the_server_envelope(package):
    script = (
        "import { ContextRender } from " + json.dumps(PLUGIN.as_uri()) + ";\n"
        "const m = [{role: 'user', content: 'x'}];\n"
        "const ok = JSON.stringify(ContextRender.parseRender({ok: true, data: {result: {}, reports: [{messages: m}]}})) === JSON.stringify(m);\n"
        "let threw = false; try { ContextRender.parseRender({ok: false, error: {message: 'no'}}) } catch { threw = true }\n"
        "process.stdout.write(JSON.stringify({ok, threw}));\n"
    )
    done = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(done.stdout) == {"ok": True, "threw": True}


@contextmanager
def silent_server() -> Iterator[str]:
    """A loopback URL whose server takes every connection and never answers (a hung ContextRender)."""
    held: list[socket.socket] = []
    server = socket.create_server(("127.0.0.1", 0))

    def hold() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=hold, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        for connection in held:
            connection.close()


def test_opencode_plugin_fails_open_when_the_server_never_answers(package):
    """Found by running the real opencode against a hung server: its model call waited for good.
    Past CONTEXTRENDER_TIMEOUT the history goes unchanged and a restore answers a sentence."""
    messages = opencode_session(results=2)
    with silent_server() as url:
        start = time.monotonic()
        out = run_plugin(url, messages, token="t", CONTEXTRENDER_TIMEOUT="1")
        assert out["messages"] == messages
        assert "history sent unchanged (no answer from" in out["stderr"] and "within 1 s" in out["stderr"]
        restored = run_restore(url, "t", "r1", CONTEXTRENDER_TIMEOUT="1")
        assert "could not restore" in restored["output"] and "within 1 s" in restored["stderr"]
        assert time.monotonic() - start < 30


def run_restore(url: str, token: str, handle: str | None, session: str = "ses_test1", query: str | None = None,
                **settings: str) -> dict:
    env = dict(os.environ, CONTEXTRENDER_URL=url, CONTEXTRENDER_TOKEN=token, **settings)
    asked = {"handle": handle} if query is None else {"query": query}
    done = subprocess.run(["node", str(PLUGIN.parent / "test" / "restore.mjs"), str(PLUGIN)],
                          input=json.dumps(asked | {"sessionID": session}), capture_output=True, text=True,
                          env=env, timeout=60, check=True)
    return json.loads(done.stdout) | {"stderr": done.stderr}


def test_every_model_call_of_a_run_is_within_b_and_the_restore_tool_returns_the_original(jac_server, package):
    budget = 1500
    messages = opencode_session(results=10, words=40)
    with Client(jac_server.url) as client:
        client.register("opencode-restorer", "secret-password-2")
        out = None
        # One model call after each tool round, as opencode calls the hook.
        for end in range(2, len(messages)):
            prefix = [m | {"info": m["info"] | {"sessionID": "ses_run"}} for m in messages[:end]]
            out = run_plugin(jac_server.url, prefix, client.token, budget)
            assert TOK.history_tokens(history(out["chat"])) <= budget
            assert pairing_problems(out["chat"]) == []
        assert TOK.history_tokens(history(out["sent"])) > 2 * budget
        # The last call names each result it leaves out (a stub, or the fold index's entry).
        outputs = {p["callID"]: p["state"]["output"] for m in messages for p in m["parts"] if p["type"] == "tool"}
        owners = handles_of(client, "opencode-ses_run")
        handles = named_handles({"messages": out["chat"]})
        assert handles and unnamed({"messages": out["chat"]}, outputs, owners) == [], "the last call should name every result it leaves out"
        call_id = next(c for (c, h) in owners.items() if h == handles[0])

        restored = run_restore(jac_server.url, client.token, handles[0], session="ses_run")
        assert restored["output"] == outputs[call_id]
        # opencode builds the tool's parameters from its zod `args`: a handle, or a query instead.
        assert {k: v["type"] for (k, v) in restored["schema"]["properties"].items()} == {"handle": "string", "query": "string"}
        assert "required" not in restored["schema"] or restored["schema"]["required"] == []
        assert restored["description"] == restore_tool()["function"]["description"]  # the engine's text

        # A query naming what the result held answers its handle first.
        found = run_restore(jac_server.url, client.token, None, session="ses_run", query=query_of(outputs[call_id]))
        assert found["output"].startswith("[ContextRender: stored results that match"), found
        assert HANDLE_LINE.findall(found["output"])[0] == handles[0], found["output"]

        unknown = run_restore(jac_server.url, client.token, "r99999", session="ses_run")
        assert "no stored result" in unknown["output"]
    down = run_restore(f"http://127.0.0.1:{free_port()}", "", handles[0], session="ses_run")
    assert "could not restore" in down["output"] and "restore of" in down["stderr"]


def test_apply_render_keeps_the_fold_index_apart_from_opencodes_messages(package):
    """The fold index is its own user message after the folded results kept (engine/notices.jac
    marker_messages): applyRender adds it as a synthetic message, and the user's next message keeps
    its original (it took that original's place before)."""
    from contextrender.core import FOLD_INDEX_HEADING, FOLD_INDEX_STORED_HEADING

    messages = opencode_session(results=3, words=5)
    script = (f"import {{ ContextRender }} from {json.dumps(PLUGIN.as_uri())};"
              "let input = ''; for await (const c of process.stdin) input += c;"
              "const { messages, heading } = JSON.parse(input); const chat = ContextRender.toChat(messages);"
              "const rendered = [{ role: 'user', content: '[ContextRender: the oldest messages are left out.]' },"
              " ...chat.slice(2, 5), { role: 'user', content: heading + '\\nread results: r1' }, ...chat.slice(5)];"
              "process.stdout.write(JSON.stringify(ContextRender.applyRender(messages, rendered)))")
    for heading in (FOLD_INDEX_HEADING, FOLD_INDEX_STORED_HEADING):
        out = run_module(script, {"messages": messages, "heading": heading}, cwd=PLUGIN.parent)
        synthetic = [m for m in out if any(p.get("synthetic") for p in m["parts"])]
        assert [m["parts"][0]["text"][:len(heading)] for m in synthetic[1:]] == [heading]
        assert len({m["info"]["id"] for m in out}) == len(out)  # the two notices have their own ids
        assert out[-1] == messages[-1]  # "Now write the fix.", as it was
