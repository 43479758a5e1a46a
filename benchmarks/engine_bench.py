"""Engine speed: render latency after ingestion (150 and 10,000 results) and ingestion throughput.

    .venv/bin/python benchmarks/engine_bench.py [--repeat N] [--sizes 150] [--per-call-only]
    .venv/bin/python benchmarks/engine_bench.py --ingest-only [--traces 3] [--checkout PATH --alternate 3]

Prints medians measured in this run. Histories are built from the real tool results of
../shared/traces/mini_swe_agent_deepseek.jsonl, cycled to reach the target size. `--traces N`
adds the N longest of those coding sessions as recorded, each ingested in one call and in rounds
of 20 messages. `--checkout PATH` runs the same rows in a process of another checkout (its
.venv), alternated with this one's `--alternate` times.

Each ingestion row runs in a fresh process of its own, with the caches a server has after its
start (`Engine.warm_up` and one small call of another session): the tokenizer's counts, the
embedder's words and TFA's values are those of that row's texts alone. `--shared-process` runs
them all in this process instead, in order, the computation row first, as before: its texts are
the first ingest row's, so those rows then meet caches warmed by the rows before them (the
figures measured before 2026-12-06 15:00 UTC are of that kind).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkouts import REPO, in_turn, run_in, without
from contextrender import Engine

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def trace_turns() -> list[tuple[dict, dict]]:
    """(assistant message with one call, its tool message) pairs from the SWE traces."""
    pairs = []
    with open(TRACES / "mini_swe_agent_deepseek.jsonl") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            answers = {m["tool_call_id"]: m for m in messages if m["role"] == "tool"}
            for m in messages:
                if m["role"] == "assistant" and len(m.get("tool_calls") or []) == 1:
                    pairs.append((m, answers[m["tool_calls"][0]["id"]]))
    return pairs


def history(pairs: list[tuple[dict, dict]], results: int) -> list[dict]:
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the failing test."}]
    for i in range(results):
        assistant, answer = pairs[i % len(pairs)]
        call_id = f"call_{i}"
        call = dict(assistant["tool_calls"][0]) | {"id": call_id}
        messages.append({"role": "assistant", "content": assistant.get("content") or "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": answer["content"]})
    messages.append({"role": "user", "content": "Continue."})
    return messages


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def bench_render(engine: Engine, messages: list[dict], budget: int, repeat: int, **settings: object) -> tuple[float, float]:
    """Medians of `Engine.render` end to end and of the render computation inside it (scores,
    selection, assembly: the result's `render_ms`, without the walker spawn and the store
    commit that every Engine call pays)."""
    session = f"render-{len(messages)}-{sorted(settings.items())}"
    engine.ingest(session, messages)
    samples, computation = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        result = engine.render(session, messages, budget=budget, **settings)
        samples.append(time.perf_counter() - start)
        computation.append(result.render_ms / 1000)
    assert result.selected and result.history_tokens <= budget
    return median_ms(samples), median_ms(computation)


def bench_growing(engine: Engine, pairs: list[tuple[dict, dict]], results: int, budget: int, repeat: int) -> dict[str, tuple[float, float, int]]:
    """The stable policy as an agent meets it: one tool round more before every call. Medians of
    `Engine.render` end to end and of the render computation, and the count, by mode (append,
    re-render)."""
    session = f"growing-{results}"
    engine.ingest(session, history(pairs, results)[:-1])
    engine.render(session, budget=budget)
    by_mode: dict[str, tuple[list, list]] = {}
    for k in range(1, repeat + 1):
        messages = history(pairs, results + k)[:-1]
        start = time.perf_counter()
        result = engine.render(session, messages, budget=budget)
        seconds = time.perf_counter() - start
        assert result.history_tokens <= budget
        samples, computation = by_mode.setdefault(result.mode, ([], []))
        samples.append(seconds)
        computation.append(result.render_ms / 1000)
    return {mode: (median_ms(a), median_ms(b), len(a)) for mode, (a, b) in by_mode.items()}


def bench_ingest(engine: Engine, pairs: list[tuple[dict, dict]], results: int, chunk: int) -> tuple[float, float, float]:
    """MB/s of result text ingested, by the clock and by this process's CPU time (which the
    other jobs of a loaded machine do not lengthen), and the MB."""
    messages = history(pairs, results)
    text = sum(len(m["content"].encode()) for m in messages if m["role"] == "tool")
    start, cpu = time.perf_counter(), time.process_time()
    # As an agent would: the list grows by `chunk` tool rounds per call.
    for end in range(2 + 2 * chunk, len(messages) + 2 * chunk, 2 * chunk):
        engine.ingest("ingest", messages[: min(end, len(messages))])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return text / 1e6 / seconds, text / 1e6 / cpu, text / 1e6


def ingest_computation(pairs: list[tuple[dict, dict]], results: int) -> float:
    """MB/s of what ingestion computes, without the store: tokens, TFA values and the reuse index,
    embeddings (the same calls `ingest` makes)."""
    from engine.index import SessionIndex
    from engine.measure import EMBED_CLIP, content_text, get_embedder, get_tokenizer

    messages = history(pairs, results)[1:]
    text = sum(len(m["content"].encode()) for m in messages if m["role"] == "tool")
    tokenizer, embedder, index = get_tokenizer(), get_embedder(), SessionIndex(key="bench")
    start, cpu = time.perf_counter(), time.process_time()
    vectors = iter(embedder.embed([content_text(m["content"])[:EMBED_CLIP] for m in messages if m["role"] == "tool"]))
    for n, message in enumerate(messages):
        calls = {c["id"]: tokenizer.call_tokens(c) for c in message.get("tool_calls") or []}
        tokens = tokenizer.text_tokens(message) + sum(calls.values())
        vector = next(vectors) if message["role"] == "tool" else None
        index.add(message, str(n), tokens, calls, {c: c for c in calls}, vector)
        index.track(n)
    return text / 1e6 / (time.perf_counter() - start), text / 1e6 / (time.process_time() - cpu)


def long_sessions(count: int) -> list[list[dict]]:
    """The `count` longest coding sessions of the SWE trace, by their tool results' text."""
    with open(TRACES / "mini_swe_agent_deepseek.jsonl") as f:
        sessions = [json.loads(line)["messages"] for line in f]
    return sorted(sessions, key=lambda m: -sum(len(x["content"].encode()) for x in m if x["role"] == "tool"))[:count]


def bench_sessions(store: Path, sessions: list[list[dict]], chunk: int) -> tuple[float, float, float]:
    """MB/s of result text of recorded sessions ingested (by the clock, by CPU time), and the MB:
    each session in one call (`chunk` 0) or growing by `chunk` messages a call."""
    engine = Engine(store)
    text = sum(len(m["content"].encode()) for messages in sessions for m in messages if m["role"] == "tool")
    start, cpu = time.perf_counter(), time.process_time()
    for (k, messages) in enumerate(sessions):
        for end in range(chunk or len(messages), len(messages) + (chunk or 1), chunk or 1):
            engine.ingest(f"trace-{k}", messages[: min(end, len(messages))])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return text / 1e6 / seconds, text / 1e6 / cpu, text / 1e6


def warm_like_a_server(store: Path) -> None:
    """What a server has done before the calls it serves: its models loaded (`warm_up`) and one
    small call of another session (the code paths loaded, a few words and counts cached)."""
    engine = Engine(store)
    engine.warm_up()
    engine.ingest("warm-up", [{"role": "user", "content": "Warm up."},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"id": "w1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                              {"role": "tool", "tool_call_id": "w1", "content": "README.md setup.py"}])


def ingest_rows(args: argparse.Namespace) -> list[str]:
    """The ingestion rows, by name (`--row` runs one)."""
    rows = ["computation"] + [f"ingest:{chunk}" for chunk in args.rounds_per_call]
    return rows + ([f"traces:{args.traces}:0", f"traces:{args.traces}:20"] if args.traces else [])


def run_row(row: str, pairs: list[tuple[dict, dict]], store: Path) -> str:
    """One ingestion row, measured in this process: its line."""
    (kind, *numbers) = row.split(":")
    if kind == "computation":
        (rate, cpu_rate) = ingest_computation(pairs, 2000)
        return (f"ingest computation only (tokens, values, embeddings; no store), 2,000 results: {rate:.2f} MB/s "
                f"({cpu_rate:.2f} MB/s of CPU time)")
    if kind == "ingest":
        chunk = int(numbers[0])
        rate, cpu_rate, megabytes = bench_ingest(Engine(store / f"i{chunk}"), pairs, 2000, chunk)
        return (f"ingest, 2,000 results ({megabytes:.1f} MB of result text), {chunk:>2} round(s) per call: {rate:.2f} MB/s "
                f"({cpu_rate:.2f} MB/s of CPU time)")
    (count, chunk) = (int(numbers[0]), int(numbers[1]))
    sessions = long_sessions(count)
    rate, cpu_rate, megabytes = bench_sessions(store / f"t{chunk}", sessions, chunk)
    how = "in one call each" if not chunk else f"in rounds of {chunk} messages"
    return (f"ingest, the {count} longest coding sessions ({megabytes:.2f} MB of result text, "
            f"{sum(map(len, sessions))} messages), {how}: {rate:.2f} MB/s ({cpu_rate:.2f} MB/s of CPU time)")


# An ingestion row's line: its name, then its MB/s by the clock and of CPU time.
CPU_RATE = re.compile(r"^(?P<row>.+): [\d.]+ MB/s \((?P<cpu>[\d.]+) MB/s of CPU time\)")


def paired_lines(rates: dict[str, list[tuple[float, float]]], other: str) -> list[str]:
    """Each ingestion row's MB/s of CPU time over the rounds, (this checkout's, `other`'s) a round:
    the two medians and their ratio, the median of the rounds' own ratios (a round runs both one
    after the other, so a slow minute of the machine weighs on both) and the rounds this checkout
    was the faster in."""
    lines = [f"medians over the rounds, MB/s of CPU time, this checkout against {other}:"]
    for (row, pairs) in rates.items():
        (mine, theirs) = (statistics.median([a for (a, _) in pairs]), statistics.median([b for (_, b) in pairs]))
        paired = statistics.median([a / b for (a, b) in pairs])
        lines.append(f"  {row}: {mine:.2f} against {theirs:.2f}, x{mine / theirs:.2f}, paired x{paired:.2f}, "
                     f"faster in {sum(a > b for (a, b) in pairs)} of {len(pairs)}")
    return lines


def alternate(args: argparse.Namespace) -> None:
    """This checkout's rows and `args.checkout`'s, in turn, `args.alternate` times each; then the
    ingestion rows' medians and paired ratios (`paired_lines`)."""
    own = without(sys.argv[1:], "--checkout", "--alternate")
    rates: dict[str, list[tuple[float, float]]] = {}
    for round_ in range(args.alternate):
        found: dict[str, dict[str, float]] = {}
        for (name, folder) in in_turn(round_, ("this checkout", REPO), (str(args.checkout), args.checkout)):
            load = " ".join(f"{x:.1f}" for x in os.getloadavg())
            for line in run_in(folder, __file__, own).splitlines():
                print(f"round {round_ + 1}, {name} (load {load}): {line}", flush=True)
                if (rate := CPU_RATE.match(line)) is not None:
                    found.setdefault(rate["row"], {})[name] = float(rate["cpu"])
        for (row, by) in found.items():
            if len(by) == 2:
                rates.setdefault(row, []).append((by["this checkout"], by[str(args.checkout)]))
    if rates:
        print("\n".join(paired_lines(rates, str(args.checkout))), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--budget", type=int, default=6000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[150, 10_000])
    parser.add_argument("--ingest-only", action="store_true", help="only the ingestion rows")
    parser.add_argument("--rounds-per-call", type=int, nargs="+", default=[2000, 50],
                        help="tool rounds (two messages each) per ingestion call")
    parser.add_argument("--per-call-only", action="store_true", help="only the per-call render rows (a quick A/B of the render itself)")
    parser.add_argument("--traces", type=int, default=0, help="also ingest the N longest recorded coding sessions")
    parser.add_argument("--checkout", type=Path, help="alternate with the same rows run by this checkout (with its .venv)")
    parser.add_argument("--alternate", type=int, default=3, help="rounds of each with --checkout")
    parser.add_argument("--shared-process", action="store_true",
                        help="the ingestion rows in this process, one after another (caches warmed by the rows before)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # one ingestion row, in a fresh process
    args = parser.parse_args()
    if args.checkout:
        alternate(args)
        return
    if args.row:
        with tempfile.TemporaryDirectory() as store:
            pairs = trace_turns()
            warm_like_a_server(Path(store) / "warm")
            print(run_row(args.row, pairs, Path(store)), flush=True)
        return
    if args.ingest_only:
        args.sizes = []
    pairs = trace_turns()
    with tempfile.TemporaryDirectory() as store:
        engine = Engine(store)
        for results in args.sizes:
            repeat = args.repeat if results < 1000 else max(5, args.repeat // 3)
            start = time.perf_counter()
            # The same history rendered again and again: every call selects (the paper's renderer,
            # as before the stable policy), or appends nothing to its previous render (the default).
            paper = {"policy": "per-call", "prose_share": 1.0, "condense": False}
            rows = (("per-call, paper settings", paper),) if args.per_call_only else (("per-call, paper settings", paper), ("stable, same history", {}))
            for label, settings in rows:
                p50, compute = bench_render(engine, history(pairs, results), args.budget, repeat, **settings)
                print(
                    f"render, {results:>6} results, B={args.budget}, {label}: Engine.render p50 {p50:8.2f} ms, "
                    f"render computation p50 {compute:8.2f} ms  (n={repeat}; setup+runs {time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
            if args.per_call_only:
                continue
            for mode, (p50, compute, n) in sorted(bench_growing(engine, pairs, results, args.budget, repeat).items()):
                print(
                    f"render, {results:>6} results, B={args.budget}, stable, one round more per call, {mode}: "
                    f"Engine.render p50 {p50:8.2f} ms, render computation p50 {compute:8.2f} ms  (n={n})",
                    flush=True,
                )
        if args.per_call_only:
            return
        for row in ingest_rows(args):
            if args.shared_process:
                print(f"{run_row(row, pairs, Path(store))}  (one process)", flush=True)
                continue
            child = subprocess.run([sys.executable, __file__, "--row", row], capture_output=True, text=True, check=True)
            print(f"{child.stdout.strip()}  (fresh process)", flush=True)


if __name__ == "__main__":
    main()
