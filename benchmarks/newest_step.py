"""The newest step's results as the model meets them: the share of managed renders in which a
result answering the rendered history's last assistant message (what the model has just asked
for) is not shown whole, but stubbed or cut (its text starts with ContextRender's notice).

    .venv/bin/python benchmarks/newest_step.py ../shared/traces/tau_bench.jsonl --budget 1000,2000 \\
        --part held-out --limit 40 [--set stickiness=2 --set headroom=0.3]

Every argument but `--of` goes to `contextrender replay` (its --help); the replay runs as usual,
and each render of the selector `--of` (contextrender by default) whose full history exceeds B is
counted. The replay's recall does not count these results (a step's reuse of what it just asked
for is not a reuse event), so this figure is the one that shows a policy leaving them out. It is a
token-count figure: it does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import sys

from contextrender import local
from contextrender.cli import main as cli_main

NOTICE = "[ContextRender"


def newest_not_whole(messages: list[dict]) -> bool:
    """Whether a tool message after the last assistant message starts with ContextRender's notice."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    return any(m.get("role") == "tool" and str(m.get("content") or "").startswith(NOTICE) for m in messages[last + 1:])


def count_while(replay_args: list[str], selector: str) -> dict:
    """Run `contextrender replay replay_args`, counting the managed renders of `selector`."""
    counts = {"managed": 0, "newest_not_whole": 0}
    real = local.Engine.render_variants

    def counted(self, session_id, variants, **settings):
        results = real(self, session_id, variants, **settings)
        for result in results:
            if result.selector == selector and result.full_history_tokens > result.budget:
                counts["managed"] += 1
                counts["newest_not_whole"] += newest_not_whole(result.messages)
        return results

    local.Engine.render_variants = counted
    try:
        cli_main(["replay", *replay_args])
    except SystemExit as done:
        if done.code not in (0, None):
            raise
    finally:
        local.Engine.render_variants = real
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--of", default="contextrender", help="the selector whose renders are counted")
    (args, replay_args) = parser.parse_known_args(argv)
    if not replay_args:
        parser.error("give the replay's arguments: a trace file, --budget ...")
    if "--selector" not in replay_args:
        replay_args += ["--selector", args.of]
    counts = count_while(replay_args, args.of)
    share = 100 * counts["newest_not_whole"] / max(1, counts["managed"])
    print(f"newest step not whole ({args.of}): {counts['newest_not_whole']} of {counts['managed']} managed renders, {share:.2f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
