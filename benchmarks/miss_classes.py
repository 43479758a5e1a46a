"""Why later-used results are out of view: replays traces as `contextrender replay` does (one
selector, one budget, the stable policy), and sorts every B.4 event the render misses into one
class, read from the plan that made the render (its constraints, layout and choice):

- at a re-render (or the append after it, which keeps what the re-render left out: "append:"
  prefixed to the class the result had at that re-render):
  - `prefix`: a partial re-render kept the previous request up to a cut before the result, which
    that request did not show (or, with `keep_folded`, a re-render kept what it showed of its
    folded turns up to such a cut), and the full re-render (the cost-aware choice's other option)
    shows it (when the full one leaves it out too, the class is the one it has there);
  - `too large for B`: its cost (with its call's wrapper when its turn is folded) exceeds the room
    B leaves for results once the layout is paid for;
  - `too large for the cap`: it exceeds the re-render's room under its cap, not B's;
  - `newest step's room`: it would have fitted in the room the newest step's results kept in view
    took;
  - `headroom`: it fits in what the selection left plus the headroom (B minus the cap);
  - `ranked below`: results scored higher filled the room; split by whether the previous request
    showed it (evicted) and by the score term it trails the picked results most on (recency,
    reuse, relevance: the paper's U, weighted);
  - `shown cut`: chosen, but cut to the room (a newest result) or compacted (larger than B);
- `no render yet`: the session had no stable render yet with these settings (never here: the
  replay renders before every assistant turn).

Each class is also split by whether the assistant turn just before the missing render used the
result already (reuse comes in runs: the `reuse_room` signal).

    .venv/bin/python -u benchmarks/miss_classes.py ../shared/traces/tau_bench.jsonl --part train \\
        --budget 1000 [--limit 40] [--set stickiness=2 --set headroom=0.3]

Token counts only: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contextrender import Engine  # noqa: E402
from contextrender_eval.evaluate import reuse_events, visible_results  # noqa: E402
from contextrender_eval.replay import assistant_turns, load_traces  # noqa: E402


FULL: dict = {}


def watch_full_rerenders() -> None:
    """Keep, per session, what the full re-render showed when the cost-aware choice also tried
    partial ones (engine/stability.jac `_partials` gets the full plan)."""
    stability = importlib.import_module("engine.stability")
    real = stability._partials

    def partials(plan, before, full, *weighed):
        FULL["plan"] = full
        return real(plan, before, full, *weighed)

    stability._partials = partials


def last_plan(session_id: str):
    """The plan of the session's latest render (the render walker keeps it on the index)."""
    cache = importlib.import_module("engine.index").SESSION_CACHE
    for index in cache._indexes.values():
        if index.last_render is not None and index.last_render[0].session_id == session_id:
            return index.last_render[1]
    raise LookupError(session_id)


TERMS = ("recency", "reuse", "relevance")


def trailing_term(plan, r: int) -> str:
    """The term of U (weighted) on which `r` trails the mean of the results the selection picked most."""
    scores = plan.scores
    picked = [p for p in plan.choice.chosen if p not in plan.layout.newest]
    if scores is None or not picked:
        return "?"
    weights = plan.weights
    gaps = []
    for name, w in zip(TERMS, weights):
        values = getattr(scores, name)
        gaps.append((w * (sum(float(values[p]) for p in picked) / len(picked) - float(values[r])), name))
    return max(gaps)[1]


def classify(plan, r: int) -> str:
    """The class of result `r`, left out (or shown cut) by the re-render `plan`."""
    layout, choice, constraints = plan.layout, plan.choice, plan.constraints
    if r in choice.chosen:
        return "shown cut (newest step)" if r in layout.newest else "shown compacted (larger than B)"
    if r not in choice.final_cost:
        # A re-render that kept part of the previous request (a partial one, or `keep_folded`'s
        # folded turns): the full re-render was the cost-aware choice's other option.
        full = FULL.get("plan")
        if full is not None and full is not plan:
            if r in full.choice.chosen:
                kept = "a partial re-render's cut" if constraints.kept is not None else "the cut in the folded turns kept"
                return f"prefix: before {kept}, not shown by the previous request, shown by the full re-render"
            # Left out by the full re-render too: its class there.
            return classify(full, r)
        return "not a candidate"
    cost = choice.final_cost[r]
    cap = constraints.cap or plan.budget
    headroom = max(0, plan.budget - cap)
    room_cap = layout.remaining
    newest = sum(layout.newest.values())
    if cost > room_cap + headroom:
        return "too large for B (the room B leaves for results)"
    if cost > room_cap:
        return "too large for the cap (fits B's room, not the cap's)"
    if newest and cost <= choice.remaining + newest:
        return "newest step's room"
    if headroom and cost <= choice.remaining + headroom:
        return "headroom (fits what was left plus the headroom)"
    before = constraints.previous
    evicted = "shown by the previous request" if before is not None and r in before.shown else "not shown by the previous request"
    return f"ranked below ({evicted}; trails on {trailing_term(plan, r)})"


def replay_trace(trace: dict, request: dict, store: str, classes: collections.Counter) -> tuple[int, int]:
    """Replay one trace in a store of its own at `store`, adding each missed event's class to
    `classes`; returns (events, in view)."""
    messages = trace["messages"]
    engine = Engine(store)
    session = trace["id"]
    events = collections.defaultdict(list)
    for event in reuse_events(messages):
        events[event.turn].append(event)
    originals = {m["tool_call_id"]: m.get("content") for m in messages if m["role"] == "tool"}
    # Each result's class at the latest re-render, and each result's latest reuse (turn).
    at_rerender: dict[int, str] = {}
    last_reuse: dict[str, int] = {}
    last_turn = -1
    total = hits = 0
    for j, _ in assistant_turns(engine, session, messages):
        FULL.clear()
        result = engine.render_variants(session, [request])[0]
        plan = last_plan(session) if result.selected else None
        if plan is not None and result.mode == "re-render":
            at_rerender = {r: classify(plan, r) for r in plan.results if r not in plan.shown_whole()}
        visible = visible_results(result.messages, originals)
        for event in events[j]:
            total += 1
            if event.call_id in visible:
                hits += 1
                continue
            r = plan.index.result_call.index(event.call_id) if plan is not None else -1
            if plan is None:
                kind = "no render yet"
            elif result.mode == "append":
                kind = "append: " + at_rerender.get(r, "shown by the re-render, not whole at the append")
            else:
                kind = classify(plan, r)
            recent = "used by the step before" if last_reuse.get(event.call_id, -2) >= last_turn else "not used by the step before"
            classes[(kind, recent)] += 1
        for event in events[j]:
            last_reuse[event.call_id] = j
        last_turn = j
    return total, hits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces")
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--part", default="train")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--selector", default="contextrender")
    parser.add_argument("--set", action="append", default=[], help="name=json, as `contextrender replay --set`")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    settings = {}
    for item in args.set:
        name, _, value = item.partition("=")
        settings[name] = json.loads(value)
    watch_full_rerenders()
    request = {"budget": args.budget, "selector": args.selector, **settings}
    classes: collections.Counter = collections.Counter()
    total = hits = 0
    for trace in load_traces([args.traces], args.limit, args.part):
        # A store of its own per trace, removed after it.
        with tempfile.TemporaryDirectory(prefix="miss-classes-") as store:
            (events, in_view) = replay_trace(trace, request, store, classes)
        total += events
        hits += in_view
    missed = total - hits
    if args.json:
        print(json.dumps({"events": total, "in_view": hits, "classes": [[k[0], k[1], c] for k, c in classes.most_common()]}))
        return
    print(f"{total} events, in view {hits} ({100 * hits / max(1, total):.1f}%), missed {missed}; B = {args.budget}, {settings or 'defaults'}")
    by_kind: collections.Counter = collections.Counter()
    for (kind, _), count in classes.items():
        by_kind[kind] += count
    for kind, count in by_kind.most_common():
        recent = classes[(kind, "used by the step before")]
        print(f"  {count:5d} ({100 * count / max(1, missed):4.1f}%)  {kind}  [used by the step before: {recent}]")
    print("by class, at a re-render or at the appends after it:")
    for kind, count in coarse(by_kind).most_common():
        print(f"  {count:5d} ({100 * count / max(1, missed):4.1f}%)  {kind}")


def coarse(by_kind: collections.Counter) -> collections.Counter:
    """The classes without their detail (append or re-render, the trailing term)."""
    out: collections.Counter = collections.Counter()
    for kind, count in by_kind.items():
        kind = kind.removeprefix("append: ")
        if kind.startswith("ranked below"):
            kind = "ranked below, " + ("evicted (shown by the previous request)" if "(shown by" in kind else "not shown by the previous request")
        out[kind.split(" (")[0] if not kind.startswith("ranked below") else kind] += count
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
