"""The session index's size estimate (`SessionIndex.size_bytes`, which the index cache's
CONTEXTRENDER_INDEX_CACHE_MB bound counts in) against what Python allocates for the index.

    .venv/bin/python benchmarks/index_memory.py [--results 10,20,40] [--trace FILE]

For each history size, an index is rebuilt from the store under tracemalloc and its estimate is
divided by the bytes held after the rebuild; prints each ratio and their median (1.0 is exact).
Histories are the first mini-SWE trace's real tool results (../shared/traces beside the
checkout, else the tests' fixture), cut after that many results. This was a test; a ratio of
allocations depends on the Python build and on what else the process holds, so it is measured
here instead of asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contextrender import Engine  # noqa: E402
from engine.index import SESSION_CACHE  # noqa: E402

SHARED = ROOT.parent / "shared" / "traces" / "mini_swe_agent_deepseek.jsonl"
FIXTURE = ROOT / "tests" / "fixtures" / "traces" / "mini_swe_agent_deepseek.jsonl"


def swe_history(messages: list[dict], results: int) -> list[dict]:
    """The system prompt, the history up to the `results`-th tool result, then a user turn."""
    history = [m for m in messages if m["role"] != "system"]
    calls = [i for (i, m) in enumerate(history) if m["role"] == "tool"]
    if results > len(calls):
        raise SystemExit(f"the trace has {len(calls)} tool results, fewer than {results}")
    return messages[:1] + history[: calls[results - 1] + 1] + [{"role": "user", "content": "Continue."}]


def ratio(engine: Engine, session: str, messages: list[dict]) -> tuple[int, int]:
    """(estimate, bytes held) for the index of `messages`, rebuilt from the store."""
    for key in list(SESSION_CACHE._indexes):
        SESSION_CACHE.drop(key)
    engine.render(session, messages, budget=3000)
    SESSION_CACHE.drop(next(iter(SESSION_CACHE._indexes)))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    engine.render(session, messages, budget=3000)  # rebuilds the index from the store
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return next(iter(SESSION_CACHE._indexes.values())).size_bytes(), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="10,20,40", help="history sizes in tool results (comma-separated)")
    parser.add_argument("--trace", type=Path, default=SHARED if SHARED.exists() else FIXTURE)
    args = parser.parse_args()
    with open(args.trace) as f:
        messages = json.loads(f.readline())["messages"]
    engine = Engine(tempfile.mkdtemp(prefix="index-memory-"))
    ratios = []
    print(f"trace: {args.trace.name} (first record)")
    for results in [int(n) for n in args.results.split(",")]:
        estimate, held = ratio(engine, f"memory-{results}", swe_history(messages, results))
        ratios.append(estimate / held)
        print(f"{results:>4} results: estimate {estimate:>10,} B, allocated {held:>10,} B, ratio {estimate / held:.2f}")
    print(f"median ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
