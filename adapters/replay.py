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
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from contextrender_adapters.core import content_text
from contextrender_adapters.evaluate import (
    AGE_BINS,
    Prices,
    PrefixCache,
    Usage,
    VariantStats,
    age_bin,
    cost_summary,
    percentile,
    reuse_events,
    visible_results,
)

DEFAULT_TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
TAU_BUDGETS = (1000, 2000, 3000)
SWE_BUDGETS = (3000, 6000, 12000, 24000)

Variant = tuple[str, int]


def _selectors() -> dict[str, Any]:
    from contextrender_adapters.core import SELECTORS  # the engine's registry (slow import: lazily)

    return SELECTORS


def load_traces(paths: Iterable[str | os.PathLike[str]], limit: int = 0) -> list[dict]:
    """Traces of each file (the first `limit` of each when limit > 0), tagged with `dataset`."""
    traces: list[dict] = []
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for trace in rows[:limit] if limit > 0 else rows:
            trace["dataset"] = Path(path).stem
            traces.append(trace)
    return traces


def _embedding_use(selector: str) -> tuple[bool, bool]:
    """(embeds results, embeds a query per managed render) for a selector."""
    obj = _selectors()[selector]
    return obj.embeds_results, obj.embeds_query()


class Replayer:
    """Replays traces under a set of (selector, budget) variants into VariantStats."""

    def __init__(self, variants: list[Variant], *, settings: dict[str, Any] | None = None,
                 store: str | os.PathLike[str] | None = None, progress: bool = True) -> None:
        from contextrender_adapters.core import get_tokenizer
        from contextrender_adapters.engine import Engine

        self.variants = variants
        self.settings = dict(settings or {})
        self.tokenizer = get_tokenizer(self.settings.get("encoding", "o200k_base"))
        self.stats: dict[Variant, VariantStats] = {v: VariantStats(selector=v[0], budget=v[1]) for v in variants}
        self._root = Path(store) if store else Path(tempfile.mkdtemp(prefix="contextrender-replay-"))
        self._engine_cls = Engine
        self.progress = progress
        self._embeds = {s: _embedding_use(s) for s in {v[0] for v in variants}}

    def run(self, traces: list[dict]) -> dict[Variant, VariantStats]:
        turns = sum(sum(1 for m in t["messages"] if m["role"] == "assistant") for t in traces)
        bar = _progress(turns, self.progress)
        try:
            for number, trace in enumerate(traces):
                bar.set_postfix_str(f"{trace.get('dataset', '')} {number + 1}/{len(traces)}", refresh=False)
                self.replay_trace(trace, bar)
        finally:
            bar.close()
            shutil.rmtree(self._root, ignore_errors=True)
        return self.stats

    def replay_trace(self, trace: dict, bar: Any = None) -> None:
        from contextrender_adapters.core import EMBED_CLIP, latest_exchange_text

        messages = trace["messages"]
        key = f"{trace.get('dataset', '')}/{trace['id']}"
        store = self._root / f"t{abs(hash(key))}"
        engine = self._engine_cls(store)
        tok = self.tokenizer
        originals = {m["tool_call_id"]: m.get("content") for m in messages if m.get("role") == "tool"}
        by_turn: dict[int, list] = defaultdict(list)
        for event in reuse_events(messages):
            by_turn[event.turn].append(event)
        memo: dict = {}
        caches = {v: PrefixCache(tok, memo) for v in self.variants}
        usage = {v: Usage() for v in self.variants}
        needed = {v: False for v in self.variants}
        embedded = sum(tok.count(content_text(m.get("content"))[:EMBED_CLIP]) for m in messages if m.get("role") == "tool")
        requests = [{"budget": b, "selector": s, **self.settings} for (s, b) in self.variants]
        done = 0
        for j, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            if messages[done:j]:
                engine.ingest(trace["id"], messages[done:j], append=True)
            done = j
            results = engine.render_variants(trace["id"], requests)
            output = tok.message_tokens(message)
            query = tok.count(latest_exchange_text(messages[:j]))
            events = by_turn.get(j, [])
            for variant, result in zip(self.variants, results):
                stats = self.stats[variant]
                inputs, cached = caches[variant].request(result.messages)
                use = usage[variant]
                use.input += inputs + result.summary_input_tokens
                use.cached += cached
                use.output += output + result.summary_output_tokens
                managed = result.full_history_tokens > variant[1]
                if managed and self._embeds[variant[0]][1]:
                    use.embedding += query
                needed[variant] = needed[variant] or managed
                stats.renders += 1
                stats.managed += int(managed)
                stats.history_sum += result.history_tokens
                stats.history_max = max(stats.history_max, result.history_tokens)
                stats.input_sum += inputs
                stats.input_max = max(stats.input_max, inputs)
                stats.summary_calls += result.summary_calls
                if managed:
                    stats.latency_ms.append(result.render_ms)
                if events:
                    visible = visible_results(result.messages, originals)
                    for event in events:
                        name = age_bin(event.age)
                        stats.events[name] += 1
                        stats.hits[name] += int(event.call_id in visible)
            if bar is not None:
                bar.update(1)
        for variant in self.variants:
            if self._embeds[variant[0]][0]:
                usage[variant].embedding += embedded
            self.stats[variant].usage[key] = usage[variant]
            self.stats[variant].needs_management[key] = needed[variant]
        shutil.rmtree(store, ignore_errors=True)


class _NoBar:
    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None: ...
    def update(self, n: int = 1) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="turn", desc="replay", file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------- reporting


def summarise(stats: dict[Variant, VariantStats], prices: Prices = Prices()) -> list[dict]:
    """One row per (selector, budget): recall overall and by age (with event counts), tokens,
    cost ratios against `full` at the same budget (when `full` was replayed), latency."""
    rows: list[dict] = []
    for budget in sorted({b for _, b in stats}):
        group = {s: v for (s, b), v in stats.items() if b == budget}
        costs = cost_summary(group, group["full"], prices) if "full" in group else {}
        for selector, v in group.items():
            row = {
                "selector": selector, "budget": budget,
                "recall": v.recall(), "events": v.event_count(),
                "recall_by_age": {name: v.recall(name) for name, _, _ in AGE_BINS},
                "events_by_age": {name: v.event_count(name) for name, _, _ in AGE_BINS},
                "renders": v.renders, "managed_share": v.managed / v.renders if v.renders else 0.0,
                "history_mean": v.history_sum / v.renders if v.renders else 0.0,
                "history_max": v.history_max, "history_max_over_budget": v.history_max / budget,
                "input_mean": v.input_sum / v.renders if v.renders else 0.0, "input_max": v.input_max,
                "latency_p50_ms": percentile(v.latency_ms, 50), "latency_p95_ms": percentile(v.latency_ms, 95),
                "summary_calls": v.summary_calls,
            }
            row.update(costs.get(selector, {}))
            rows.append(row)
    return rows


def _fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:.{digits}f}"
    return str(value)


TABLE_COLUMNS = (
    ("selector", "selector", 0), ("B", "budget", 0), ("recall %", "recall", 1), ("events", "events", 0),
    ("<=3", "<=3", 1), ("4-10", "4-10", 1), ("11-25", "11-25", 1), (">25", ">25", 1),
    ("hist mean", "history_mean", 0), ("hist max", "history_max", 0), ("max/B", "history_max_over_budget", 2),
    ("input mean", "input_mean", 0), ("managed %", "managed_pct", 0),
    ("cost eq3/full", "ratio_eq3", 3), ("cost cache/full", "ratio_cached", 3),
    ("p50 ms", "latency_p50_ms", 2), ("p95 ms", "latency_p95_ms", 2),
)


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for row in rows:
        flat = dict(row) | row["recall_by_age"] | {"managed_pct": 100.0 * row["managed_share"]}
        out.append([_fmt(flat.get(key, float("nan")), digits) for _, key, digits in TABLE_COLUMNS])
    return out


def markdown_table(rows: list[dict]) -> str:
    header = [title for title, _, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    return "\n".join(lines)


def text_table(rows: list[dict]) -> str:
    header = [title for title, _, _ in TABLE_COLUMNS]
    body = table_rows(rows)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))) for cells in body]
    return "\n".join(lines)


# ---------------------------------------------------------------- commands


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
    parser.add_argument("--limit", type=int, default=0, help="replay only the first K traces of each file")
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
    from contextrender_adapters.core import InvalidRequest, render_settings

    selectors = args.selectors or list(_selectors())
    if "full" not in selectors:
        selectors = ["full"] + selectors
    settings = _settings(args)
    try:
        for name in selectors:
            render_settings(settings, {"selector": name})
    except InvalidRequest as bad:
        print(f"error: {bad}", file=sys.stderr)
        return None
    return selectors, settings


def run_replay(args: argparse.Namespace) -> int:
    plan = _plan(args)
    if plan is None:
        return 2
    (selectors, settings) = plan
    traces = load_traces(args.traces, args.limit)
    variants = [(s, b) for b in args.budgets for s in selectors]
    stats = Replayer(variants, settings=settings, progress=not args.no_progress).run(traces)
    rows = summarise(stats, _prices(args))
    if args.json:
        json.dump({"traces": len(traces), "files": args.traces, "limit": args.limit, "settings": settings,
                   "prices": vars(_prices(args)), "rows": rows}, sys.stdout, indent=1, default=float)
        print()
    else:
        print(f"{len(traces)} traces from {', '.join(args.traces)}; summariser={args.summariser}, omitted={args.omitted}")
        print(text_table(rows))
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from contextrender_adapters import sweep_report

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
        meta = {"file": path.name, "limit": args.limit, "budgets": budgets, "selectors": selectors, "settings": settings}
        if args.reuse_raw and raw.exists():
            saved = json.loads(raw.read_text())
            if {k: saved.get(k) for k in meta} == meta:
                datasets[path.stem] = saved
                print(f"{path.name}: reusing {raw}", file=sys.stderr)
                continue
        traces = load_traces([path], args.limit)
        print(f"{path.name}: {len(traces)} traces, budgets {budgets}, {len(selectors)} selectors", file=sys.stderr)
        stats = Replayer([(s, b) for b in budgets for s in selectors], settings=settings,
                         progress=not args.no_progress).run(traces)
        saved = meta | {"traces": len(traces), "stats": [v.to_dict() for v in stats.values()]}
        raw.write_text(json.dumps(saved))
        datasets[path.stem] = saved
    if args.replay_only:
        return 0
    report = sweep_report.write(datasets, out, _prices(args), command=" ".join(["contextrender", "sweep", *sys.argv[2:]]))
    print(f"wrote {report}")
    return 0
