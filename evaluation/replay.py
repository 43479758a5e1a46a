"""Recorded traces (../shared/traces schema) replayed through the engine as a live agent would
see them, measured by Later-Used Result Recall (B.4), tokens, cost (equation 3) and render
latency, and summarised as rows and tables (`contextrender replay` and `sweep`: commands.py).

Each trace is ingested into one session, turn by turn; before each assistant turn j every
(selector, budget) renders `messages[:j]` in one engine call, and what it would have shown
the model is measured. The assistant turn j itself is only used afterwards, to label events.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Iterator

from contextrender.core import content_text
from contextrender_eval.evaluate import (
    AGE_BINS,
    Prices,
    PrefixCache,
    Usage,
    VariantStats,
    age_bin,
    cost_summary,
    call_arguments,
    named_handles,
    named_with_call,
    percentile,
    result_handles,
    reuse_events,
    visible_results,
)

Variant = tuple[str, int]


def registered_selectors() -> dict[str, Any]:
    from contextrender.core import SELECTORS  # the engine's registry (slow import: lazily)

    return SELECTORS


"""The halves of each trace file `--part` chooses from: settings are chosen on `train` (the traces at
even positions of each file: the 1st, 3rd, ...) and reported on `held-out` (the odd positions),
which nothing was tuned on; `all` is every trace."""
PARTS = ("all", "train", "held-out")


def load_traces(paths: Iterable[str | os.PathLike[str]], limit: int = 0, part: str = "all") -> list[dict]:
    """Traces of each file in `part` (PARTS), the first `limit` of them when limit > 0, tagged with
    `dataset`."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)} (got {part!r})")
    traces: list[dict] = []
    for path in paths:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if part != "all":
            rows = rows[0 if part == "train" else 1::2]
        for trace in rows[:limit] if limit > 0 else rows:
            trace["dataset"] = Path(path).stem
            traces.append(trace)
    return traces


def assistant_turns(engine: Any, session_id: str | list[str], messages: list[dict]) -> Iterator[tuple[int, dict]]:
    """Each assistant turn j of a transcript, as a live agent reaches it: the events before it
    are ingested (only the new ones, into each of the sessions named) before (j, messages[j]) is
    yielded, so the session holds `messages[:j]`; turn j itself is never ingested."""
    sessions = [session_id] if isinstance(session_id, str) else list(session_id)
    done = 0
    for j, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if messages[done:j]:
            for session in sessions:
                engine.ingest(session, messages[done:j], append=True)
        done = j
        yield j, message


def _embedding_use(selector: str) -> tuple[bool, bool]:
    """(embeds results, embeds a query per managed render) for a selector."""
    obj = registered_selectors()[selector]
    return obj.embeds_results, obj.embeds_query()


class Replayer:
    """Replays traces under a set of (selector, budget) variants into VariantStats."""

    def __init__(self, variants: list[Variant], *, settings: dict[str, Any] | None = None,
                 store: str | os.PathLike[str] | None = None, progress: bool = True, oracle: bool = False) -> None:
        from contextrender.core import get_tokenizer
        from contextrender.local import Engine

        self.variants = variants
        self.settings = dict(settings or {})
        self.tokenizer = get_tokenizer(self.settings.get("encoding", "o200k_base"))
        self.stats: dict[Variant, VariantStats] = {v: VariantStats(selector=v[0], budget=v[1], oracle=oracle) for v in variants}
        # The oracle-restore replay: before each reuse, a simulated model restores every result it
        # needs that the rendered history names; each variant but `full` then has its own session
        # (a restore changes the session's later renders).
        self.oracle = oracle
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
        from contextrender.core import EMBED_CLIP, latest_exchange_text

        messages = trace["messages"]
        key = f"{trace.get('dataset', '')}/{trace['id']}"
        store = self._root / f"t{abs(hash(key))}"
        engine = self._engine_cls(store)
        tok = self.tokenizer
        originals = {m["tool_call_id"]: m.get("content") for m in messages if m.get("role") == "tool"}
        texts = {content_text(m.get("content")) for m in messages if m.get("role") != "tool"}
        handles = result_handles(messages)
        calls = call_arguments(messages)
        by_turn: dict[int, list] = defaultdict(list)
        for event in reuse_events(messages):
            by_turn[event.turn].append(event)
        # The session each variant renders from: the trace's, or (oracle) one of its own.
        own = [v for v in self.variants if self.oracle and v[0] != "full"]
        session_of = {v: f"{trace['id']}#{i}" if v in own else trace["id"] for i, v in enumerate(self.variants)}
        shared = [v for v in self.variants if v not in own]
        memo: dict = {}
        caches = {v: PrefixCache(tok, memo) for v in self.variants}
        usage = {v: Usage() for v in self.variants}
        needed = {v: False for v in self.variants}
        embedded = sum(tok.count(content_text(m.get("content"))[:EMBED_CLIP]) for m in messages if m.get("role") == "tool")

        def request(v: Variant) -> dict:
            return {"budget": v[1], "selector": v[0], **self.settings}

        sessions = sorted(set(session_of.values()))
        for j, message in assistant_turns(engine, sessions, messages):
            results = dict(zip(shared, engine.render_variants(trace["id"], [request(v) for v in shared]))) if shared else {}
            for v in own:
                results[v] = engine.render_variants(session_of[v], [request(v)])[0]
            output = tok.message_tokens(message)
            query = tok.count(latest_exchange_text(messages[:j]))
            events = by_turn.get(j, [])
            for variant in self.variants:
                result = results[variant]
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
                stats.appends += int(result.mode == "append")
                stats.rerenders += int(result.mode == "re-render")
                if managed:
                    stats.latency_ms.append(result.render_ms)
                if events:
                    restored = self._reach(engine, session_of[variant], variant, result, events, originals, texts, handles, calls)
                    if restored and variant in own:
                        self._restore_round(engine, session_of[variant], result, restored, handles, caches[variant], use)
                        stats.restores += len(restored)
                        stats.restore_rounds += 1
                    if self.oracle:
                        visible = visible_results(result.messages, originals) | set(restored)
                        stats.hits_after_restores += sum(1 for e in events if e.call_id in visible)
            if bar is not None:
                bar.update(1)
        self._check_handles(engine, trace["id"], handles)
        for variant in self.variants:
            if self._embeds[variant[0]][0]:
                usage[variant].embedding += embedded
            self.stats[variant].usage[key] = usage[variant]
            self.stats[variant].needs_management[key] = needed[variant]
        shutil.rmtree(store, ignore_errors=True)

    def _reach(self, engine: Any, session: str, variant: Variant, result: Any, events: list, originals: dict,
               texts: set[str], handles: dict[str, str], calls: dict[str, str]) -> list[str]:
        """Counts each reuse event of this turn as in view, one restore away or unreachable; returns
        the call ids one restore away (each once, in event order): what the oracle restores."""
        stats = self.stats[variant]
        visible = visible_results(result.messages, originals)
        hidden = any(e.call_id not in visible for e in events)
        named = named_handles(result.messages, originals, texts) if hidden else set()
        described = named_with_call(result.messages, originals, texts, calls, handles) if hidden else set()
        away: list[str] = []
        for event in events:
            name = age_bin(event.age)
            stats.events[name] += 1
            if event.call_id in visible:
                stats.hits[name] += 1
            elif handles.get(event.call_id) in named:
                stats.named += 1
                stats.named_with_call += int(event.call_id in described)
                if event.call_id not in away:
                    away.append(event.call_id)
        return away

    def _restore_round(self, engine: Any, session: str, result: Any, call_ids: list[str], handles: dict[str, str],
                       cache: PrefixCache, use: Usage) -> None:
        """One restore round as the proxy makes it: the model answers the rendered request with a
        restore call per result (output), the proxy restores them and asks again with the round
        appended (input: the rendered request, cached, plus the round)."""
        from contextrender.core import RESTORE_TOOL

        calls = [{"id": f"restore-{i}", "type": "function",
                  "function": {"name": RESTORE_TOOL, "arguments": json.dumps({"handle": handles[c]})}}
                 for i, c in enumerate(call_ids)]
        answer = {"role": "assistant", "content": None, "tool_calls": calls}
        answers = [{"role": "tool", "tool_call_id": call["id"], "content": engine.restore(session, handles[c]).message.get("content")}
                   for call, c in zip(calls, call_ids)]
        inputs, cached = cache.request(list(result.messages) + [answer] + answers)
        use.output += self.tokenizer.message_tokens(answer)
        use.input += inputs
        use.cached += cached

    def _check_handles(self, engine: Any, session: str, handles: dict[str, str]) -> None:
        """The handles the replay assumed (ingestion order) are the engine's."""
        if not handles:
            return
        known = {d.call_id: d.handle for d in engine.explain(session).decisions}
        wrong = [c for c, h in handles.items() if c in known and known[c] != h]
        if wrong:
            raise RuntimeError(f"result {wrong[0]!r} has handle {known[wrong[0]]!r} in the engine, not {handles[wrong[0]]!r}")


class _NoBar:
    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None: ...
    def update(self, n: int = 1) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="turn", desc="replay", file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------- results


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
                "rerender_share": v.rerenders / v.managed if v.managed else 0.0,
                "reachable": v.reachable(), "named": v.named, "described": v.described(),
                "recall_after_restores": v.recall_after_restores() if v.oracle else float("nan"),
                "restores": v.restores, "restore_rounds": v.restore_rounds,
            }
            row.update(costs.get(selector, {}))
            rows.append(row)
    return rows


def _fmt(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:.{digits}f}"
    return str(value)


TABLE_COLUMNS = (
    ("selector", "selector", 0), ("B", "budget", 0), ("recall %", "recall", 1),
    ("in view or 1 restore %", "reachable", 1), ("in view or named with its call %", "described", 1),
    ("after restores %", "recall_after_restores", 1),
    ("restores", "restores", 0), ("events", "events", 0),
    ("<=3", "<=3", 1), ("4-10", "4-10", 1), ("11-25", "11-25", 1), (">25", ">25", 1),
    ("hist mean", "history_mean", 0), ("hist max", "history_max", 0), ("max/B", "history_max_over_budget", 2),
    ("input mean", "input_mean", 0), ("managed %", "managed_pct", 0),
    ("re-render %", "rerender_pct", 0), ("cache hit %", "cache_pct", 1),
    ("cost eq3/full", "ratio_eq3", 3), ("cost cache/full", "ratio_cached", 3),
    ("p50 ms", "latency_p50_ms", 2), ("p95 ms", "latency_p95_ms", 2),
)


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for row in rows:
        flat = dict(row) | row["recall_by_age"] | {
            "managed_pct": 100.0 * row["managed_share"], "rerender_pct": 100.0 * row["rerender_share"],
            "cache_pct": 100.0 * row.get("own_cache_rate", float("nan")),
        }
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
