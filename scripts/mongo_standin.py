"""A MongoDB wire-protocol stand-in for tests: mongoeco's proxy server (pure Python, OP_MSG) on a
loopback port, over mongoeco's memory engine or its SQLite engine (--sqlite PATH). Not a MongoDB:
docs/scale-out.md says what was and was not tested with it. Runs until SIGTERM/SIGINT.

    .venv-mongo/bin/python scripts/mongo_standin.py --port 27017 [--sqlite .jac/mongo.sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from mongoeco.core.aggregation.extensions import register_aggregation_expression_operator
from mongoeco.engines.memory import MemoryEngine
from mongoeco.engines.sqlite import SQLiteEngine
from mongoeco.wire.proxy import AsyncMongoEcoProxyServer


def _not(document, spec, variables, dialect, context):
    """MongoDB's `$not` aggregation expression, `{$not: [expr]}`: true when expr is false, null,
    0 or missing. mongoeco 4.11 lacks it (its query operator `$not` exists, this one does not:
    "Unrecognized expression '$not'", code 168), and jac-scale 0.2.31 uses it in the update
    pipeline that merges a node's edge list (MongoBackend._put_node_atomic): without it, every
    write that adds an edge fails and is only logged."""
    (operand,) = context.require_expression_args("$not", spec, 1, 1)
    value = context.evaluate_expression_with_missing(document, operand, variables)
    return not (value is not context.missing_sentinel and dialect.expression_truthy(value))


def _absent_id_found_at_once() -> None:
    """mongoeco 4.11's memory engine finds a document by `_id` in its storage dict, but when no
    document has that `_id` (every upsert that creates one) it falls back to matching the filter
    against every document of the collection: each new document cost a scan, 17 writes a second
    at 13,000 documents (docs/performance.md, "Many users on MongoDB and Redis"). A string `_id`
    (jac-scale's anchor ids) that is not a storage key matches nothing (no collation: MongoDB's
    `_id` equality is exact), so the candidates are none, as MongoDB's `_id` index answers."""
    original = MemoryEngine._candidate_items_for_plan_locked

    def candidates(self, coll, query_plan, *, collation, **options):
        wanted = self._direct_id_lookup_from_plan(query_plan)
        if isinstance(wanted, str) and collation is None and self._storage_key(wanted) not in coll:
            return []
        return original(self, coll, query_plan, collation=collation, **options)

    MemoryEngine._candidate_items_for_plan_locked = candidates


async def serve(host: str, port: int, sqlite: str | None) -> None:
    register_aggregation_expression_operator("$not", _not)
    _absent_id_found_at_once()
    engine = SQLiteEngine(sqlite) if sqlite else MemoryEngine()
    server = AsyncMongoEcoProxyServer(engine=engine, host=host, port=port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        print(f"mongo stand-in listening on {server.address.uri}", flush=True)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sqlite", metavar="PATH", help="mongoeco's SQLite engine on this file (default: its memory engine)")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.sqlite))


if __name__ == "__main__":
    main()
