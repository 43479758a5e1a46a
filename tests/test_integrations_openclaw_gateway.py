"""The OpenClaw plugin inside the real OpenClaw (openclaw 2026.9.6, tests/openclaw_gateway.py):
`openclaw plugins install --link integrations/openclaw`, the plugin made the context engine, then
three `openclaw agent --local` turns (two read a file with OpenClaw's own `read` tool) against the
fake model on loopback, with a real ContextRender server. OpenClaw calls our `assemble` with the
history before each turn, and again from the view it returned before each model call; the last
model call must show at most B tokens of it, with valid pairing and the results cut to stubs, and
the server must hold the session under OpenClaw's key. OpenClaw's tool search stays at its default:
the restore tool is offered beside it (catalogMode "direct-only"). A fourth turn's model calls the
restore tool with a handle the stubs name: the handles are those of the turn before, the session
never forked, and the file comes back exactly."""

from __future__ import annotations

import json
import os
import re
import subprocess
from types import SimpleNamespace
from pathlib import Path


import pytest

from contextrender.testing.fake_upstream import FakeUpstream
from contextrender.testing.checks import pairing_problems
from contextrender.client import Client
from engine.measure import get_tokenizer
from tests.openclaw_gateway import node_path, openclaw_command, openclaw_home

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "integrations" / "openclaw"
TOK = get_tokenizer()
BUDGET = 600
KEY = "agent:main:contextrender-test"
HANDLE = re.compile(r'call contextrender_restore with handle "([rp][0-9]+)"')
PROMPTS = ["Turn one: read notes1.txt and summarise it.", "Turn two: read notes2.txt and summarise it.",
           "Turn three: what did the two files say?", "Turn four: show the first file again."]


def notes(i: int) -> str:
    return "\n".join(f"notes_{i} line {j}: the value of setting_{j} is {j * i}" for j in range(60))


def read_call(i: int) -> list[dict]:
    return [{"id": f"call_read_{i}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"path": f"notes{i}.txt"})}}]


def history(chat: list[dict], prompt: str) -> list[dict]:
    """What came before the current turn (after the system prompt) in a chat-completions request."""
    start = next(i for i, m in enumerate(chat) if m["role"] == "user" and prompt in str(m.get("content")))
    return [m for m in chat[:start] if m["role"] not in ("system", "developer")]


def stubs(chat: list[dict]) -> dict[str, list[str]]:
    """The handles each tool result's stub names, by call id."""
    return {m["tool_call_id"]: HANDLE.findall(str(m["content"])) for m in chat if m["role"] == "tool"}


def configure(state: Path, upstream: str, server: str, token: str, workspace: Path, budget: int = BUDGET) -> None:
    config = json.loads((state / "openclaw.json").read_text()) if (state / "openclaw.json").exists() else {}
    config["models"] = {"mode": "merge", "providers": {"fake": {
        "baseUrl": upstream, "apiKey": "sk-fake", "api": "openai-completions",
        "models": [{"id": "fake-model", "name": "Fake model", "reasoning": False, "input": ["text"],
                    "contextWindow": 200000, "maxTokens": 4096}]}}}
    config["agents"] = {"defaults": {"model": {"primary": "fake/fake-model"}, "workspace": str(workspace)}}
    plugins = config.setdefault("plugins", {})
    plugins["slots"] = {"contextEngine": "contextrender"}
    entry = plugins.setdefault("entries", {}).setdefault("contextrender", {})
    entry["config"] = {"url": server, "token": token, "budget": budget}
    (state / "openclaw.json").write_text(json.dumps(config, indent=2))


def openclaw(tmp_path: Path, upstream: FakeUpstream, server: str, token: str, files: dict[str, str], budget: int = BUDGET):
    """A new OpenClaw state with the plugin linked and made the context engine (files in its
    workspace); returns `run(*args)`, the openclaw command in it."""
    home = openclaw_home()
    command = openclaw_command(home)
    state, workspace = tmp_path / "state", tmp_path / "workspace"
    state.mkdir()
    workspace.mkdir()
    for name, text in files.items():
        (workspace / name).write_text(text)
    env = dict(os.environ, HOME=str(tmp_path), PATH=node_path(home), OPENCLAW_STATE_DIR=str(state),
               OPENCLAW_CONFIG_PATH=str(state / "openclaw.json"), NO_COLOR="1")

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([*command, *args], env=env, cwd=workspace, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"openclaw {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done

    configure(state, upstream.base_url, server, token, workspace, budget)
    installed = run("plugins", "install", "--link", str(PACKAGE), "--force", "--accept-capabilities")
    assert "Linked plugin path" in installed.stdout
    configure(state, upstream.base_url, server, token, workspace, budget)  # keeps what the install wrote
    assert json.loads((state / "openclaw.json").read_text())["plugins"]["entries"]["contextrender"]["enabled"] is True
    return run


@pytest.fixture(scope="module")
def gateway(jac_server, tmp_path_factory):
    """Three turns through the real OpenClaw; yields the fake model, the client and `run`."""
    with FakeUpstream() as upstream, Client(jac_server.url) as client:
        client.register("openclaw-gateway-user", "secret-password-5")
        run = openclaw(tmp_path_factory.mktemp("openclaw"), upstream, jac_server.url, client.token,
                       {f"notes{i}.txt": notes(i) for i in (1, 2)})
        logs = []
        for i, prompt in enumerate(PROMPTS[:3], start=1):
            if i < 3:
                upstream.enqueue(content=None, tool_calls=read_call(i))
            upstream.enqueue(content=f"Done with turn {i}.")
            logs.append(run("agent", "--local", "--session-key", KEY, "--message", prompt, "--json").stderr)
        yield SimpleNamespace(upstream=upstream, client=client, run=run, logs=logs,
                              chats=[r.json["messages"] for r in upstream.requests if r.path.endswith("/chat/completions")])


def test_the_real_openclaw_renders_through_the_plugin_within_b(gateway):
    assert 'context engine "contextrender" owns compaction' in gateway.logs[-1]
    assert "contextrender: history sent unchanged" not in "".join(gateway.logs)
    # Each file was read by OpenClaw's own tool and came back to the model whole in its turn.
    results = [m for chat in gateway.chats for m in chat if m["role"] == "tool"]
    assert any("notes_1 line 59" in str(m["content"]) for m in results)
    last = gateway.chats[-1]
    past = history(last, PROMPTS[2])
    assert past, "OpenClaw sent no history before the third turn"
    assert TOK.history_tokens(past) <= BUDGET
    assert pairing_problems(last) == []
    # Without the engine the history holds both files, well over B: the file results are cut to
    # stubs that name their handles.
    assert TOK.history_tokens([{"role": "tool", "tool_call_id": "x", "content": notes(1) + notes(2)}]) > 2 * BUDGET
    shown = stubs(past)
    assert sorted(shown) == ["callread1", "callread2"] and all(shown.values()), f"both results should be stubs: {past}"
    # OpenClaw's tool search is on (its default): the restore tool is offered beside it, not hidden
    # in its catalog (catalogMode "direct-only").
    offered = [t["function"]["name"] for t in gateway.upstream.requests[-1].json["tools"]]
    assert "contextrender_restore" in offered and "tool_search" in offered, offered
    # The server holds the conversation under OpenClaw's session key, at least what it rendered.
    assert gateway.client.get_session(f"openclaw-{KEY}")["events"] >= len([m for m in past if m["role"] != "user"])


def test_a_restore_through_the_real_openclaw_returns_the_file(gateway):
    """OpenClaw assembles again from the view the plugin returned before every model call of a run
    (integrations/openclaw/test/assemble.test.mjs): the handles must stay those of the stored
    results, from one call and one turn to the next, and a restore must return the file."""
    before = len(gateway.upstream.requests)
    gateway.upstream.enqueue_restore()  # the first handle the request names, as a model reading its stubs
    gateway.upstream.enqueue(content="Done with turn 4.")
    gateway.run("agent", "--local", "--session-key", KEY, "--message", PROMPTS[3], "--json")
    asked, answered = [r.json["messages"] for r in gateway.upstream.requests[before:]]
    shown = stubs(history(asked, PROMPTS[3]))
    assert shown["callread1"], f"the first file should be a stub in turn four: {shown}"
    assert shown == stubs(history(gateway.chats[-1], PROMPTS[2])), "the handles changed between turns"
    call = next(m for m in answered if m.get("tool_calls") and m["tool_calls"][0]["function"]["name"] == "contextrender_restore")
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"handle": shown["callread1"][0]}
    restored = next(m for m in answered if m["role"] == "tool" and m["tool_call_id"] == call["tool_calls"][0]["id"])
    assert restored["content"] == notes(1)
    # The session never forked: every render ingested only what the server had not seen.
    session = gateway.client.get_session(f"openclaw-{KEY}")
    assert session["branch"] == 0, session


TURN_BUDGET = 3000
FIRST_READS = 4  # the first turn's: its history alone is over what the second turn leaves it
TURN_READS = 9


def big_notes(i: int) -> str:
    """A file of about 400 tokens."""
    return "\n".join(f"report_{i} row {j}: counter_{i}_{j} = {j * 17 + i}" for j in range(25))


def test_a_turn_with_many_large_reads_stays_within_b_with_stubs_and_a_restore(jac_server, tmp_path):
    """OpenClaw 2026.9.6 hands assemble only the history before the turn's prompt and appends the
    turn's own messages unrendered: with TURN_READS reads of ~450 tokens in one turn, every model
    call after the third went over B. The plugin's tool-result middleware keeps the
    turn's results within its share of B (whole, cut, or a stub naming a turn handle) and assemble
    renders the history before the turn within what is left: every model call of both turns is
    within B, the stubs name handles, a restore in the turn returns the file, and the next turn's
    render stores the originals, not the stubs."""
    files = {f"report{i}.txt": big_notes(i) for i in range(FIRST_READS + TURN_READS)}
    assert TOK.count(big_notes(0)) > 350 and TURN_READS * TOK.count(big_notes(0)) > TURN_BUDGET
    key = "agent:main:many-reads"
    with FakeUpstream() as upstream, Client(jac_server.url) as client:
        client.register("openclaw-turn-user", "secret-password-6")
        run = openclaw(tmp_path, upstream, jac_server.url, client.token, files, budget=TURN_BUDGET)
        for i in range(FIRST_READS):
            upstream.enqueue(content=None, tool_calls=read_call_of(f"report{i}.txt", str(i)))
        upstream.enqueue(content="First turn done.")
        run("agent", "--local", "--session-key", key, "--message", "Read the first reports.", "--json")
        first = [r.json["messages"] for r in upstream.requests if r.path.endswith("/chat/completions")]
        before = len(upstream.requests)
        for i in range(FIRST_READS, FIRST_READS + TURN_READS):
            upstream.enqueue(content=f"Reading report {i}.", tool_calls=read_call_of(f"report{i}.txt", str(i)))
        # The model asks back the first result of this turn that it met as a stub.
        upstream.enqueue_restore()
        upstream.enqueue(content="Second turn done.")
        log = run("agent", "--local", "--session-key", key, "--message", "Read every report and compare them.", "--json").stderr
        assert "contextrender:" not in log, log[-3000:]
        calls = [r.json["messages"] for r in upstream.requests[before:] if r.path.endswith("/chat/completions")]
        assert len(calls) == TURN_READS + 2
        sizes = [TOK.history_tokens(charged(c, "Read the first reports.")) for c in first]
        sizes += [TOK.history_tokens(charged(c, "compare them")) for c in calls]
        print("model calls' tokens charged to B:", sizes)
        assert max(sizes) <= TURN_BUDGET, sizes
        assert all(pairing_problems(c) == [] for c in first + calls)
        # Without the plugin the last call would hold every file whole; the history before the turn
        # is rendered within what the turn leaves (without that it alone would fill B).
        assert sum(TOK.count(t) for t in files.values()) > TURN_BUDGET
        last = calls[-1]
        start = next(i for i, m in enumerate(last) if m["role"] == "user" and "compare them" in str(m.get("content")))
        earlier = [m for m in last[:start] if m["role"] not in ("system", "developer")]
        own = [m for m in last[start:] if m["role"] in ("assistant", "tool")]
        # The history before the turn alone would fill B (four files and more): it was rendered
        # within what the turn's own messages left.
        assert TOK.history_tokens(earlier) + TOK.history_tokens(own) <= TURN_BUDGET < TOK.history_tokens(earlier) + sum(TOK.count(files[f"report{i}.txt"]) for i in range(FIRST_READS)) + TOK.history_tokens(own)
        results = {m["tool_call_id"]: str(m["content"]) for m in last if m["role"] == "tool"}
        whole = [c for c, text in results.items() if text in files.values()]
        handles = re.findall(r'call contextrender_restore with handle "(turn:[^"]+)"', " ".join(results.values()))
        assert whole and handles, results
        # The restore: the first turn handle the model met, answered with the file, whole.
        restore_call = next(m for m in calls[-1] if m.get("tool_calls") and m["tool_calls"][0]["function"]["name"] == "contextrender_restore")
        asked = json.loads(restore_call["tool_calls"][0]["function"]["arguments"])["handle"]
        assert asked.startswith("turn:")
        answer = results[restore_call["tool_calls"][0]["id"]]
        assert answer in files.values(), answer[:200]
        # The next turn: the server is sent the originals (no fork), and its render is within B.
        before = len(upstream.requests)
        upstream.enqueue(content="Third turn done.")
        run("agent", "--local", "--session-key", key, "--message", "Summarise.", "--json")
        chat = upstream.requests[before].json["messages"]
        assert TOK.history_tokens(charged(chat, "Summarise.")) <= TURN_BUDGET
        session = client.get_session(f"openclaw-{key}")
        assert session["branch"] == 0, session
        # What the server stored is the originals: each result of the third call's history is a
        # file whole or the server's own stub (an r handle), never the turn's cut or its handle.
        for m in chat:
            if m["role"] == "tool" and m["tool_call_id"].startswith("call_read"):
                assert str(m["content"]) in files.values() or re.search(r'handle "r[0-9]+"', str(m["content"])), m
                assert "turn:" not in str(m["content"])


def charged(chat: list[dict], prompt: str) -> list[dict]:
    """What B holds of a call: the history before the turn's prompt and the turn's own calls and
    results (not the system prompt, nor the prompt and the context OpenClaw appends as user
    messages, as the current user message of any render)."""
    start = next(i for i, m in enumerate(chat) if m["role"] == "user" and prompt in str(m.get("content")))
    return [m for m in chat[:start] if m["role"] not in ("system", "developer")] + [m for m in chat[start:] if m["role"] in ("assistant", "tool")]


def read_call_of(path: str, tag: str) -> list[dict]:
    return [{"id": f"call_read_{tag}", "type": "function", "function": {"name": "read", "arguments": json.dumps({"path": path})}}]


def test_a_dead_server_is_logged_at_the_first_turn(tmp_path):
    """A first turn has no history to render; the plugin asks the server whether it is there, so a
    dead server is said at once (it failed open silently until the second turn)."""
    from contextrender.testing.fake_upstream import free_port

    with FakeUpstream() as upstream:
        run = openclaw(tmp_path, upstream, f"http://127.0.0.1:{free_port()}", "", {"a.txt": "hello"})
        upstream.enqueue(content="Hello.")
        log = run("agent", "--local", "--session-key", "agent:main:dead", "--message", "Hi.", "--json").stderr
        assert "contextrender: the server at http://127.0.0.1:" in log and "did not answer" in log, log[-3000:]
        assert len([r for r in upstream.requests if r.path.endswith("/chat/completions")]) == 1  # the turn went on
