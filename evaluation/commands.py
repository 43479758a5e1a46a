"""`contextrender replay` and `contextrender sweep`: recorded traces (../shared/traces schema)
replayed through the engine as a live agent would see them, measured by Later-Used Result
Recall (B.4), tokens, cost (equation 3) and render latency.

Each trace is ingested into one session, turn by turn; before each assistant turn j every
(selector, budget) renders `messages[:j]` in one engine call, and what it would have shown
the model is measured. The assistant turn j itself is only used afterwards, to label events.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from contextrender_eval.evaluate import Prices

DEFAULT_TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
TAU_BUDGETS = (1000, 2000, 3000)
SWE_BUDGETS = (3000, 6000, 12000, 24000)


def _int_list(text: str) -> list[int]:
    try:
        return [int(float(x.lower().rstrip("k")) * (1000 if x.lower().endswith("k") else 1)) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 3000,6K (got {text!r})")


def _selector_list(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    return names


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--selector", "--selectors", dest="selectors", type=_selector_list, action="extend",
                        help="selector name(s), comma-separated or repeated (default: all registered)")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first K traces of each file (of its --part)")
    parser.add_argument("--part", choices=("all", "train", "held-out"), default="all",
                        help="which traces of each file: 'train' (even positions: the 1st, 3rd, ...) to choose settings "
                             "on, 'held-out' (odd positions) to report them on, or all (default)")
    parser.add_argument("--summariser", choices=("llm", "offline"), default="llm",
                        help="for recency-summary and compact: 'llm' needs CONTEXTRENDER_MODEL; 'offline' is the "
                             "labelled extractive stand-in (not an LLM summary)")
    parser.add_argument("--omitted", choices=("stub", "drop"), default="stub", help="what stands in for an omitted result")
    prices = Prices()
    parser.add_argument("--price-input", type=float, default=prices.input, help="USD per 1M uncached input tokens (eq. 3: 2)")
    parser.add_argument("--price-cached", type=float, default=prices.cached_input, help="USD per 1M cached input tokens (eq. 3: 0.5)")
    parser.add_argument("--price-output", type=float, default=prices.output, help="USD per 1M output tokens (eq. 3: 8)")
    parser.add_argument("--price-embedding", type=float, default=prices.embedding, help="USD per 1M embedding tokens (eq. 3: 0.13)")
    parser.add_argument("--set", dest="params", action="append", default=[], metavar="NAME=VALUE",
                        help="any other RenderConfig setting for every render, e.g. --set fold_target=0.25 (repeatable)")
    parser.add_argument("--oracle-restore", action="store_true",
                        help="replay a model that, before each reuse, restores every result it needs that the rendered "
                             "history names (one restore round per turn, priced with the prefix cache); each selector but "
                             "full gets its own session")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers: Any) -> None:
    replay = subparsers.add_parser("replay", help="replay recorded traces and measure recall, tokens, cost and latency",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("traces", nargs="+", help="trace files (JSONL, ../shared/traces/README.md schema)")
    replay.add_argument("--budget", "--budgets", dest="budgets", type=_int_list, action="extend", required=True,
                        help="history budget(s) B in tokens, comma-separated or repeated")
    replay.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_common(replay)
    replay.set_defaults(func=run_replay)

    sweep = subparsers.add_parser("sweep", help="replay budgets x selectors on trace files; write a markdown report and figures")
    sweep.add_argument("traces", nargs="*", help=f"trace files (default: every *.jsonl in {DEFAULT_TRACES})")
    sweep.add_argument("--tau-budgets", type=_int_list, default=list(TAU_BUDGETS), help="budgets for files named *tau* (default 1K,2K,3K)")
    sweep.add_argument("--swe-budgets", type=_int_list, default=list(SWE_BUDGETS), help="budgets for the other files (default 3K,6K,12K,24K)")
    sweep.add_argument("--out", default="docs/results", help="folder for report.md, the figures and raw/ (default docs/results)")
    sweep.add_argument("--reuse-raw", action="store_true",
                       help="reuse raw/<file>.json already in --out for files replayed with the same settings")
    sweep.add_argument("--replay-only", action="store_true", help="write raw/<file>.json only (no report, no figures)")
    _add_common(sweep)
    sweep.set_defaults(func=run_sweep)


def _prices(args: argparse.Namespace) -> Prices:
    return Prices(input=args.price_input, cached_input=args.price_cached, output=args.price_output, embedding=args.price_embedding)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {"summariser": args.summariser, "omitted": args.omitted}
    for item in args.params:
        name, _, text = item.partition("=")
        try:
            settings[name.strip()] = json.loads(text)
        except json.JSONDecodeError:
            settings[name.strip()] = text
    return settings


def _plan(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]] | None:
    """The selectors to replay (`full` added: the cost reference) and the render settings, each
    checked by the engine's own rules (unknown names, bad values, a summary selector without a
    model); None after printing what to fix."""
    from contextrender.core import InvalidRequest, check_budget, render_settings
    from contextrender_eval.replay import registered_selectors

    selectors = args.selectors or list(registered_selectors())
    if "full" not in selectors:
        selectors = ["full"] + selectors
    settings = _settings(args)
    budgets = getattr(args, "budgets", None) or [*getattr(args, "tau_budgets", ()), *getattr(args, "swe_budgets", ())]
    try:
        for budget in budgets:
            check_budget(budget)
        for name in selectors:
            render_settings(settings, {"selector": name})
    except InvalidRequest as bad:
        message = str(bad)
        if "summariser" in message:
            message += " (on the command line: --summariser offline)"
        print(f"error: {message}", file=sys.stderr)
        return None
    return selectors, settings


def _traces(count: int) -> str:
    return f"{count} trace" if count == 1 else f"{count} traces"


def run_replay(args: argparse.Namespace) -> int:
    from contextrender_eval.replay import Replayer, load_traces, summarise, text_table

    plan = _plan(args)
    if plan is None:
        return 2
    (selectors, settings) = plan
    traces = load_traces(args.traces, args.limit, args.part)
    variants = [(s, b) for b in args.budgets for s in selectors]
    stats = Replayer(variants, settings=settings, progress=not args.no_progress, oracle=args.oracle_restore).run(traces)
    rows = summarise(stats, _prices(args))
    if args.json:
        json.dump({"traces": len(traces), "files": args.traces, "limit": args.limit, "part": args.part, "settings": settings,
                   "oracle_restore": args.oracle_restore,
                   "prices": vars(_prices(args)), "rows": rows}, sys.stdout, indent=1, default=float)
        print()
    else:
        part = "" if args.part == "all" else f" (part {args.part})"
        print(f"{_traces(len(traces))} from {', '.join(args.traces)}{part}; summariser={args.summariser}, omitted={args.omitted}")
        print(text_table(rows))
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from contextrender_eval import sweep_report  # matplotlib: only for a sweep
    from contextrender_eval.replay import Replayer, load_traces

    plan = _plan(args)
    if plan is None:
        return 2
    (selectors, settings) = plan
    files = [Path(p) for p in args.traces] or sorted(DEFAULT_TRACES.glob("*.jsonl"))
    out = Path(args.out)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    datasets: dict[str, dict] = {}
    for path in files:
        budgets = args.tau_budgets if "tau" in path.stem else args.swe_budgets
        raw = out / "raw" / f"{path.stem}.json"
        meta = {"file": path.name, "limit": args.limit, "part": args.part, "budgets": budgets, "selectors": selectors, "settings": settings}
        if args.oracle_restore:  # (raw files of plain sweeps stay reusable)
            meta["oracle_restore"] = True
        if args.reuse_raw and raw.exists():
            saved = json.loads(raw.read_text())
            if {k: saved.get(k) for k in meta} == meta and saved.get("oracle_restore", False) == args.oracle_restore:
                datasets[path.stem] = saved
                print(f"{path.name}: reusing {raw}", file=sys.stderr)
                continue
        traces = load_traces([path], args.limit, args.part)
        print(f"{path.name}: {_traces(len(traces))}, budgets {budgets}, {len(selectors)} selectors", file=sys.stderr)
        stats = Replayer([(s, b) for b in budgets for s in selectors], settings=settings,
                         progress=not args.no_progress, oracle=args.oracle_restore).run(traces)
        saved = meta | {"traces": len(traces), "stats": [v.to_dict() for v in stats.values()]}
        raw.write_text(json.dumps(saved))
        datasets[path.stem] = saved
    if args.replay_only:
        return 0
    report = sweep_report.write(datasets, out, _prices(args), command=" ".join(["contextrender", "sweep", *sys.argv[2:]]))
    print(f"wrote {report}")
    return 0
