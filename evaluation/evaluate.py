"""The measurements of a replay: Later-Used Result Recall (paper B.4), the simulated provider
prefix cache, and inference cost by equation 3 (4.2, C.2). Pure functions, no engine."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any



# The engine's text helpers, imported at first use: the command line builds its parser with this
# module's Prices, and `contextrender --help` does not wait for jaclang to load.
def content_text(content: Any) -> str:
    from contextrender.core import content_text as text

    return text(content)


def recall_tokens(text: str) -> Any:
    from contextrender.core import recall_tokens as tokens

    return tokens(text)

# Result-age bins of the paper's Table 2 (turns between a result's creation and its reuse).
AGE_BINS: tuple[tuple[str, int, int], ...] = (
    ("<=3", 0, 3),
    ("4-10", 4, 10),
    ("11-25", 11, 25),
    (">25", 26, 10**9),
)


def age_bin(age: int) -> str:
    for name, low, high in AGE_BINS:
        if low <= age <= high:
            return name
    raise ValueError(f"negative age {age}")


@dataclass(frozen=True)
class ReuseEvent:
    """Assistant turn `turn` (message position) repeats a token first seen in the tool result
    at position `result` (answering `call_id`); `age` counts model invocations between them."""

    turn: int
    result: int
    call_id: str
    age: int


def _assistant_text(message: dict) -> str:
    # Prose, code and tool-call arguments (the function name is the tool, not a value).
    parts = [content_text(message.get("content"))]
    for call in message.get("tool_calls") or []:
        parts.append(str((call.get("function") or {}).get("arguments") or ""))
    return "\n".join(parts)


def reuse_events(messages: list[dict]) -> list[ReuseEvent]:
    """B.4 lexical reuse events of one transcript: a token (recall_tokens) is linked to a tool
    result only when its first transcript appearance is in that result (not in a system or user
    message or an earlier assistant turn); a later assistant turn holding it labels an event;
    each distinct (turn, result) pair counts once."""
    source: dict[str, int] = {}  # token -> position of the result that introduced it, or -1
    call_turn: dict[str, int] = {}
    result_turn: dict[int, int] = {}
    result_call: dict[int, str] = {}
    invocation = 0
    events: list[ReuseEvent] = []
    for position, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            invocation += 1
            tokens = recall_tokens(_assistant_text(message))
            hit = sorted({source[t] for t in tokens if source.get(t, -1) >= 0})
            for result in hit:
                events.append(ReuseEvent(position, result, result_call[result], invocation - result_turn[result]))
            for token in tokens:
                source.setdefault(token, -1)
            for call in message.get("tool_calls") or []:
                call_turn[call["id"]] = invocation
        elif role == "tool":
            call_id = message.get("tool_call_id", "")
            result_turn[position] = call_turn.get(call_id, invocation)
            result_call[position] = call_id
            for token in recall_tokens(content_text(message.get("content"))):
                source.setdefault(token, position)
        else:
            for token in recall_tokens(content_text(message.get("content"))):
                source.setdefault(token, -1)
    return events


def visible_results(rendered: list[dict], originals: dict[str, Any]) -> set[str]:
    """Call ids whose complete original result text is in the rendered messages (B.4
    visibility: a stub, a compaction or a summary does not count)."""
    return {
        m["tool_call_id"]
        for m in rendered
        if m.get("role") == "tool" and m.get("tool_call_id") in originals and m.get("content") == originals[m["tool_call_id"]]
    }


# A handle as ContextRender's texts name it (engine/notices.jac): `r<n>` standing alone.
HANDLE_NAMED = re.compile(r"(?<![\w/.:-])(r\d+)(?![\w/.-])")


def written_texts(rendered: list[dict], originals: dict[str, Any], texts: set[str]) -> list[str]:
    """The texts of the rendered messages that ContextRender wrote (a stub, a compacted result's
    note, the fold marker and its index, a condensed message's note): every message content that
    is not the recorded one (`originals`: tool results by call id; `texts`: the other messages'
    content texts)."""
    out = []
    for m in rendered:
        content = m.get("content")
        if m.get("role") == "tool":
            if content != originals.get(m.get("tool_call_id")):
                out.append(content_text(content))
        elif content is not None:
            text = content_text(content)
            if text and text not in texts:
                out.append(text)
    return out


def named_handles(rendered: list[dict], originals: dict[str, Any], texts: set[str]) -> set[str]:
    """Handles named in text ContextRender wrote into the rendered history: results one restore away."""
    return {h for text in written_texts(rendered, originals, texts) for h in HANDLE_NAMED.findall(text)}


# A word of a call's arguments, as the measure of "named with what produced it" looks for it.
ARGUMENT_WORD = re.compile(r"[\w][\w./-]{2,}")


def call_arguments(messages: list[dict]) -> dict[str, str]:
    """Call id -> the words of its arguments' values (a JSON object's values, else the text)."""
    out: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            arguments = str((call.get("function") or {}).get("arguments") or "")
            try:
                parsed = json.loads(arguments) if arguments else None
            except ValueError:
                parsed = None
            values = parsed.values() if isinstance(parsed, dict) else [arguments]
            out[call.get("id")] = " ".join(v if isinstance(v, str) else json.dumps(v) for v in values)
    return out


def named_with_call(rendered: list[dict], originals: dict[str, Any], texts: set[str], calls: dict[str, str],
                    handles: dict[str, str]) -> set[str]:
    """Call ids of results named next to what produced them in text ContextRender wrote: a stub (or
    a compacted result's note) in the result's own place, under its call; or a handle followed, before
    the next handle, by a word of its call's arguments (a fold index entry or line)."""
    out: set[str] = set()
    call_of = {h: c for c, h in handles.items()}
    for m in rendered:
        call_id = m.get("tool_call_id")
        if m.get("role") == "tool" and call_id in originals and m.get("content") != originals[call_id]:
            if handles.get(call_id) in HANDLE_NAMED.findall(content_text(m.get("content"))):
                out.add(call_id)
    for text in written_texts(rendered, originals, texts):
        for line in text.splitlines():
            found = list(HANDLE_NAMED.finditer(line))
            for k, match in enumerate(found):
                call_id = call_of.get(match.group(1))
                if call_id is None or call_id in out:
                    continue
                end = found[k + 1].start() if k + 1 < len(found) else len(line)
                words = set(ARGUMENT_WORD.findall(calls.get(call_id, "")))
                if words & set(ARGUMENT_WORD.findall(line[match.end():end])):
                    out.add(call_id)
    return out


def result_handles(messages: list[dict]) -> dict[str, str]:
    """Call id -> handle of each tool result of a transcript ingested in order into one session
    (ingestion numbers results r1, r2, ...; the replay checks this against the engine)."""
    out: dict[str, str] = {}
    for m in messages:
        if m.get("role") == "tool" and m.get("tool_call_id") not in out:
            out[m["tool_call_id"]] = f"r{len(out) + 1}"
    return out


class PrefixCache:
    """A provider prefix cache simulated per session: the leading messages of a request that
    are identical to the previous request's count as cached (message granularity, no minimum
    length). Also gives each request's exact input tokens."""

    def __init__(self, tokenizer: Any, memo: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.previous: list[dict] = []
        self.counts: list[int] = []
        # Token counts by message content, shareable between the sessions of one trace.
        self.memo: dict = {} if memo is None else memo

    def tokens(self, message: dict) -> int:
        content = message.get("content")
        calls = tuple(
            (c.get("id"), (c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
            for c in message.get("tool_calls") or []
        )
        if not isinstance(content, (str, type(None))):
            return self.tokenizer.message_tokens(message)
        key = (message.get("role"), message.get("tool_call_id"), content, calls)
        count = self.memo.get(key)
        if count is None:
            count = self.memo[key] = self.tokenizer.message_tokens(message)
        return count

    def request(self, messages: list[dict]) -> tuple[int, int]:
        """(input tokens, cached tokens) of the next request."""
        shared = 0
        for before, now in zip(self.previous, messages):
            if before is not now and before != now:
                break
            shared += 1
        counts = self.counts[:shared] + [self.tokens(m) for m in messages[shared:]]
        self.previous, self.counts = messages, counts
        return sum(counts), sum(counts[:shared])


@dataclass(frozen=True)
class Prices:
    """USD per million tokens: equation 3's standardised prices."""

    input: float = 2.0
    cached_input: float = 0.5
    output: float = 8.0
    embedding: float = 0.13


@dataclass
class Usage:
    """Token usage of one task (trace) under one method: P (with its cached part), O, E."""

    input: int = 0
    cached: int = 0
    output: int = 0
    embedding: int = 0

    def add(self, other: "Usage") -> None:
        self.input += other.input
        self.cached += other.cached
        self.output += other.output
        self.embedding += other.embedding


def cost_eq3(usage: Usage, rho: float, prices: Prices = Prices()) -> float:
    """Equation 3: C = ([2(1 - rho) + 0.5 rho] P + 8 O + 0.13 E) / 1e6, rho a fixed cache rate."""
    per_input = prices.input * (1.0 - rho) + prices.cached_input * rho
    return (per_input * usage.input + prices.output * usage.output + prices.embedding * usage.embedding) / 1e6


def cost_cached(usage: Usage, prices: Prices = Prices()) -> float:
    """Equation 3 with each method's own (simulated) cached tokens instead of a fixed rho."""
    return (
        prices.input * (usage.input - usage.cached)
        + prices.cached_input * usage.cached
        + prices.output * usage.output
        + prices.embedding * usage.embedding
    ) / 1e6


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(len(ordered) * q / 100.0)))
    return ordered[rank - 1]


@dataclass
class VariantStats:
    """One (selector, budget) over the traces of one replay."""

    selector: str
    budget: int
    # Replayed with the oracle's restores (recall_after_restores is measured).
    oracle: bool = False
    events: dict[str, int] = field(default_factory=lambda: {name: 0 for name, _, _ in AGE_BINS})
    hits: dict[str, int] = field(default_factory=lambda: {name: 0 for name, _, _ in AGE_BINS})
    renders: int = 0
    managed: int = 0
    history_sum: int = 0
    history_max: int = 0
    input_sum: int = 0
    input_max: int = 0
    latency_ms: list[float] = field(default_factory=list)
    # Per trace: usage, and whether the full history exceeded B before some invocation (T_CM).
    usage: dict[str, Usage] = field(default_factory=dict)
    needs_management: dict[str, bool] = field(default_factory=dict)
    summary_calls: int = 0
    # Managed renders that appended to the previous one, and that re-rendered (stable policy).
    appends: int = 0
    rerenders: int = 0
    # Reachability of the reuse events not in view: one restore away (text ContextRender wrote in
    # the rendered history names the result's handle), else unreachable.
    named: int = 0
    # Of those, named next to what produced them (`named_with_call`): a stub under its own call, or
    # a fold index entry with a word of its call's arguments.
    named_with_call: int = 0
    # The oracle-restore replay: results restored before a reuse, the rounds they took (one per
    # turn that restores), and the events in view after them.
    restores: int = 0
    restore_rounds: int = 0
    hits_after_restores: int = 0

    def recall(self, bin_name: str | None = None) -> float:
        names = [bin_name] if bin_name else list(self.events)
        total = sum(self.events[n] for n in names)
        return 100.0 * sum(self.hits[n] for n in names) / total if total else float("nan")

    def event_count(self, bin_name: str | None = None) -> int:
        return self.events[bin_name] if bin_name else sum(self.events.values())

    def reachable(self) -> float:
        """Share (%) of reuse events in view or one restore away."""
        total = self.event_count()
        return 100.0 * (sum(self.hits.values()) + self.named) / total if total else float("nan")

    def described(self) -> float:
        """Share (%) of reuse events in view or named next to what produced them."""
        total = self.event_count()
        return 100.0 * (sum(self.hits.values()) + self.named_with_call) / total if total else float("nan")

    def recall_after_restores(self) -> float:
        """Share (%) of reuse events in view once the oracle's restores are answered."""
        total = self.event_count()
        return 100.0 * self.hits_after_restores / total if total else float("nan")

    def to_dict(self) -> dict:
        return {
            "selector": self.selector, "budget": self.budget, "oracle": self.oracle,
            "events": self.events, "hits": self.hits, "renders": self.renders, "managed": self.managed,
            "history_sum": self.history_sum, "history_max": self.history_max,
            "input_sum": self.input_sum, "input_max": self.input_max,
            "latency_ms": [round(x, 3) for x in self.latency_ms],
            "usage": {k: vars(v) for k, v in self.usage.items()},
            "needs_management": self.needs_management, "summary_calls": self.summary_calls,
            "appends": self.appends, "rerenders": self.rerenders, "named": self.named,
            "named_with_call": self.named_with_call, "restores": self.restores, "restore_rounds": self.restore_rounds,
            "hits_after_restores": self.hits_after_restores,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "VariantStats":
        stats = cls(selector=data["selector"], budget=data["budget"], oracle=data.get("oracle", False))
        for name in ("events", "hits", "renders", "managed", "history_sum", "history_max", "input_sum",
                     "input_max", "latency_ms", "needs_management", "summary_calls"):
            setattr(stats, name, data[name])
        # Raw files written before the stable policy (appends, rerenders) or before reachability lack them.
        for name in ("appends", "rerenders", "named", "named_with_call", "restores", "restore_rounds", "hits_after_restores"):
            setattr(stats, name, data.get(name, 0))
        stats.usage = {k: Usage(**v) for k, v in data["usage"].items()}
        return stats


def cost_summary(stats: dict[str, VariantStats], reference: VariantStats, prices: Prices = Prices()) -> dict[str, dict]:
    """Mean cost per task over the tasks whose full history exceeded B (C.1's T_CM), priced by
    equation 3 with rho observed for `full` (its simulated cache rate on those tasks), and by
    each method's own simulated cache; both also as ratios to `full` (C.2: ratio of means)."""
    tasks = sorted(t for t, needed in reference.needs_management.items() if needed)
    out: dict[str, dict] = {}
    if not tasks:
        return out
    full_input = sum(reference.usage[t].input for t in tasks)
    rho = sum(reference.usage[t].cached for t in tasks) / full_input if full_input else 0.0
    base_eq3 = sum(cost_eq3(reference.usage[t], rho, prices) for t in tasks) / len(tasks)
    base_cached = sum(cost_cached(reference.usage[t], prices) for t in tasks) / len(tasks)
    for name, variant in stats.items():
        eq3 = sum(cost_eq3(variant.usage[t], rho, prices) for t in tasks) / len(tasks)
        cached = sum(cost_cached(variant.usage[t], prices) for t in tasks) / len(tasks)
        inputs = sum(variant.usage[t].input for t in tasks)
        out[name] = {
            "tasks": len(tasks), "rho_full": rho, "cost_eq3": eq3, "ratio_eq3": eq3 / base_eq3 if base_eq3 else float("nan"),
            "cost_cached": cached, "ratio_cached": cached / base_cached if base_cached else float("nan"),
            "own_cache_rate": sum(variant.usage[t].cached for t in tasks) / inputs if inputs else 0.0,
        }
    return out
