"""Per-call latency with two server processes against one, on the same store (docs/scale-out.md).

    .venv/bin/python benchmarks/scale_out_bench.py [--turns 30] [--sessions 4] [--sqlite]
    .venv/bin/python benchmarks/scale_out_bench.py --cluster DIR   # a cluster scale_out.sh started

Starts Redis, the MongoDB stand-in and two servers with scripts/scale_out.sh (and stops them), or
uses a running cluster. An agent loop per session: at each turn one tool call and its result join
the list, which is sent whole to render_context (budget 2,000: renders select from turn 10 or so).
`one`: every call of the session on the first server; `two`: the calls alternate between the two
servers, the worst case for the caches (every call finds its index written by the other process
and rebuilds it from the store). The two kinds run alternated, call by call, on sessions of their
own; the figures are medians of the per-call wall time seen by the client, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402

from cluster import Cluster  # noqa: E402


def turn_messages(turn: int, messages: list[dict]) -> list[dict]:
    cid = f"call_{turn}"
    arguments = json.dumps({"path": f"src/module_{turn % 7}.py", "ref": f"SYM_{max(turn - 3, 0):04d}"})
    return messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": {"name": "read_file", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": cid, "content": f"module {turn} defines SYM_{turn:04d} " + "code line\n" * 80},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=4, help="sessions of each kind (run one after another)")
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--sqlite", action="store_true", help="the stand-in on its SQLite engine (default: memory)")
    parser.add_argument("--cluster", type=Path, help="a cluster already started with scale_out.sh --dir DIR")
    args = parser.parse_args()

    if args.cluster:
        cluster = Cluster(args.cluster)
        cluster.state = cluster.read_state()
        owned = False
    else:
        cluster = Cluster(Path(tempfile.mkdtemp(prefix="scale_out_bench_")), servers=2, sqlite=args.sqlite).start()
        owned = True
    try:
        first, second = cluster.urls[:2]
        http = httpx.Client(timeout=120)
        name = f"bench_{uuid.uuid4().hex[:8]}"
        account = {"identities": [{"type": "username", "value": name}], "credential": {"type": "password", "password": "secret-password-1"}}
        http.post(f"{first}/user/register", json=account).raise_for_status()
        login = {"identity": {"type": "username", "value": name}, "credential": {"type": "password", "password": "secret-password-1"}}
        token = http.post(f"{first}/user/login", json=login).json()["data"]["token"]
        headers = {"Authorization": f"Bearer {token}"}
        times: dict[str, list[float]] = {"one": [], "two": []}
        modes = {"one": [first, first], "two": [first, second]}
        for s in range(args.sessions):
            messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": f"Fix the bug in SYM_0001 (run {s})."}]
            for turn in range(args.turns):
                messages = turn_messages(turn, messages)
                # Alternated call by call, the order swapped every turn.
                for mode in (("one", "two") if turn % 2 == 0 else ("two", "one")):
                    url = modes[mode][turn % 2]
                    body = {"session_id": f"{mode}-{s}", "messages": messages, "budget": args.budget}
                    started = time.perf_counter()
                    response = http.post(f"{url}/walker/render_context", json=body, headers=headers)
                    elapsed = (time.perf_counter() - started) * 1000
                    response.raise_for_status()
                    if turn > 0:  # the first call creates the session
                        times[mode].append(elapsed)
        one, two = statistics.median(times["one"]), statistics.median(times["two"])
        store = "SQLite" if args.sqlite else "memory"
        print(f"render_context, {args.sessions} sessions x {args.turns} turns, budget {args.budget}, stand-in on its {store} engine")
        for mode in ("one", "two"):
            values = sorted(times[mode])
            print(f"  {mode}: median {statistics.median(values):.1f} ms, p90 {values[int(0.9 * (len(values) - 1))]:.1f} ms ({len(values)} calls)")
        print(f"  two / one: {two / one:.2f}x")
    finally:
        if owned:
            cluster.stop()


if __name__ == "__main__":
    main()
