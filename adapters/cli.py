"""The `contextrender` command. Each subcommand lives in its own module, which adds its parser
with `register(subparsers)` and sets `func` to the function that runs it: `proxy` in the
adapters, `replay` and `sweep` in the evaluation harness."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, imported only when the command line is parsed; none loads the engine until
# its command runs (the engine is slow to load).
COMMAND_MODULES = ("contextrender.proxy.command", "contextrender.server.serve", "contextrender_eval.commands")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="contextrender",
        description="ContextRender: a context manager for LLM agents (graph, Tool-Flow Analysis, rendering).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
