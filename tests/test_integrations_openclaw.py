"""The OpenClaw context engine (integrations/openclaw, for openclaw 2026.9.6) run by Node as
OpenClaw's host calls it: `assemble` before every model call of a tool loop against a real
server, the transcript contract and an idempotent `commitTurn`, owned compaction, the restore
tool, and fail open. (The OpenClaw gateway itself is not started: its package is 330 MB.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from contextrender.testing.checks import pairing_problems
from contextrender.client import Client
from contextrender.testing.fake_upstream import free_port
from engine.measure import get_tokenizer
from engine.notices import restore_tool
from tests.npm_package import require_node, run_module

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "integrations" / "openclaw"
TOK = get_tokenizer()
BUDGET = 1500
HANDLE = re.compile(r'call contextrender_restore with handle "([rp][0-9]+)"')

@pytest.fixture(autouse=True)
def node() -> None:
    require_node()


def body(i: int) -> str:
    return " ".join(f"file_{i}_line_{j} = value_{j}" for j in range(40))


def transcript(reads: int) -> list[dict]:
    """An OpenClaw session: a user turn, then `reads` rounds of a read call and its result."""
    messages = [{"role": "user", "content": "Read the files and fix the bug.", "timestamp": 1}]
    for i in range(reads):
        messages.append({"role": "assistant", "api": "openai-completions", "provider": "fake", "model": "fake-model",
                         "stopReason": "toolUse", "timestamp": 2 + 2 * i,
                         "usage": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "totalTokens": 0,
                                   "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0}},
                         "content": [{"type": "thinking", "thinking": f"Next file {i}."}, {"type": "text", "text": f"Reading file {i}."},
                                     {"type": "toolCall", "id": f"call_{i}", "name": "read", "arguments": {"path": f"src/f{i}.py"}}]})
        messages.append({"role": "toolResult", "toolCallId": f"call_{i}", "toolName": "read", "isError": False,
                         "content": [{"type": "text", "text": body(i)}], "timestamp": 3 + 2 * i})
    return messages


def host(ops: list[dict], url: str, token: str = "", budget: int | None = BUDGET) -> dict:
    config = {"url": url, "token": token} | ({"budget": budget} if budget else {})
    env = dict(os.environ, CONTEXTRENDER_PLUGIN_CONFIG=json.dumps(config))
    done = subprocess.run(["node", str(PACKAGE / "test" / "host.mjs"), str(PACKAGE / "index.mjs")], input=json.dumps({"ops": ops}),
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def history(chat: list[dict]) -> list[dict]:
    rest = [m for m in chat if m["role"] not in ("system", "developer")]
    return rest[:-1] if rest and rest[-1]["role"] == "user" else rest


def test_the_manifest_declares_the_engine_and_the_tool():
    manifest = json.loads((PACKAGE / "openclaw.plugin.json").read_text())
    package = json.loads((PACKAGE / "package.json").read_text())
    assert manifest["id"] == "contextrender" and manifest["contracts"]["tools"] == [restore_tool()["function"]["name"]]
    assert package["openclaw"]["extensions"] == ["./index.mjs"] and package["type"] == "module"


def test_every_model_call_is_within_b_commit_turn_is_idempotent_and_a_restore_returns_the_original(jac_server):
    messages = transcript(10)
    key = "agent:main:chat-7"
    with Client(jac_server.url) as client:
        client.register("openclaw-user", "secret-password-3")
        # The defaults before 2026-12-06 (no hysteresis, headroom 0.5): with them the last call
        # shows the early reads as stubs naming their handles, and a stub's restore is what this
        # test is about; with the hysteresis the early turns fold into the index instead.
        client.configure(f"openclaw-{key}", stickiness=0.0, sticky_to="shown", headroom=0.5)
        # One assemble per model call of the tool loop, each with the history so far; the host
        # gives its own (large) context window as tokenBudget, the plugin's budget is B.
        ops = [{"op": "assemble", "sessionId": "sess-1", "sessionKey": key, "messages": messages[:end], "tokenBudget": 200000}
               for end in range(1, len(messages) + 1, 2)]
        ops += [{"op": "commitTurn", "advancementKey": "turn-1", "sessionId": "sess-1", "sessionKey": key, "messages": messages}] * 2
        ops += [{"op": "compact", "sessionId": "sess-1", "sessionKey": key, "force": True, "tokenBudget": 200000}]
        out = host(ops, jac_server.url, client.token)
        info = out["info"]
        assert info["ownsCompaction"] is True
        assert info["transcriptSemantics"] == {"currentTurnFence": "before-current-turn-entry-v1",
                                               "turnAdvancementIdempotency": "atomic-idempotent-v1"}
        assert out["tools"] == [{"name": "contextrender_restore"}]
        assemblies = [r for r in out["results"] if "chat" in r]
        for r in assemblies:
            assert TOK.history_tokens(history(r["chat"])) <= BUDGET
            assert pairing_problems(r["chat"]) == []
        last = assemblies[-1]
        assert TOK.history_tokens(history(last["sent"])) > 2 * BUDGET
        assert 0 < last["estimatedTokens"] <= BUDGET  # the server's count of what it rendered
        # OpenClaw's own objects come back: kept results unchanged, omitted ones hold the stub.
        kept = [m for m in last["messages"] if m in messages]
        assert kept and all(m["role"] in ("user", "assistant", "toolResult") for m in last["messages"])
        assert [r["status"] for r in out["results"] if "status" in r] == ["committed", "duplicate"]
        compacted = out["results"][-1]
        assert compacted["ok"] is True and compacted["compacted"] is False
        assert out["warnings"] == []
        # The session is named by OpenClaw's session key.
        assert client.get_session(f"openclaw-{key}")["events"] >= 20

        handles = HANDLE.findall(" ".join(str(m.get("content")) for m in last["chat"]))
        assert handles, "the last call should show stubs that name their handles"
        stub = next(m for m in last["chat"] if m["role"] == "tool" and handles[0] in m["content"])
        original = body(int(stub["tool_call_id"].split("_")[1]))
        restored = host([{"op": "restore", "sessionKey": key, "sessionId": "sess-1", "handle": handles[0]},
                         {"op": "restore", "sessionKey": key, "sessionId": "sess-1", "handle": "r99999"}], jac_server.url, client.token)
        first, unknown = restored["results"]
        assert first["result"]["content"] == [{"type": "text", "text": original}]
        assert first["name"] == "contextrender_restore" and first["parameters"]["required"] == ["handle"]
        assert "no stored result" in unknown["result"]["content"][0]["text"]


def test_the_tool_loop_assembling_from_the_view_keeps_the_handles_it_showed(jac_server):
    """OpenClaw 2026.9.6 starts a run with an assemble of the transcript, puts the view it got in
    the agent's messages, and assembles again from that view (with the run's new messages) before
    every model call. The handles of the view's stubs stay on the server's live chain: the session
    does not fork, and a restore returns the original."""
    messages = transcript(6)
    key = "agent:main:loop-9"
    with Client(jac_server.url) as client:
        client.register("openclaw-loop-user", "secret-password-4")
        more = transcript(7)[len(messages):]
        ops = [{"op": "assemble", "sessionKey": key, "messages": messages, "tokenBudget": 200000},
               {"op": "assemble", "sessionKey": key, "afterView": True, "tokenBudget": 200000},
               {"op": "assemble", "sessionKey": key, "afterView": True, "messages": more, "tokenBudget": 200000}]
        out = host(ops, jac_server.url, client.token)
        first, again, grown = out["results"]
        assert again["sent"] == first["chat"]  # the view, as OpenClaw gives it back
        handles = shown(again["chat"])
        assert handles and handles == shown(first["chat"])
        # The server holds the transcript and the run's new messages once, on one branch.
        session = client.get_session(f"openclaw-{key}")
        assert session["branch"] == 0 and session["events"] == len(messages + more), session
        assert out["warnings"] == []
        assert shown(grown["chat"])[:len(handles)] == handles
        restored = host([{"op": "restore", "sessionKey": key, "handle": h} for h in handles], jac_server.url, client.token)
        texts = [r["result"]["content"][0]["text"] for r in restored["results"]]
        assert all(text in [body(i) for i in range(6)] for text in texts) and len(set(texts)) == len(handles)


def shown(chat: list[dict]) -> list[str]:
    """The handles a render shows: in its stubs, and in its fold index ("read results: r1 r2")."""
    text = " ".join(str(m.get("content")) for m in chat)
    return HANDLE.findall(text) + [h for line in re.findall(r"read results: ([rp0-9 ]+)", text) for h in line.split()]


def test_the_plugins_node_unit_tests_pass():
    """integrations/openclaw/test/assemble.test.mjs (node:test): what assemble sends when OpenClaw
    gives it its own last view back, against a stub server."""
    done = subprocess.run(["node", "--test", str(PACKAGE / "test" / "assemble.test.mjs")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "# fail 0" in done.stdout


def test_contextrender_down_assemble_returns_openclaws_messages_and_says_why():
    messages = transcript(3)
    url = f"http://127.0.0.1:{free_port()}"
    out = host([{"op": "assemble", "sessionId": "sess-2", "messages": messages, "tokenBudget": 200000},
                {"op": "restore", "sessionId": "sess-2", "handle": "r1"}], url)
    assembled, restored = out["results"]
    assert assembled["messages"] == messages  # unchanged, and nothing thrown (no quarantine)
    assert "could not restore" in restored["result"]["content"][0]["text"]
    assert any("history sent unchanged for openclaw-sess-2" in w for w in out["warnings"])
    assert any("restore of r1 in openclaw-sess-2 failed" in w for w in out["warnings"])


def test_from_chat_keeps_the_fold_index_apart_from_openclaws_messages():
    """The fold index is its own user message after the folded results kept (engine/notices.jac
    marker_messages): fromChat adds it as the render's own message, and the user's next message
    and the restore call after it keep their originals (it took the next user original's place)."""
    from contextrender.core import FOLD_INDEX_HEADING, FOLD_INDEX_STORED_HEADING

    messages = transcript(2) + [
        {"role": "user", "content": "What was in f0?", "timestamp": 50},
        {"role": "assistant", "api": "openai-completions", "provider": "fake", "model": "fake-model", "stopReason": "toolUse",
         "timestamp": 51, "content": [{"type": "toolCall", "id": "call_r", "name": "contextrender_restore", "arguments": {"handle": "r1"}}]},
        {"role": "toolResult", "toolCallId": "call_r", "toolName": "contextrender_restore", "isError": False,
         "content": [{"type": "text", "text": body(0)}], "timestamp": 52},
    ]
    script = (f"import {{ toChat, fromChat }} from {json.dumps((PACKAGE / 'index.mjs').as_uri())};"
              "let input = ''; for await (const c of process.stdin) input += c;"
              "const { messages, heading } = JSON.parse(input); const chat = toChat(messages);"
              "const rendered = [{ role: 'user', content: '[ContextRender: the oldest messages are left out.]' },"
              " chat[1], chat[2], { role: 'user', content: heading + '\\nread results: r1' }, ...chat.slice(3)];"
              "process.stdout.write(JSON.stringify(fromChat(messages, rendered)))")
    for heading in (FOLD_INDEX_HEADING, FOLD_INDEX_STORED_HEADING):
        out = run_module(script, {"messages": messages, "heading": heading})
        assert [m["role"] for m in out] == ["user", "assistant", "toolResult", "user", "assistant", "toolResult", "user", "assistant", "toolResult"]
        assert out[3]["content"].startswith(heading)
        assert out[6:] == messages[5:]  # the user's question, the restore call and its result, as they were


def test_the_turn_estimate_is_at_least_tiktokens_count_on_dense_texts():
    """The plugin (no tokenizer in Node) charges a turn's results by estimateTokens: it must not
    count fewer tokens than tiktoken (o200k_base) on the texts that tokenise densely (identifiers
    and numbers, JSON, code), or a model call could go over B; on prose it may count more."""
    samples = [
        "\n".join(f"report_{i} row {j}: counter_{i}_{j} = {j * 17 + i}" for i in range(3) for j in range(25)),
        "\n".join(f"notes_1 line {j}: the value of setting_{j} is {j}" for j in range(60)),
        " ".join(f"file_3_line_{j} = value_{j}" for j in range(40)),
        json.dumps([{"flight_number": f"HAT{j:03d}", "date": "2024-05-20", "price": 100 + j, "seats": {"economy": j}} for j in range(30)]),
        (ROOT / "adapters" / "tools.py").read_text()[:6000],
        (ROOT / "README.md").read_text()[:5000],
    ]
    script = (f"import {{ estimateTokens }} from {json.dumps((PACKAGE / 'index.mjs').as_uri())};"
              "let input = ''; for await (const c of process.stdin) input += c;"
              "process.stdout.write(JSON.stringify(JSON.parse(input).map(estimateTokens)))")
    estimates = run_module(script, samples)
    for text, estimate in zip(samples, estimates):
        assert TOK.count(text) <= estimate <= 1.6 * TOK.count(text), (text[:60], TOK.count(text), estimate)
