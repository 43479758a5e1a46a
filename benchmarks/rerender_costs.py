"""What each kind of render costs against `full`, with the replay's own prefix cache: replays one
trace file as `contextrender replay` does (`contextrender` and `full` at one budget), logs every
request's cached and uncached tokens and the first message where it departs from the previous
request, and sums, per kind of render, the cost against `full` at the same turns (2 per uncached
token, 0.5 per cached one: equation 3's prices; the output is the same for both and left aside).

Kinds: append, passthrough, a partial re-render (keeps the previous request up to a cut), a
re-render that keeps what the previous request showed of its folded turns (`keep_folded`), and
a full re-render: the first fold (the previous request had no fold, so it departs right after the
task) or a fold that moved, departing within the first 9 messages or later.

    .venv/bin/python benchmarks/rerender_costs.py ../shared/traces/tau_bench.jsonl --part train \\
        --budget 2000 [--limit 40] [--set keep_folded=true]

Token counts only: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextrender_eval.replay as replay  # noqa: E402
from contextrender import Engine  # noqa: E402
from contextrender_eval.evaluate import PrefixCache  # noqa: E402

MARKER = "[ContextRender: the oldest"
LOG: list[dict] = []
RESULTS: dict[int, object] = {}


class LoggingCache(PrefixCache):
    """The replay's prefix cache, logging each request (variants alternate: contextrender, full)."""

    made = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.variant = LoggingCache.made % 2
        LoggingCache.made += 1

    def request(self, messages: list[dict]) -> tuple[int, int]:
        previous = self.previous
        inputs, cached = super().request(messages)
        depart = 0
        while depart < min(len(previous), len(messages)) and previous[depart] == messages[depart]:
            depart += 1
        result = RESULTS.get(id(messages))
        first = messages[depart] if depart < len(messages) else {}
        LOG.append({
            "variant": self.variant, "inputs": inputs, "cached": cached, "depart": depart,
            "mode": getattr(result, "mode", ""), "reason": getattr(result, "mode_reason", ""),
            "first_fold": str(first.get("content") or "").startswith(MARKER),
        })
        return inputs, cached


def kind(row: dict) -> str:
    if row["mode"] != "re-render":
        return row["mode"]
    if "kept the previous history up to message" in row["reason"]:
        return "partial re-render"
    if "of its folded turns up to message" in row["reason"]:
        return "re-render keeping the folded turns' results"
    if row["first_fold"]:
        return "full re-render, first fold"
    return "full re-render, fold moved, departs " + ("within 9 messages" if row["depart"] <= 9 else "later")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces")
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--part", default="train", choices=("all", "train", "held-out"))
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON")
    args = parser.parse_args()
    settings: dict = {"summariser": "offline", "omitted": "stub"}
    for item in args.set:
        name, value = item.split("=", 1)
        settings[name] = json.loads(value)

    real = Engine.render_variants

    def render_variants(self, session_id, variants, **kwargs):
        out = real(self, session_id, variants, **kwargs)
        for result in out:
            RESULTS[id(result.messages)] = result
        return out

    Engine.render_variants = render_variants
    replay.PrefixCache = LoggingCache
    traces = replay.load_traces([args.traces], args.limit, args.part)
    stats = replay.Replayer([("contextrender", args.budget), ("full", args.budget)], settings=settings, progress=False).run(traces)
    mine = [r for r in LOG if r["variant"] == 0]
    full = [r for r in LOG if r["variant"] == 1]

    def cost(row: dict) -> float:
        return 2.0 * (row["inputs"] - row["cached"]) + 0.5 * row["cached"]

    sums: dict = collections.defaultdict(lambda: [0, 0, 0.0])
    for row, reference in zip(mine, full, strict=True):
        entry = sums[kind(row)]
        entry[0] += 1
        entry[1] += row["inputs"] - row["cached"]
        entry[2] += cost(row) - cost(reference)
    for summary in replay.summarise(stats):
        if summary["selector"] == "contextrender":
            print(f"B = {args.budget}: {summary['recall']:.1f}% in view, {summary['described']:.1f}% in view or named, "
                  f"{summary['ratio_cached']:.3f} of full with the prefix cache")
    print(f"{'render':54s} {'count':>6s} {'uncached each':>14s} {'against full':>13s}")
    for name, (count, uncached, diff) in sorted(sums.items()):
        print(f"{name:54s} {count:6d} {uncached / count:14.0f} {diff / 1000:12.1f}k")


if __name__ == "__main__":
    main()
