"""Does the restore tool's `query` find what a model needs? Measured on recorded traces.

    .venv/bin/python -u benchmarks/search_bench.py ../shared/traces/swe_agent_demos.jsonl:6000 \
        ../shared/traces/mini_swe_agent_deepseek.jsonl:6000 ../shared/traces/tau_bench.jsonl:1000 --limit 12

Each trace is replayed turn by turn through the `Engine` as `contextrender replay` does (selector
contextrender at the budget after the file's colon), so that results are left out. At every
recorded assistant turn that reuses a result (a B.4 reuse event) whose complete text is not in the
rendered history, the session is searched (`Engine.search_results`, the `search_results` walker the
restore tool's `query` form calls) with what a model at that turn would know of the result:

- `call`: the tool name and the arguments of the call that produced it (`read_file src/a.py`),
- `step`: the later step's own words (the turn's text and the arguments of its calls; a model
  writing that step has them in mind), cut to its first `--step-words` words (0: all),
- `both`: the two together.

A search counts as found when the result's handle is among the first `--top` answers (3). The
script prints, per trace file and per query kind, the searches made, found at 1 and found at
`--top`, the median time of one search (in-process, ms), and the settings it ran with; and, beside the `step` row, the share of its searches
whose turn reuses no more than `--top` results not in view: a step that reuses five such results
names all five, and only three fit the first three answers (that share bounds what a `step`
query can find). `--skip N` starts each file after its first N traces (a check on traces the
search's weights were not chosen on). Nothing is written by a search (a search is not a restore),
so the later renders are those of the replay.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contextrender import Engine  # noqa: E402
from contextrender.core import content_text  # noqa: E402
from contextrender_eval.evaluate import result_handles, reuse_events, visible_results  # noqa: E402
from contextrender_eval.replay import assistant_turns, load_traces  # noqa: E402

KINDS = ("call", "step", "both")


def call_words(call: dict) -> str:
    """What a model knows of a call it made: the tool's name and its arguments' values."""
    function = call.get("function") or {}
    arguments = function.get("arguments") or ""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = arguments
    if isinstance(parsed, dict):
        values = " ".join(v if isinstance(v, str) else json.dumps(v) for v in parsed.values())
    else:
        values = str(parsed)
    return f"{function.get('name') or ''} {values}".strip()


def step_words(message: dict, words: int) -> str:
    """The later step's own words: its text and its calls' arguments (the first `words`; 0: all)."""
    parts = [content_text(message.get("content"))]
    parts += [call_words(c).split(" ", 1)[-1] for c in message.get("tool_calls") or []]
    split = " ".join(parts).split()
    return " ".join(split[:words] if words else split)


def queries(call: dict, later: dict, words: int) -> dict[str, str]:
    (made, step) = (call_words(call), step_words(later, words))
    return {"call": made, "step": step, "both": f"{made} {step}"}


def bench(path: str, budget: int, limit: int, top: int, words: int, skip: int = 0) -> dict[str, collections.Counter]:
    counts: dict = {kind: collections.Counter() for kind in KINDS} | {"ms": {}}
    traces = load_traces([path], limit + skip if limit else 0)[skip:]
    for number, trace in enumerate(traces):
        messages = trace["messages"]
        calls = {c["id"]: c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []}
        originals = {m["tool_call_id"]: m.get("content") for m in messages if m.get("role") == "tool"}
        handles = result_handles(messages)
        events = collections.defaultdict(list)
        for event in reuse_events(messages):
            events[event.turn].append(event)
        engine = Engine(tempfile.mkdtemp(prefix="search-bench-"))
        for (j, later) in assistant_turns(engine, "t", messages):
            if not events[j]:
                continue
            visible = visible_results(engine.render("t", budget=budget, selector="contextrender").messages, originals)
            missing = [e for e in events[j] if e.call_id not in visible and e.call_id in calls]
            for event in missing:
                counts["step"]["few enough"] += int(len(missing) <= top)
                for (kind, query) in queries(calls[event.call_id], later, words).items():
                    counted = counts[kind]
                    counted["searches"] += 1
                    if len([w for w in query.split() if len(w.strip("\"'`,;:()[]{}<>?!")) >= 2]) == 0:
                        counted["no query"] += 1
                        continue
                    started = time.perf_counter()
                    found = [m["handle"] for m in engine.search_results("t", query, limit=top)["matches"]]
                    counts["ms"].setdefault(kind, []).append(1000 * (time.perf_counter() - started))
                    rank = found.index(handles[event.call_id]) + 1 if handles[event.call_id] in found else 0
                    counted["at 1"] += int(rank == 1)
                    counted[f"at {top}"] += int(rank >= 1)
        print(f"{Path(path).stem}: trace {number + 1}/{len(traces)} done", file=sys.stderr, flush=True)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="a trace file and the budget to replay it at: FILE.jsonl:BUDGET")
    parser.add_argument("--limit", type=int, default=12, help="the first N traces of each file (0: all)")
    parser.add_argument("--top", type=int, default=3, help="found when the handle is among the first N answers")
    parser.add_argument("--step-words", type=int, default=0, help="the later step's first N words (0: all)")
    parser.add_argument("--skip", type=int, default=0, help="skip the first N traces of each file")
    args = parser.parse_args()
    rows = []
    for spec in args.traces:
        (path, _, budget) = spec.rpartition(":")
        if not path or not budget.isdigit():
            parser.error(f"give each trace file with its budget, such as traces.jsonl:6000 (got {spec!r})")
        counts = bench(path, int(budget), args.limit, args.top, args.step_words, args.skip)
        for kind in KINDS:
            c = counts[kind]
            n = c["searches"]
            share = lambda k: 100 * c[k] / n if n else 0.0  # noqa: E731
            bound = f"{share('few enough'):.1f}" if kind == "step" else ""
            ms = counts["ms"].get(kind, [])
            rows.append((Path(path).stem, int(budget), kind, n, share("at 1"), share(f"at {args.top}"), bound,
                         statistics.median(ms) if ms else 0.0))
    print(f"settings: traces {args.skip + 1} to {args.skip + args.limit if args.limit else 'the last'} of each file, found = handle in the first {args.top} answers, "
          f"step words {args.step_words or 'all'}; selector contextrender")
    print(f"{'traces':28} {'B':>6} {'query':>6} {'searches':>9} {'at 1 %':>7} {f'at {args.top} %':>7} {'bound %':>8} {'ms':>6}")
    for (name, budget, kind, n, first, within, bound, ms) in rows:
        print(f"{name:28} {budget:>6} {kind:>6} {n:>9} {first:>7.1f} {within:>7.1f} {bound:>8} {ms:>6.1f}")


if __name__ == "__main__":
    main()
