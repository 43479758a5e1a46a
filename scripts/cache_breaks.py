"""Where a replay's prefix cache breaks (docs/restores.md: what the fold index costs): replays traces with
`contextrender` and `full` at one budget, as `contextrender replay` does, and sorts contextrender's
requests by the first message that differs from the session's previous request: none (an append:
only the new messages are uncached), the fold marker, the fold index, or later. For breaks at the
marker it also counts those whose next message was unchanged (the marker alone broke the cache).

    .venv/bin/python scripts/cache_breaks.py ../shared/traces/mini_swe_agent_deepseek.jsonl \
        --budget 6000 --limit 12 [--set fold_index_place=marker ...]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from contextrender_eval import replay
from contextrender_eval.evaluate import PrefixCache

MARKER = "[ContextRender: the oldest messages"


def _opening(messages: list[dict], prefix: str) -> int:
    return next((k for k, m in enumerate(messages) if isinstance(m.get("content"), str) and m["content"].startswith(prefix)), -1)


def counting_cache(counts: Counter, heading: str) -> type:
    """A PrefixCache that adds, per request, where the cached prefix ended to `counts`."""

    class Counting(PrefixCache):
        def request(self, messages: list[dict]) -> tuple[int, int]:
            before = self.previous
            shared = next((k for k, (a, b) in enumerate(zip(before, messages)) if a is not b and a != b), min(len(before), len(messages)))
            inputs, cached = super().request(messages)
            counts["requests"] += 1
            counts["uncached tokens"] += inputs - cached
            marker, index = _opening(messages, MARKER), _opening(messages, heading)
            if index >= 0:
                counts["fold index tokens sent"] += self.counts[index]
            if shared >= len(before):
                counts["appends"] += 1
                return inputs, cached
            counts["breaks"] += 1
            counts["uncached tokens at breaks"] += inputs - cached
            if shared == marker:
                counts["breaks at the marker"] += 1
                old = _opening(before, MARKER)
                if old >= 0 and old + 1 < len(before) and marker + 1 < len(messages) and before[old + 1] == messages[marker + 1]:
                    counts["... with the next message unchanged"] += 1
            elif shared == index:
                counts["breaks at the fold index"] += 1
            return inputs, cached

    return Counting


def main() -> None:
    import contextrender.core  # noqa: F401 (makes the Jac modules importable)
    from engine.notices import FOLD_INDEX_HEADING

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--budget", type=int, required=True)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=JSON",
                        help="a render setting, its value as JSON (a bare word is a string)")
    args = parser.parse_args()
    settings: dict[str, Any] = {}
    for item in args.settings:
        name, _, value = item.partition("=")
        try:
            settings[name] = json.loads(value)
        except ValueError:
            settings[name] = value
    counts: Counter = Counter()
    plain = replay.PrefixCache
    counting = counting_cache(counts, FOLD_INDEX_HEADING)
    made = [0]

    def cache(*a: Any, **k: Any) -> PrefixCache:
        # One cache per variant and trace, in the variants' order: contextrender's are counted.
        made[0] += 1
        return counting(*a, **k) if made[0] % 2 == 1 else plain(*a, **k)

    replay.PrefixCache = cache
    try:
        player = replay.Replayer([("contextrender", args.budget), ("full", args.budget)], settings=settings, progress=False)
        rows = replay.summarise(player.run(replay.load_traces(args.traces, args.limit)))
    finally:
        replay.PrefixCache = plain
    row = next(r for r in rows if r["selector"] == "contextrender")
    print(f"in view {row['recall']:.1f}%, in view or 1 restore {row['reachable']:.1f}%, cost cache/full {row['ratio_cached']:.3f}")
    for name, value in counts.items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
