"""The Hermes plugin (integrations/hermes) in real Hermes Agent 0.19.0 conversations: AIAgent with
its own read_file tool, the plugin loaded from its entry point, the fake upstream on loopback.
Hermes runs in its own venv (tests/hermes_venv.py: the `[hermes]` extra; its PyJWT pin refuses jac-scale's)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from contextrender.testing.checks import pairing_problems
from contextrender.local import Engine
from contextrender.testing.fake_upstream import FakeUpstream
from contextrender.tools import RESTORE_TOOL
from tests.conftest import call
from tests.hermes_venv import hermes_python
from tests.integration_runs import HANDLE, TOK, history_of

ROOT = Path(__file__).resolve().parent.parent
CONTEXT_LENGTH = 64000  # Hermes refuses less
SHARE = "0.0625"  # of Hermes's context length: B = 4,000 (the default share, 0.5, would not force omissions here)
BUDGET = int(CONTEXT_LENGTH * float(SHARE))
READS = 12


@pytest.fixture(scope="module")
def python() -> Path:
    return hermes_python()


def hermes_home(tmp_path: Path) -> Path:
    home = tmp_path / "hermes"
    home.mkdir()
    (home / "config.yaml").write_text(
        f"model:\n  context_length: {CONTEXT_LENGTH}\n"
        "plugins:\n  enabled: [contextrender]\n"
        "context:\n  engine: contextrender\n"
    )
    return home


def files(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    for i in range(READS):
        (work / f"f{i}.py").write_text("\n".join(f"value_{i}_{j} = compute_{j}()" for j in range(30)) + "\n")
    return work


def run(python: Path, upstream, home: Path, work: Path, *turns: str, **env: str) -> dict:
    done = subprocess.run([str(python), str(ROOT / "integrations" / "hermes" / "test" / "conversation.py"), upstream.base_url, *turns],
                          cwd=work, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HERMES_HOME=str(home), CONTEXTRENDER_BUDGET_SHARE=SHARE, **env))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


def chat_requests(upstream) -> list[dict]:
    return [r.json for r in upstream.requests if r.path == "/v1/chat/completions"]


def test_a_hermes_run_sees_at_most_b_keeps_its_history_and_restores(python, upstream, tmp_path):
    home, work = hermes_home(tmp_path), files(tmp_path)
    for i in range(READS):
        upstream.enqueue(content=f"Reading {i}.", tool_calls=[call(f"call_{i}", "read_file", {"path": str(work / f"f{i}.py")})])
    upstream.enqueue(content="All read.")
    out = run(python, upstream, home, work, "Read the twelve files.")
    assert out["final"] == "All read." and out["engine"] == "contextrender"
    assert RESTORE_TOOL in out["tools"]
    requests = chat_requests(upstream)
    assert len(requests) == READS + 1
    for body in requests:
        assert TOK.history_tokens(history_of(body)) <= BUDGET
        assert pairing_problems(body["messages"]) == []
        assert RESTORE_TOOL in [t["function"]["name"] for t in body["tools"]]
    store = Engine(home / "contextrender")
    session = f"hermes-{out['session_id']}"
    stored = store.get_session(session, include_messages=True)
    results = [m for m in stored["messages"] if m["role"] == "tool"]
    assert len(results) == READS  # every result stored whole, named by Hermes's session id
    assert TOK.history_tokens([m for m in stored["messages"] if m["role"] != "system"]) > BUDGET
    handles = HANDLE.findall(" ".join(str(m.get("content")) for m in requests[-1]["messages"]))
    assert handles, "the last request should show stubs that name their handles"
    stub = next(m for m in requests[-1]["messages"] if m["role"] == "tool" and handles[0] in str(m["content"]))
    original = next(m["content"] for m in results if m["tool_call_id"] == stub["tool_call_id"])
    assert f"value_{stub['tool_call_id'].split('_')[1]}_29 = compute_29()" in original  # Hermes's read_file output, whole
    store.close()


class ReadingUpstream(FakeUpstream):
    """The fake upstream, reading as a model would: a scripted restore call whose handle is "?"
    gets the first handle a stub names in the request it answers."""

    def _next(self):
        number, script = super()._next()
        for c in script.tool_calls:
            if c["function"]["name"] == RESTORE_TOOL and json.loads(c["function"]["arguments"]) == {"handle": "?"}:
                named = HANDLE.findall(" ".join(str(m.get("content")) for m in self.requests[-1].json["messages"]))
                c["function"]["arguments"] = json.dumps({"handle": named[0] if named else "none"})
        return number, script


def test_a_scripted_restore_in_the_same_conversation_returns_the_original(python, tmp_path):
    home, work = hermes_home(tmp_path), files(tmp_path)
    with ReadingUpstream() as upstream:
        for i in range(READS):
            upstream.enqueue(content=f"Reading {i}.", tool_calls=[call(f"call_{i}", "read_file", {"path": str(work / f"f{i}.py")})])
        upstream.enqueue(content=None, tool_calls=[call("call_restore", RESTORE_TOOL, {"handle": "?"})])
        upstream.enqueue(content="Restored.")
        out = run(python, upstream, home, work, "Read the twelve files, then look at one again.")
        requests = chat_requests(upstream)
    assert out["final"] == "Restored."
    asked = requests[READS]["messages"]
    handle = HANDLE.findall(" ".join(str(m.get("content")) for m in asked))[0]
    stub = next(m for m in asked if m["role"] == "tool" and handle in str(m["content"]))
    last = requests[-1]
    answer = next(m for m in last["messages"] if m["role"] == "tool" and m["tool_call_id"] == "call_restore")
    store = Engine(home / "contextrender")
    stored = store.get_session(f"hermes-{out['session_id']}", include_messages=True)["messages"]
    store.close()
    original = next(m["content"] for m in stored if m.get("tool_call_id") == stub["tool_call_id"])
    assert json.loads(answer["content"]) == {"handle": handle, "result": original}
    assert TOK.history_tokens(history_of(last)) <= BUDGET and pairing_problems(last["messages"]) == []


def test_contextrender_down_the_run_completes_with_hermess_own_request(python, upstream, tmp_path):
    home, work = hermes_home(tmp_path), files(tmp_path)
    for i in range(3):
        upstream.enqueue(content=f"Reading {i}.", tool_calls=[call(f"call_{i}", "read_file", {"path": str(work / f"f{i}.py")})])
    upstream.enqueue(content="Done without ContextRender.")
    # The backend is a server that is not there.
    out = run(python, upstream, home, work, "Read three files.", CONTEXTRENDER_URL="http://127.0.0.1:9")
    assert out["final"] == "Done without ContextRender."
    last = chat_requests(upstream)[-1]["messages"]
    assert sum(1 for m in last if m["role"] == "tool") == 3
    assert out["stderr"].count("contextrender: history sent unchanged") >= 4
