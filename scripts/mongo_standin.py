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
from mongoeco.core.query_plan import AndCondition, EqualsCondition, InCondition
from mongoeco.engines._memory_collection import MemoryCollection
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


def _ids_found_at_once() -> None:
    """mongoeco 4.11's memory engine finds a document by `_id` in its storage dict only when the
    filter is `{_id: X}` and X is stored. A new `_id` (every upsert that creates a document) and
    `{_id: {$in: [...]}}` (jac-scale's batch reads and its version check before each commit) fell
    back to matching the filter against every document of the collection: 17 writes a second at
    13,000 documents, a 5-id read 360 ms at 12,000, the stand-in serving nothing else meanwhile
    (docs/performance.md, "Many users on MongoDB and Redis"). For string ids (jac-scale's) and no
    collation (MongoDB's `_id` equality is exact) the candidates are the stored documents with
    those ids, in the collection's natural order, as MongoDB's `_id` index answers; the engine
    still matches the whole filter against each."""
    original = MemoryEngine._candidate_items_for_plan_locked

    def candidates(self, coll, query_plan, *, collation, natural_order_limit=None, **options):
        wanted = _wanted_ids(query_plan)
        if wanted is None or collation is not None or not isinstance(coll, (dict, MemoryCollection)):
            return original(self, coll, query_plan, collation=collation, natural_order_limit=natural_order_limit, **options)
        keys = {self._storage_key(value) for value in wanted}
        if isinstance(coll, MemoryCollection):
            ordered = coll.ordered_keys(keys, limit=natural_order_limit)
        else:
            ordered = [key for key in coll if key in keys]
        return [(key, coll[key]) for key in ordered]

    MemoryEngine._candidate_items_for_plan_locked = candidates


def _wanted_ids(query_plan) -> list[str] | None:
    """The string ids a filter's `_id` equality or `$in` (alone, or in a top-level `$and`) allows;
    None for any other filter."""
    clauses = query_plan.clauses if isinstance(query_plan, AndCondition) else (query_plan,)
    for clause in clauses:
        if isinstance(clause, EqualsCondition) and clause.field == "_id" and isinstance(clause.value, str):
            return [clause.value]
        if isinstance(clause, InCondition) and clause.field == "_id" and all(isinstance(v, str) for v in clause.values):
            return list(clause.values)
    return None


async def serve(host: str, port: int, sqlite: str | None) -> None:
    register_aggregation_expression_operator("$not", _not)
    _ids_found_at_once()
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
