"""Prompt-cache breakpoints for Anthropic Messages: how many input tokens the cache serves when
ContextRender re-renders the history, with the client's breakpoints alone against the client's
plus the proxy's breakpoint at the end of the stable prefix.

    .venv/bin/python benchmarks/cache_breakpoints.py [--limit 10] [--budget 6000]

Recorded runs (../shared/traces, mini-SWE by default) are replayed as an agent loop in Messages
format: before each recorded assistant turn the conversation so far is one request, converted to
Messages turns with breakpoints where Claude Code puts them (the last system block and the last
block of the last message). Each request goes through the proxy's format layer and the engine
in-process (`anthropic.FORMAT`, `Engine.render`), and is then priced under Anthropic's documented
cache rules, simulated: a breakpoint writes an entry for the prefix up to it (if at least 1,024
tokens); a request reads the longest prefix that an earlier request wrote at a block boundary at
most 20 blocks before one of its breakpoints; tokens between the read prefix and the last
breakpoint are written, the rest is uncached input. Every entry is taken as still alive (an agent
loop calls again within the 5-minute TTL). Tokens are the `claude` estimate. Cost is in units of
uncached input tokens: cache reads 0.1, cache writes 1.25 (Anthropic's 5-minute prices).

Variants: `full` (no ContextRender, the client's breakpoints), `rendered` (ContextRender, the
client's breakpoints where the blocks they were on survived), `rendered+stable` (plus a breakpoint
at the end of the prefix identical to the session's previous request), `stable only` (the client's
message breakpoints moved there), `proxy` (what the proxy sends: moved when the history was
re-rendered, added when it was sent as it came).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from contextrender import Engine  # noqa: E402
from contextrender.proxy.messages.wire import FORMAT, breakpoints, to_messages  # noqa: E402
from engine.measure import get_tokenizer  # noqa: E402
from tests.conftest import anthropic_conversation, load_traces  # noqa: E402

TOK = get_tokenizer("claude")
# The full recorded sets beside the checkout (the tests' fixture holds only a few traces).
SHARED_TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
MIN_CACHEABLE = 1024
LOOKBACK = 20
EPHEMERAL = {"type": "ephemeral"}


def client_request(messages: list[dict]) -> dict:
    """The conversation so far as Claude Code sends it: breakpoints on the system prompt's last
    block and on the last block of the last message."""
    system, turns = anthropic_conversation(messages, thinking=False)
    system[-1]["cache_control"] = EPHEMERAL
    turns[-1]["content"][-1]["cache_control"] = EPHEMERAL
    return {"model": "claude-sonnet-4-5", "max_tokens": 4096, "system": system, "messages": turns}


def blocks_of(body: dict) -> list[tuple[dict, int]]:
    """The request's blocks in cache order (system, then messages) with their token counts."""
    out: list[tuple[dict, int]] = [(b, TOK.count(b["text"])) for b in body["system"]]
    for turn in body["messages"]:
        content = turn["content"] if isinstance(turn["content"], list) else [{"type": "text", "text": turn["content"]}]
        for (j, block) in enumerate(content):
            text = block.get("text") or block.get("thinking") or ""
            if block["type"] == "tool_use":
                text = block["name"] + json.dumps(block["input"])
            elif block["type"] == "tool_result":
                text = block["content"] if isinstance(block["content"], str) else json.dumps(block["content"])
            out.append((block, TOK.count(text) + (4 if j == 0 else 0)))
    return out


class Cache:
    """Anthropic's prompt cache as documented, for one conversation."""

    def __init__(self) -> None:
        self.entries: set[bytes] = set()
        self.read = self.written = self.uncached = 0
        self.cost = 0.0

    def request(self, body: dict) -> None:
        blocks = blocks_of(body)
        prefix, cumulative, running, state = [], [], 0, hashlib.blake2b(digest_size=16)
        for (block, tokens) in blocks:
            state.update(json.dumps({k: v for (k, v) in block.items() if k != "cache_control"}, sort_keys=True).encode())
            prefix.append(state.copy().digest())
            running += tokens
            cumulative.append(running)
        marks = [p for (p, (block, _)) in enumerate(blocks) if block.get("cache_control")]
        hit = -1
        for p in marks:
            for q in range(p, max(p - LOOKBACK, -1), -1):
                if prefix[q] in self.entries:
                    hit = max(hit, q)
                    break
        read = cumulative[hit] if hit >= 0 else 0
        cacheable = [p for p in marks if cumulative[p] >= MIN_CACHEABLE]
        written = cumulative[max(cacheable)] - read if cacheable and max(cacheable) > hit else 0
        uncached = running - read - written
        self.entries.update(prefix[p] for p in cacheable)
        self.read += read
        self.written += written
        self.uncached += uncached
        self.cost += uncached + 1.25 * written + 0.1 * read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="mini_swe_agent_deepseek.jsonl")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--budget", type=int, default=6000)
    args = parser.parse_args()

    engine = Engine(tempfile.mkdtemp(prefix="cache-bench-"))
    variants = {name: Cache() for name in ("full", "rendered", "rendered+stable", "stable only", "proxy")}
    memos: dict[str, object] = {}
    requests = managed = 0
    started = time.perf_counter()
    for (t, trace) in enumerate(load_traces(args.trace, SHARED_TRACES)[: args.limit]):
        messages = trace["messages"]
        memos = {}
        for j in [i for (i, m) in enumerate(messages) if m["role"] == "assistant"][1:]:
            body = client_request(messages[:j])
            variants["full"].request(body)
            exchange = FORMAT.parse(body)
            result = engine.render(f"trace-{t}", exchange.messages, budget=args.budget, selector="contextrender")
            managed += bool(result.selected)
            rendered = list(result.messages)
            turns = to_messages(rendered, exchange.messages, exchange.origins, body["messages"])
            variants["rendered"].request(dict(body, messages=turns))
            added = copy.deepcopy(turns)
            memos["added"] = breakpoints(body, added, memos.get("added"))
            variants["rendered+stable"].request(dict(body, messages=added))
            moved = copy.deepcopy(turns)
            memos["moved"] = breakpoints(body, moved, memos.get("moved"), move=True)
            variants["stable only"].request(dict(body, messages=moved))
            # What the proxy sends (anthropic._Exchange.build).
            sent = FORMAT.parse(body).build(rendered, exchange.messages, memos.get("proxy"))
            memos["proxy"] = sent[1]
            variants["proxy"].request(sent[0])
            requests += 1
    print(f"{args.trace} (first {args.limit} runs): {requests} requests, {managed} rendered under B = {args.budget} "
          f"({time.perf_counter() - started:.0f} s); tokens are the claude estimate")
    print(f"  {'variant':16} {'input':>11} {'cache read':>11} {'written':>10} {'uncached':>10} {'read %':>7} {'cost':>11} {'cost/full':>9}")
    base = variants["full"].cost
    for (name, cache) in variants.items():
        total = cache.read + cache.written + cache.uncached
        print(f"  {name:16} {total:11,} {cache.read:11,} {cache.written:10,} {cache.uncached:10,} {100 * cache.read / total:6.1f}% "
              f"{cache.cost:11,.0f} {cache.cost / base:9.3f}")


if __name__ == "__main__":
    main()
