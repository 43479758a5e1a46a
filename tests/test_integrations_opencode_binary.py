"""The opencode plugin inside the real opencode (opencode-ai 1.18.33's own binary,
tests/opencode_binary.py): integrations/opencode/contextrender.js copied into `.opencode/plugin/`
of a fresh project as docs/integrations.md tells users, a provider of opencode.json pointing at the
fake model on loopback, and a real ContextRender server. Three `opencode run` turns of one session
(two read a file with opencode's own `read` tool): the last model call must show at most B tokens
of history with valid pairing, name each result it leaves out by its handle (a stub, or the fold
index's entry), and offer `contextrender_restore`;
the server holds the session under opencode's session id. A fourth turn's model calls the restore
tool, which must answer with the file as opencode's `read` gave it. With the server down, a run
completes with opencode's own history and says so on stderr, and so does one with a server that
never answers, after CONTEXTRENDER_TIMEOUT. No connection leaves loopback: every
proxy-aware request is sent to a loopback trap that must stay empty."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from contextrender.testing.fake_upstream import FakeUpstream, free_port, named_handles
from contextrender.testing.checks import pairing_problems
from contextrender.client import Client
from engine.measure import get_tokenizer
from tests.integration_runs import handles_of, history_of, unnamed
from tests.opencode_binary import ProxyTrap, binary, offline_env, plugin_dependencies
from tests.test_integrations_opencode import silent_server

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "integrations" / "opencode" / "contextrender.js"
TOK = get_tokenizer()
BUDGET = 600
# A file of about 420 tokens as opencode reads it: one fits B beside the task, the fold marker and the
# turn that restores it, two do not. (At 25 lines, 525 tokens, a restored file no longer fits beside
# them, 662 > 600 tokens: the model's next call shows it cut in the middle to what B leaves, under a
# note naming its handle; tests/test_render.py checks that cut.)
LINES = 20
HANDLE = re.compile(r'call contextrender_restore with handle "([rp][0-9]+)"')
PROMPTS = ["Turn one: read notes1.txt and summarise it.", "Turn two: read notes2.txt and summarise it.",
           "Turn three: what did the two files say?", "Turn four: show the first file again."]
# opencode's switches for a run without a terminal: no title request to the model (it would take
# the fake model's scripted answer), JSON events on stdout (they carry the session id).
RUN = ["run", "--print-logs", "--log-level", "INFO", "--format", "json", "--title", "contextrender test"]


def notes(i: int) -> str:
    return "\n".join(f"notes_{i} line {j}: the value of setting_{j} is {j * i}" for j in range(LINES))


def read_call(project: Path, i: int) -> list[dict]:
    arguments = json.dumps({"filePath": str(project / f"notes{i}.txt")})
    return [{"id": f"call_read_{i}", "type": "function", "function": {"name": "read", "arguments": arguments}}]


def chats(upstream: FakeUpstream) -> list[list[dict]]:
    return [r.json["messages"] for r in upstream.requests if r.path.endswith("/chat/completions")]


def text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def history(chat: list[dict], prompt: str) -> list[dict]:
    """What came before the current turn (after the system prompt) in a chat-completions request."""
    start = next(i for i, m in enumerate(chat) if m["role"] == "user" and prompt in text(m))
    return [m for m in chat[:start] if m["role"] not in ("system", "developer")]


def project_with_plugin(root: Path, upstream: str) -> tuple[Path, Path]:
    """A HOME and a project with the plugin copied in as docs/integrations.md says, and opencode.json."""
    home, project = root / "home", root / "project"
    (project / ".opencode" / "plugin").mkdir(parents=True)
    shutil.copy(PLUGIN, project / ".opencode" / "plugin" / PLUGIN.name)
    for folder in (project / ".opencode", home / ".config" / "opencode"):  # opencode installs into both
        plugin_dependencies(folder)
    for i in (1, 2):
        (project / f"notes{i}.txt").write_text(notes(i))
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"fake": {"npm": "@ai-sdk/openai-compatible", "name": "Fake model",
                              "options": {"baseURL": upstream, "apiKey": "sk-fake"},
                              "models": {"fake-model": {"name": "Fake model", "limit": {"context": 200000, "output": 4096}}}}},
        "model": "fake/fake-model",
        "compaction": {"auto": False, "prune": False},  # as docs/integrations.md tells users
        "autoupdate": False, "share": "disabled",
    }
    (project / "opencode.json").write_text(json.dumps(config, indent=2))
    return home, project


def over_b(sent: list[list[dict]]) -> list[int]:
    """The model calls whose history (all but the system prompt and a last user message) is over B."""
    return [i for i, chat in enumerate(sent) if TOK.history_tokens(history_of({"messages": chat})) > BUDGET]


def stubbed(chat: list[dict]) -> dict[str, str]:
    """The handles the stubs among `chat`'s tool messages name, each with its call id."""
    return {h: m["tool_call_id"] for m in chat if m["role"] == "tool" for h in HANDLE.findall(text(m))}


def session_of(stdout: str) -> str:
    ids = {json.loads(line).get("sessionID") for line in stdout.splitlines() if line.startswith("{")}
    ids.discard(None)
    assert len(ids) == 1, f"expected one session id in opencode's events, got {ids}:\n{stdout[-2000:]}"
    return ids.pop()


@pytest.fixture(scope="module")
def opencode(jac_server, tmp_path_factory):
    """Three turns through the real opencode; yields what the tests look at, and `run`."""
    exe = binary()
    trap = ProxyTrap()
    with FakeUpstream() as upstream, Client(jac_server.url) as client:
        client.register("opencode-binary-user", "secret-password-6")
        home, project = project_with_plugin(tmp_path_factory.mktemp("opencode"), upstream.base_url)
        base_env = offline_env(home, project, trap.url)
        env = dict(base_env, CONTEXTRENDER_URL=jac_server.url, CONTEXTRENDER_TOKEN=client.token,
                   CONTEXTRENDER_BUDGET=str(BUDGET))

        def run(*args: str, environment: dict | None = None) -> subprocess.CompletedProcess:
            done = subprocess.run([str(exe), *RUN, "--dir", str(project), *args], env=environment or env,
                                  cwd=project, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, f"opencode run {args} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            return done

        logs, events, session = [], [], None
        for i, prompt in enumerate(PROMPTS[:3], start=1):
            if i < 3:
                upstream.enqueue(content=None, tool_calls=read_call(project, i))
            upstream.enqueue(content=f"Done with turn {i}.")
            done = run(*(["--session", session] if session else []), prompt)
            session = session or session_of(done.stdout)
            assert session_of(done.stdout) == session
            logs.append(done.stderr)
            events += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        # What opencode's read tool gave, by call id (its `tool_use` events).
        outputs = {e["part"]["callID"]: e["part"]["state"]["output"] for e in events if e.get("type") == "tool_use"}
        yield SimpleNamespace(upstream=upstream, client=client, run=run, logs=logs, session=session, outputs=outputs,
                              project=project, base_env=base_env, trap=trap)
    trap.close()


@pytest.fixture(autouse=True)
def answers_all_asked_for(opencode):
    """Each test's run asks the fake model for every answer it enqueued: one left over (a run that
    ended early, as when the fake model found no handle to restore) would answer the next test's
    run in place of its own, and that test would fail too; this one fails instead, and the next
    starts with none."""
    yield
    left = opencode.upstream.discard_enqueued()
    assert left == 0, f"{left} scripted answer(s) of the fake model were never asked for"


def test_the_real_opencode_renders_through_the_plugin_within_b(opencode):
    assert "contextrender: history sent unchanged" not in "".join(opencode.logs), opencode.logs[-1][-3000:]
    # opencode's own read tool read each file whole; one fits in B, the two do not.
    for i in (1, 2):
        assert f"notes_{i} line {LINES - 1}" in opencode.outputs[f"call_read_{i}"]
    sizes = [TOK.count(opencode.outputs[f"call_read_{i}"]) for i in (1, 2)]
    assert max(sizes) < BUDGET < sum(sizes), sizes
    assert over_b(chats(opencode.upstream)) == []
    last = chats(opencode.upstream)[-1]
    past = history(last, PROMPTS[2])
    assert past, "opencode sent no history before the third turn"
    assert TOK.history_tokens(past) <= BUDGET, json.dumps(past)[:3000]
    assert pairing_problems(last) == []
    # The task (the first prompt) stays in view first: above ContextRender's marker when the oldest
    # turn is folded, else above its own turn; a result left out is named by its handle, in a stub
    # under its call or in the fold index.
    assert PROMPTS[0] in text(past[0])
    assert f"left out to fit the {BUDGET}-token history budget" in text(past[1]) or past[1]["tool_calls"][0]["id"] == "call_read_1"
    owners = handles_of(opencode.client, f"opencode-{opencode.session}")
    assert named_handles({"messages": past}), f"the history names no handle: {json.dumps(past)[:3000]}"
    assert unnamed({"messages": past}, opencode.outputs, owners) == [], json.dumps(past)[:3000]
    for handle, call_id in stubbed(past).items():
        assert TOK.count(opencode.outputs[call_id]) > TOK.count(text(next(m for m in past if m.get("tool_call_id") == call_id)))
    assert "contextrender_restore" in [t["function"]["name"] for t in opencode.upstream.requests[-1].json["tools"]]
    # The server holds the conversation under opencode's own session id.
    assert opencode.session.startswith("ses_")
    assert opencode.client.get_session(f"opencode-{opencode.session}")["events"] >= len([m for m in past if m["role"] != "user"])


def test_a_restore_through_the_real_opencode_returns_the_file(opencode):
    opencode.upstream.enqueue_restore()  # the first handle the request names, as a model reading its stubs
    opencode.upstream.enqueue(content="Done with turn 4.")
    done = opencode.run("--session", opencode.session, PROMPTS[3])
    asked = opencode.upstream.requests[-2].json
    assert "contextrender_restore" in [t["function"]["name"] for t in asked["tools"]]
    handle = named_handles(asked)[0]  # what the fake model restores: a stub's, else the fold index's first
    call_id = next(c for (c, h) in handles_of(opencode.client, f"opencode-{opencode.session}").items() if h == handle)
    last = chats(opencode.upstream)[-1]
    assert over_b(chats(opencode.upstream)) == []
    assert pairing_problems(last) == []
    answered = [m for m in last if m["role"] == "tool" and m["tool_call_id"].startswith("call_restore_")]
    assert answered, f"the restore call got no result:\n{done.stderr[-3000:]}"
    # The restore tool answered with the file as opencode's read tool gave it, whole,
    # and the model's next call shows it.
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    restored = [e["part"]["state"] for e in events if e.get("type") == "tool_use" and e["part"]["tool"] == "contextrender_restore"]
    assert [r["output"] for r in restored] == [opencode.outputs[call_id]], restored
    assert text(answered[-1]) == opencode.outputs[call_id]


def test_with_contextrender_down_the_real_opencode_sends_its_own_history(opencode):
    env = dict(opencode.base_env, CONTEXTRENDER_URL=f"http://127.0.0.1:{free_port()}", CONTEXTRENDER_BUDGET=str(BUDGET))
    before = len(opencode.upstream.requests)
    opencode.upstream.enqueue(content=None, tool_calls=read_call(opencode.project, 2))
    opencode.upstream.enqueue(content="Done without ContextRender.")
    done = opencode.run("Read notes2.txt without ContextRender.", environment=env)
    assert "contextrender: history sent unchanged" in done.stderr
    assert "Done without ContextRender." in done.stdout
    sent = chats(opencode.upstream)[before:]
    assert len(sent) == 2
    # opencode's own messages went through: the whole file came back to the model.
    assert any(f"notes_2 line {LINES - 1}" in text(m) for m in sent[-1] if m["role"] == "tool")
    assert pairing_problems(sent[-1]) == []


def test_with_contextrender_hung_the_real_opencode_goes_on_after_the_timeout(opencode):
    """A server that takes the connection and never answers held opencode's model call for good
    before CONTEXTRENDER_TIMEOUT (tests/test_integrations_opencode.py has the plugin-level test)."""
    with silent_server() as url:
        env = dict(opencode.base_env, CONTEXTRENDER_URL=url, CONTEXTRENDER_TIMEOUT="2", CONTEXTRENDER_BUDGET=str(BUDGET))
        opencode.upstream.enqueue(content="Done while ContextRender hangs.")
        done = opencode.run("Say hello while ContextRender hangs.", environment=env)
    assert "contextrender: history sent unchanged (no answer from" in done.stderr
    assert "Done while ContextRender hangs." in done.stdout


def test_the_real_opencode_stayed_on_loopback(opencode):
    """Every request past loopback would have gone to the proxy trap (models.dev, updates, npm)."""
    assert opencode.trap.requests == []
