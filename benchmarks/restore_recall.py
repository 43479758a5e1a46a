"""What a restore does to later renders, simulated on recorded traces: how many restores a model
would need, and whether a restored result stays in view, for each weight a restore gets in c_t.

    .venv/bin/python -u benchmarks/restore_recall.py ../shared/traces/mini_swe_agent_deepseek.jsonl \
        --limit 12 --budget 6000 --weights 0,1,2,4

The replay harness cannot replay a model's decision to restore, so this script plays an oracle
model: before each recorded assistant turn it renders the history like `contextrender replay`
(contextrender, B = --budget), and every B.4 reuse event of that turn whose result is not visible
in full is restored (`Engine.restore`, from that turn) when the rendered history names its handle
in text ContextRender wrote (a stub, a compacted result's note, the fold marker's index): a model
can only ask for a handle it sees. (`contextrender replay --oracle-restore` replays the same
oracle with the cost of its rounds; this script varies the restore weight.) Weight 0 is the paper's formula (restores recorded, not scored);
weight w adds w to c_t per restore (the render setting `restore_weight`, 2 by default). Per weight
it prints the B.4 recall before any restore of that turn, the restores the oracle made, the missed
events it could not name, and, for events of results restored at an earlier turn, how often the
result was in view again (the "stays in view" the restore signal is for).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contextrender import Engine  # noqa: E402
from contextrender.core import content_text  # noqa: E402
from contextrender_eval.evaluate import named_handles, reuse_events, visible_results  # noqa: E402
from contextrender_eval.replay import assistant_turns, load_traces  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--budget", type=int, default=6000)
    parser.add_argument("--weights", default="0,1,2,4", help="weights of one restore in c_t, comma-separated (0: not scored)")
    args = parser.parse_args()
    weights = [float(w) for w in args.weights.split(",")]
    stats = {w: collections.Counter() for w in weights}
    traces = load_traces([args.traces], args.limit)
    for number, trace in enumerate(traces):
        messages = trace["messages"]
        events = collections.defaultdict(list)
        for event in reuse_events(messages):
            events[event.turn].append(event)
        originals = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        texts = {content_text(m.get("content")) for m in messages if m["role"] != "tool"}
        for weight in weights:
            engine = Engine(tempfile.mkdtemp(prefix="restore-recall-"))
            restored: set[str] = set()
            counts = stats[weight]
            for (j, _) in assistant_turns(engine, "t", messages):
                if not events[j]:
                    continue
                result = engine.render("t", budget=args.budget, explain=True, restore_weight=weight)
                visible = visible_results(result.messages, originals)
                handles = {d.call_id: d.handle for d in result.decisions}
                named = named_handles(result.messages, originals, texts)
                for event in events[j]:
                    shown = event.call_id in visible
                    counts["events"] += 1
                    counts["visible"] += shown
                    if event.call_id in restored:
                        counts["after restore"] += 1
                        counts["after restore, visible"] += shown
                    if shown:
                        continue
                    if handles[event.call_id] not in named:
                        counts["missed, no handle shown"] += 1
                        continue
                    engine.restore("t", handles[event.call_id])
                    counts["restores"] += 1
                    restored.add(event.call_id)
        print(f"trace {number + 1}/{len(traces)} done", file=sys.stderr, flush=True)
    print(f"{len(traces)} traces from {args.traces}; contextrender, B = {args.budget}; an oracle restores every missed event it can name")
    print(f"{'weight':>6}  {'events':>6}  {'recall %':>8}  {'restores':>8}  {'missed, no handle shown':>23}  "
          f"{'events of restored results':>26}  {'in view again %':>15}")
    for weight in weights:
        c = stats[weight]
        again = 100 * c["after restore, visible"] / c["after restore"] if c["after restore"] else float("nan")
        print(f"{weight:>6g}  {c['events']:>6}  {100 * c['visible'] / max(c['events'], 1):>8.1f}  {c['restores']:>8}  "
              f"{c['missed, no handle shown']:>23}  {c['after restore']:>26}  {again:>15.1f}")


if __name__ == "__main__":
    main()
