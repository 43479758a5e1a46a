"""A digest of every stored row of two sessions, for a change that must not change what is stored:
run it on two checkouts and compare the lines it prints.

    PYTHONHASHSEED=0 .venv/bin/python scripts/row_digest.py [--results 300] [--dump ROWS.txt]

It ingests a session of RESULTS tool results (the SWE trace's, as benchmarks/engine_bench.py
builds them) in one call and another in rounds of 10 messages, renders both, and hashes every row
of the store in id order, the edge lists in their stored order. The ids come from a generator
seeded before anything is imported (both checkouts make the same ids, so a merged edge list's
order is compared too); the clock's values (`at`, `created_at`, `updated_at`, `*_ms`, also inside
JSON texts and the compressed render log) are left out. PYTHONHASHSEED=0 fixes the order of sets
of strings. `--dump` writes the rows compared, one a line, for a `diff` when the digests differ.

A second digest, of the anchors as they read back through the store (`SharedSqliteStore.get` of
each stored id, in id order: a node's class, its archetype's fields as jaclang serialises them and
its edge ids in the loaded order; an edge's class, fields, source and target), does not depend on
how the rows hold them: it must stay equal where a change of the stored format is meant to keep
the graph as it reads (`--dump-read` writes those lines).
"""

import random
import sys
import uuid

_ids = random.Random(20261206)
uuid.uuid4 = lambda: uuid.UUID(int=_ids.getrandbits(128), version=4)  # before any import makes an id

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sqlite3  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from engine_bench import history, trace_turns  # noqa: E402

from contextrender import Engine  # noqa: E402
from contextrender.rows import field_names, serialised_value  # noqa: E402
from contextrender.store import SharedSqliteStore  # noqa: E402
from walkers.renderlog import PACKED_LOG, unpacked_log  # noqa: E402  (the Engine's import makes walkers/ importable)

CLOCK = {"at", "created_at", "updated_at"}


def scrub(value: object) -> object:
    """`value` without the clock's values, JSON texts and the compressed render log opened."""
    if isinstance(value, dict):
        return {k: scrub(v) for (k, v) in value.items() if k not in CLOCK and not k.endswith("_ms")}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if isinstance(value, str) and value.startswith(PACKED_LOG):
        return "log:" + json.dumps(scrub(json.loads(unpacked_log(value))))
    if isinstance(value, str) and value[:1] in "{[" and value[-1:] in "}]":
        try:
            return "json:" + json.dumps(scrub(json.loads(value)))
        except ValueError:
            return value
    return value


def read_back(db: Path) -> list[str]:
    """Each stored anchor of `db` as the store loads it (a fresh store, nothing kept), one JSON line
    each, in id order, the clock's values left out (`scrub`)."""
    from uuid import UUID

    from jaclang.jac0core.archetype import EdgeAnchor, NodeAnchor

    memory = SharedSqliteStore(path=str(db))
    with sqlite3.connect(db) as conn:
        ids = [row[0] for row in conn.execute("SELECT id FROM anchors ORDER BY id")]
    lines = []
    try:
        for key in ids:
            anchor = memory.get(UUID(key))
            arch = anchor.archetype
            cls = type(arch)
            fields = {name: serialised_value(getattr(arch, name)) for name in field_names(arch) or ()}
            line: list = [key, type(anchor).__name__, cls.__module__, cls.__name__, json.dumps(scrub(fields))]
            if isinstance(anchor, NodeAnchor):
                line.append([str(edge.id) for edge in anchor.edges])
            elif isinstance(anchor, EdgeAnchor):
                line += [str(anchor.source.id), str(anchor.target.id)]
            lines.append(json.dumps(line))
    finally:
        memory.close()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=int, default=300)
    parser.add_argument("--dump", type=Path, help="write the rows compared here, one a line")
    parser.add_argument("--dump-read", type=Path, help="write the anchors read back here, one a line")
    args = parser.parse_args()
    messages = history(trace_turns(), args.results)
    with tempfile.TemporaryDirectory() as folder:
        engine = Engine(Path(folder) / "store")
        engine.ingest("one", messages)
        engine.render("one", messages, budget=6000)
        for end in range(10, len(messages) + 10, 10):
            engine.ingest("rounds", messages[:end])
            if end % 100 == 0:
                engine.render("rounds", messages[:end], budget=6000)
        engine.render("rounds", messages, budget=6000)
        engine.close()
        (lines, read) = ([], [])
        for db in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.read_bytes()[:15] == b"SQLite format 3"):
            with sqlite3.connect(db) as conn:
                for row in conn.execute("SELECT id, type, arch_module, arch_type, fingerprint, data, format_version FROM anchors ORDER BY id"):
                    lines.append(json.dumps([*row[:5], json.dumps(scrub(json.loads(row[5]))), row[6]]))
            read += read_back(db)
    if args.dump:
        args.dump.write_text("\n".join(lines) + "\n")
    if args.dump_read:
        args.dump_read.write_text("\n".join(read) + "\n")
    print(f"{len(lines)} rows, sha256 {hashlib.sha256(''.join(lines).encode()).hexdigest()}")
    print(f"{len(read)} anchors read back, sha256 {hashlib.sha256(''.join(read).encode()).hexdigest()}")


if __name__ == "__main__":
    main()
