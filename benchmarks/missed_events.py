"""Why a selector misses later-used results: replays traces like `contextrender replay`, and for
every B.4 event the first variant misses it reads the result's decision (`explain_render`): its
size against B, its age and whether it had observed reuse. Also prints how each variant's managed
renders split the budget (complete results, stubs, everything else) and where each request first
differs from the previous one of the session (what breaks a provider's prefix cache).

    .venv/bin/python -u benchmarks/missed_events.py ../shared/traces/mini_swe_agent_deepseek.jsonl \
        --limit 12 --budget 6000 --variant selector=contextrender --variant selector=contextrender,fold_target=0.25
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contextrender import Engine  # noqa: E402
from contextrender.core import get_tokenizer  # noqa: E402
from contextrender_eval.evaluate import age_bin, reuse_events, visible_results  # noqa: E402
from contextrender_eval.replay import assistant_turns, load_traces  # noqa: E402


def parse_variant(text: str) -> dict:
    out: dict = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--budget", type=int, default=6000)
    parser.add_argument("--part", default="all", help="all, train or held-out (contextrender replay --part)")
    parser.add_argument("--variant", type=parse_variant, action="append", required=True)
    args = parser.parse_args()
    tok = get_tokenizer()
    variants = args.variant
    hits: collections.Counter = collections.Counter()
    missed: collections.Counter = collections.Counter()
    split = collections.defaultdict(lambda: [0, 0, 0, 0])
    breaks: collections.Counter = collections.Counter()
    why: collections.Counter = collections.Counter()
    total = 0
    for trace in load_traces([args.traces], args.limit, args.part):
        messages = trace["messages"]
        engine = Engine(tempfile.mkdtemp(prefix="missed-"))
        events = collections.defaultdict(list)
        for event in reuse_events(messages):
            events[event.turn].append(event)
        originals = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        system = sum(1 for m in messages if m["role"] == "system")
        previous: dict[int, list] = {}
        # Each result's latest reuse (the assistant turn), and the assistant turn before this one.
        last_reuse: dict[str, int] = {}
        last_turn = -1
        for j, _ in assistant_turns(engine, "t", messages):
            results = engine.render_variants("t", [dict(v, budget=args.budget) for v in variants], explain=True)
            total += len(events[j])
            for i, result in enumerate(results):
                visible = visible_results(result.messages, originals)
                for event in events[j]:
                    hits[i] += event.call_id in visible
                    if i == 0 and event.call_id not in visible:
                        d = next(d for d in result.decisions if d.call_id == event.call_id)
                        size = ">B" if d.tokens > args.budget else ">B/4" if d.tokens > args.budget / 4 else "<=B/4"
                        missed[(size, age_bin(event.age), "reused before" if d.reuse_count > 0 else "no reuse yet")] += 1
                        # How the render that missed it was made, and whether an assistant turn
                        # since the previous render (the latest step) reused it already.
                        recent = last_reuse.get(event.call_id, -1) >= last_turn
                        why[(result.mode, size, d.status if d.status != "omitted" or not d.reason else d.reason.split(":")[0][:40],
                             "reused in the latest step" if recent else "not reused in the latest step")] += 1
                if not result.selected:
                    previous[i] = result.messages
                    continue
                history = result.messages[system:]
                full = sum(tok.message_tokens(m) for m in history if m["role"] == "tool" and m["content"] == originals.get(m.get("tool_call_id")))
                stubs = sum(tok.message_tokens(m) for m in history if m["role"] == "tool" and m["content"] != originals.get(m.get("tool_call_id")))
                row = split[i]
                row[0] += 1
                row[1] += full
                row[2] += stubs
                row[3] += result.history_tokens - full - stubs
                before = previous.get(i)
                if before is not None:
                    k = next((n for n, (a, b) in enumerate(zip(before, result.messages)) if a != b), min(len(before), len(result.messages)))
                    first = str(result.messages[k].get("content")) if k < len(result.messages) else ""
                    kind = "fold marker" if "oldest messages" in first else "stub" if "is omitted to fit" in first else (result.messages[k]["role"] if k < len(result.messages) else "end")
                    breaks[(i, "first history message" if k == system else "later", kind)] += 1
                previous[i] = result.messages
            for event in events[j]:
                last_reuse[event.call_id] = j
            last_turn = j
    print(f"{total} events, B = {args.budget}")
    for i, variant in enumerate(variants):
        n, full, stubs, other = split[i]
        print(f"{variant}: recall {100 * hits[i] / max(total, 1):.1f}%; per managed render: results {full / max(n, 1):.0f}, "
              f"stubs {stubs / max(n, 1):.0f}, other history {other / max(n, 1):.0f} tokens")
        for key, count in sorted(((k, c) for k, c in breaks.items() if k[0] == i), key=lambda kc: -kc[1]):
            print(f"    request differs from the previous one at the {key[1]} ({key[2]}): {count}")
    print(f"events {variants[0]} missed ({sum(missed.values())}), by result size, age and observed reuse:")
    for key, count in sorted(missed.items(), key=lambda kc: -kc[1]):
        print(f"    {key}: {count}")
    print(f"the same events by the missing render's mode, the result's status or reason, and reuse in the latest step:")
    for key, count in sorted(why.items(), key=lambda kc: -kc[1]):
        print(f"    {key}: {count}")


if __name__ == "__main__":
    main()
