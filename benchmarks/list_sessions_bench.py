"""`list_sessions` with many sessions stored.

    .venv/bin/python benchmarks/list_sessions_bench.py [--sessions 600] [--repeat 7] [--renders 5] [--server]

Fills an in-process store with `--sessions` sessions, each as an agent leaves it: a 6 KB system
prompt, ten events of a tau-bench conversation and `--renders` renders (each a render-log entry
and the stored figures), then times `Engine.list_sessions()` `--repeat` times (each a new
execution context that loads what it reads from the store, as every call does) and prints the
median and the fastest (target: median <= 100 ms at 600 sessions). `--server` does the same through
a real server (`jac start contextrender.jac` on loopback, its own store) with a `Client` of one
user, so the time includes HTTP, the login check and the request guard.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from contextrender import Client, Engine

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def conversation() -> list[dict]:
    with open(TRACES / "tau_bench.jsonl") as f:
        messages = json.loads(f.readline())["messages"]
    system = [m for m in messages if m["role"] == "system"][:1] or [{"role": "system", "content": ""}]
    system[0] = dict(system[0], content=(system[0]["content"] * 10)[:6000])
    chain = [m for m in messages if m["role"] != "system"]
    end = 10
    while end < len(chain) and chain[end - 1]["role"] == "assistant" and chain[end - 1].get("tool_calls"):
        end += 1  # stop after a call's answer
    return system + chain[:end]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=600)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--renders", type=int, default=5)
    parser.add_argument("--store", type=Path, help="a store filled by an earlier run (filled here if empty)")
    parser.add_argument("--server", action="store_true", help="through a real server and a Client")
    args = parser.parse_args()
    messages = conversation()
    with tempfile.TemporaryDirectory(prefix="list-sessions-") as folder:
        if args.server:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from jacserver import JacServer

            server = JacServer(Path(folder) / "server").start()
            try:
                engine = Client(server.url)
                engine.register("lister", "a-Bench-password-9")
                measure(engine, messages, args)
            finally:
                server.stop()
        else:
            measure(Engine(args.store or folder), messages, args)


def measure(engine: Engine | Client, messages: list[dict], args: argparse.Namespace) -> None:
    """Fill `engine` (an Engine, or a Client of a server: the same methods) and time its listing."""
    stored = len(engine.list_sessions())
    start = time.perf_counter()
    for n in range(stored, args.sessions):
        session = f"agent-{n}"
        engine.ingest(session, messages)
        for k in range(args.renders):
            engine.render(session, budget=1500 + 100 * k)
    print(f"filled {args.sessions - stored} sessions in {time.perf_counter() - start:.1f} s", flush=True)
    samples = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        listed = engine.list_sessions()
        samples.append(time.perf_counter() - start)
    assert len(listed) == args.sessions, len(listed)
    print(f"list_sessions, {args.sessions} sessions stored: median {statistics.median(samples) * 1000:.1f} ms, "
          f"fastest {min(samples) * 1000:.1f} ms (n={args.repeat})")


if __name__ == "__main__":
    main()
