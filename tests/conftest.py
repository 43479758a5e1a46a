from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from contextrender import Engine

# The recorded traces the tests run on: a few whole traces that ship with the tests, with their
# source and license (tests/fixtures/traces/README.md), so a fresh clone needs nothing beside it.
TRACES = Path(__file__).resolve().parent / "fixtures" / "traces"


@pytest.fixture
def engine(tmp_path):
    return Engine(tmp_path / "store")


def call(call_id: str, name: str, arguments: dict | str) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def assistant(text: str | None = None, *calls: dict) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def tool(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


# A short coding turn whose calls reuse values of the results before them (a path, a function's
# name): TFA links each call to the result it took them from.
REUSING = [
    user("fix the bug"),
    assistant(None, call("c1", "grep", {"pattern": "bug"})),
    tool("c1", "src/alpha_module.py:12 bug here\nsrc/beta_module.py:40 bug there"),
    assistant(None, call("c2", "read", {"path": "src/alpha_module.py"})),
    tool("c2", "def alpha():\n    return compute_beta_value(1)\n"),
    assistant(None, call("c3", "read", {"path": "src/beta_module.py"}), call("c4", "grep", {"pattern": "compute_beta_value"})),
    tool("c3", "def compute_beta_value(x):\n    return x\n"),
    tool("c4", "src/alpha_module.py:2 compute_beta_value"),
]


def in_new_process(script: str, store: Path) -> Any:
    """Run `script` (Python, with the store's path as sys.argv[1]) in a new interpreter, as after a
    restart or an upgrade, from the project folder; the JSON its last printed line holds."""
    done = subprocess.run([sys.executable, "-c", script, str(store)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_traces(name: str, folder: Path = TRACES) -> list[dict]:
    """The records of a trace file of `folder` (the tests' fixture unless a benchmark names the
    full sets)."""
    with open(folder / name) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def upstream():
    """A scripted fake OpenAI server on loopback that records what it receives."""
    from contextrender.testing.fake_upstream import FakeUpstream

    with FakeUpstream() as fake:
        yield fake


@pytest.fixture(scope="session")
def jac_server(tmp_path_factory):
    """One real server for the session's HTTP tests (bodies over 1 MB are refused, to test 413; a
    body that stalls 10 s gets 408: shorter failed a test's ordinary request at load 10 on 2 cores;
    headers not complete 5 s after a connection opened get 408, to test a slowloris run)."""
    from jacserver import JacServer

    server = JacServer(tmp_path_factory.mktemp("jac_server"), CONTEXTRENDER_MAX_BODY_MB="1", CONTEXTRENDER_BODY_TIMEOUT="10",
                       CONTEXTRENDER_HEADER_TIMEOUT="5").start()
    yield server
    server.stop()


# ---------------------------------------------------------------- recorded traces in other protocols


def anthropic_conversation(messages: list[dict], thinking: bool = True, parallel: int = 1) -> tuple[list[dict], list[dict]]:
    """A chat-completions trace as a Messages request: (`system` blocks, turns). Tool messages
    become `tool_result` blocks of the next user turn (with any user text after them); each
    assistant turn starts with a thinking block signed as the fake upstream signs them, and every
    tenth has a redacted one too. `parallel` > 1 merges that many consecutive tool rounds into
    one turn of parallel calls, answered by one user turn of results plus a text block (as Claude
    Code sends them)."""
    from contextrender.testing.fake_upstream import signature

    system: list[dict] = []
    turns: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content")
        if role == "system":
            system.append({"type": "text", "text": content})
            continue
        if role == "assistant":
            blocks: list[dict] = []
            if thinking:
                reasoning = f"Turn {len(turns)}: deciding the next step."
                blocks.append({"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)})
                if len(turns) % 10 == 1:
                    blocks.append({"type": "redacted_thinking", "data": f"ENCRYPTED{len(turns)}=="})
            if content:
                blocks.append({"type": "text", "text": content})
            for c in message.get("tool_calls") or []:
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])})
            turns.append({"role": "assistant", "content": blocks})
            continue
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": content}
        else:
            block = {"type": "text", "text": content}
        if turns and turns[-1]["role"] == "user":
            turns[-1]["content"].append(block)
        else:
            turns.append({"role": "user", "content": [block]})
    if parallel > 1:
        turns = _parallel(turns, parallel)
    return system, turns


def _parallel(turns: list[dict], size: int) -> list[dict]:
    out: list[dict] = []
    k = 0
    while k < len(turns):
        rounds = []
        while (k + 1 < len(turns) and len(rounds) < size and turns[k]["role"] == "assistant"
               and all(b["type"] == "tool_result" for b in turns[k + 1]["content"])):
            rounds.append((turns[k], turns[k + 1]))
            k += 2
        if len(rounds) < 2:
            out.extend(t for pair in rounds for t in pair)
            if not rounds:
                out.append(turns[k])
                k += 1
            continue
        first = [b for b in rounds[0][0]["content"] if b["type"] in ("thinking", "redacted_thinking")]
        rest = [b for (a, _) in rounds for b in a["content"] if b["type"] not in ("thinking", "redacted_thinking")]
        texts = sorted(rest, key=lambda b: b["type"] == "tool_use")  # text first, then the calls
        out.append({"role": "assistant", "content": first + texts})
        results = [b for (_, u) in rounds for b in u["content"]]
        out.append({"role": "user", "content": results + [{"type": "text", "text": f"<system-reminder>{len(results)} results above.</system-reminder>"}]})
    return out


def responses_input(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """A chat-completions trace as a Responses request: (`instructions`, input items), each
    assistant message as a reasoning item, its text as a message item and its calls."""
    instructions = None
    items: list[dict] = []
    for (i, message) in enumerate(messages):
        role, content = message["role"], message.get("content")
        if role == "system":
            instructions = content
        elif role == "assistant":
            items.append({"id": f"rs_{i}", "type": "reasoning", "summary": [], "encrypted_content": f"gAAAA{i}=="})
            if content:
                items.append({"id": f"msg_{i}", "type": "message", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": content, "annotations": []}]})
            for c in message.get("tool_calls") or []:
                items.append({"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                              "arguments": c["function"]["arguments"], "id": f"fc_{c['id']}", "status": "completed"})
        elif role == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"], "output": content})
        else:
            items.append({"role": "user", "content": content})
    return instructions, items


def trace_prefix(name: str = "mini_swe_agent_deepseek.jsonl", index: int = 0, turns: int = 20) -> list[dict]:
    """A recorded trace up to (not including) its `turns`-th assistant message."""
    messages = load_traces(name)[index]["messages"]
    cut = [i for (i, m) in enumerate(messages) if m["role"] == "assistant"][turns]
    return messages[:cut]


def scripted_tool_loop(upstream, prefix: str, text: Callable[[int], str | None], thinking: Callable[[int], str | None],
                       rounds: int = 4) -> Iterator[tuple[int, str, bool]]:
    """An agent's tool loop as the fake upstream answers it: for each round, one `bash` call with
    its text and reasoning is queued, then (round, call id, whether to stream it: odd rounds) is
    yielded for the test to send the request and append the answer as its agent would."""
    for turn in range(rounds):
        call_id = f"{prefix}_{turn}"
        upstream.enqueue(content=text(turn), thinking=thinking(turn),
                         tool_calls=[call(call_id, "bash", {"command": f"cat file_{turn}.py"})])
        yield turn, call_id, bool(turn % 2)


# ---------------------------------------------------------------- the suite's time, by module


# ---------------------------------------------------------------- the embedded store's file (tests/test_store.py, test_transactions.py)



def recording_tokenizer(tok: Any) -> tuple[Any, list[str]]:
    """A Tokenizer like `tok` whose encoder records each text it encodes (in the list returned with
    it): what the token-count and cut caches' tests count."""
    from engine.measure import Tokenizer

    encoded: list[str] = []

    class Encoder:
        def encode_ordinary(self, value):
            encoded.append(value)
            return tok._enc.encode_ordinary(value)

        def decode(self, ids):
            return tok._enc.decode(ids)

    return Tokenizer(encoding=tok.encoding, scale=tok.scale, _enc=Encoder()), encoded


def db_file(engine: Engine) -> str:
    """The one SQLite file of an Engine's store."""
    files = sorted(engine.store.rglob("*.db"))
    assert len(files) == 1, files
    return str(files[0])


def hold_write_lock(path: str, seconds: float, taken: threading.Event) -> None:
    """Another writer's long commit, by a connection outside this process's turns: the file's
    write lock held for `seconds`."""
    conn = sqlite3.connect(path, timeout=30)
    conn.execute("BEGIN IMMEDIATE")
    taken.set()
    time.sleep(seconds)
    conn.commit()
    conn.close()


def tool_rounds(n: int) -> list[dict]:
    """A task and n small tool rounds, each result with an id of its own."""
    messages = [user("Fix the parser; its tests fail.")]
    for i in range(n):
        messages += [assistant(None, call(f"c{i}", "bash", {"cmd": f"sed -n {i},+9p src/parser.py"})),
                     tool(f"c{i}", f"{i}: def parse_{i}(tokens): return tokens[{i % 7}:]  # ID_{i:05d}")]
    return messages


@pytest.fixture
def big_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], Engine, Engine]:
    """Twelve tool rounds stored in one call by an Engine ("whole"), and a second Engine whose
    session holds only their task so far and whose big flushes write ahead in batches of five:
    (the messages, the whole one, the second one)."""
    from contextrender import store

    messages = tool_rounds(12)
    whole = Engine(tmp_path / "whole")
    whole.ingest("s", messages)
    monkeypatch.setattr(store, "WRITE_AHEAD_BATCH", 5)
    ahead = Engine(tmp_path / "ahead")
    ahead.ingest("s", messages[:1])
    return (messages, whole, ahead)


def pytest_terminal_summary(terminalreporter) -> None:
    """The time each test module took (setup, call and teardown of its tests; the slowest first),
    so that a suite that grows toward CI's limit shows where the time goes."""
    spent: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if hasattr(report, "duration") and getattr(report, "nodeid", ""):
                module = report.nodeid.split("::")[0]
                spent[module] = spent.get(module, 0.0) + report.duration
    if not spent:
        return
    terminalreporter.section("time by module")
    for (module, seconds) in sorted(spent.items(), key=lambda item: -item[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
    terminalreporter.write_line(f"{sum(spent.values()):8.1f} s  all {len(spent)} modules")




# ---------------------------------------------------------------- threads a test left running


def pytest_unconfigure(config) -> None:
    """A test that leaves a non-daemon thread running (a writer looping until told to stop, after a
    failed assertion skipped the telling) would keep the interpreter from exiting after the summary,
    and CI would wait for it until its limit. Idle executor workers end at the interpreter's exit,
    so give the exit a minute; a process still there then names its threads and exits with 3."""

    def end_a_stuck_exit() -> None:
        time.sleep(60)
        stuck = [thread.name for thread in threading.enumerate()
                 if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()]
        sys.stdout.flush()
        sys.stderr.write(f"the tests' process did not exit: threads left running ({', '.join(stuck)})\n")
        sys.stderr.flush()
        os._exit(3)

    threading.Thread(target=end_a_stuck_exit, name="stuck-exit watch", daemon=True).start()
