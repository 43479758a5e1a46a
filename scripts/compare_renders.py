"""Record every render of a replay, then compare two recordings: a refactor proves itself when the
recording after it is identical to the one before it.

    python scripts/compare_renders.py record OUT.jsonl [--limit-tau 40 --limit-swe 22 --limit-mini 4] [--set NAME=JSON ...]
    python scripts/compare_renders.py compare BEFORE.jsonl AFTER.jsonl

`record` replays the first traces of each file in ../shared/traces turn by turn through the public
`Engine` API (ingest the new events, then `render_variants` with decisions), for every selector at
two budgets per trace set, and writes one line per render: the rendered messages' digest, the
summary (render time left out) and every result's decision (status, reason, score terms rounded to
9 digits). `compare` reports the first differences and exits 1 if there are any.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
SELECTORS = ("full", "prune", "semantic", "recency-summary", "compact", "cr-recency", "cr-relevance",
             "cr-recency-relevance", "contextrender")
SETS = {"tau_bench": (1000, 2000), "swe_agent_demos": (3000, 6000), "mini_swe_agent_deepseek": (3000, 6000)}
VOLATILE = {"render_ms"}


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:20]


def _decision(d: object) -> list:
    fields = ("call_id", "position", "age", "tokens", "cost", "reuse_count", "recency", "reuse", "relevance",
              "usefulness", "score", "pick", "status", "reason")
    return [round(v, 9) if isinstance(v, float) else v for v in (getattr(d, f) for f in fields)]


def record(out: Path, limits: dict[str, int], settings: dict | None = None) -> None:
    from contextrender import Engine
    from contextrender_eval.replay import assistant_turns

    root = Path(tempfile.mkdtemp(prefix="compare-renders-"))
    lines = 0
    try:
        with out.open("w") as sink:
            for name, budgets in SETS.items():
                rows = [json.loads(line) for line in (TRACES / f"{name}.jsonl").open() if line.strip()]
                variants = [{"selector": s, "budget": b, "summariser": "offline"} | (settings or {}) for b in budgets for s in SELECTORS]
                for trace in rows[: limits[name]]:
                    engine = Engine(root / f"{name}-{trace['id']}")
                    for j, _ in assistant_turns(engine, trace["id"], trace["messages"]):
                        for variant, result in zip(variants, engine.render_variants(trace["id"], variants, explain=True)):
                            summary = {k: v for k, v in result.summary().items() if k not in VOLATILE}
                            sink.write(json.dumps({
                                "set": name, "trace": trace["id"], "turn": j, "selector": variant["selector"],
                                "budget": variant["budget"], "messages": _digest(result.messages),
                                "summary": summary, "decisions": _digest([_decision(d) for d in result.decisions]),
                            }, sort_keys=True) + "\n")
                            lines += 1
                    print(f"{name} {trace['id']}: {lines} renders so far", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"recorded {lines} renders to {out}")


def compare(before: Path, after: Path) -> int:
    a = [json.loads(line) for line in before.open()]
    b = [json.loads(line) for line in after.open()]
    differences = [(x, y) for x, y in zip(a, b) if x != y]
    if len(a) != len(b):
        print(f"different number of renders: {len(a)} before, {len(b)} after")
    for x, y in differences[:10]:
        where = f"{x['set']} {x['trace']} turn {x['turn']} {x['selector']} B={x['budget']}"
        fields = sorted(k for k in x if x.get(k) != y.get(k))
        print(f"differs: {where}: {', '.join(fields)}")
        for k in fields:
            print(f"  before {k}: {x.get(k)}\n  after  {k}: {y.get(k)}")
    print(f"{len(a)} renders before, {len(b)} after, {len(differences)} differ")
    return 1 if differences or len(a) != len(b) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="replay and write every render to OUT")
    rec.add_argument("out", type=Path)
    rec.add_argument("--limit-tau", type=int, default=40)
    rec.add_argument("--limit-swe", type=int, default=22)
    rec.add_argument("--limit-mini", type=int, default=4)
    rec.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=JSON",
                     help="a render setting for every variant, e.g. --set policy='\"per-call\"' (repeatable)")
    cmp = commands.add_parser("compare", help="compare two recordings; exit 1 on any difference")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        settings = {name: json.loads(value) for name, _, value in (item.partition("=") for item in args.settings)}
        record(args.out, {"tau_bench": args.limit_tau, "swe_agent_demos": args.limit_swe,
                          "mini_swe_agent_deepseek": args.limit_mini}, settings)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
