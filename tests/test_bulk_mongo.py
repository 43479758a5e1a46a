"""The MongoDB store writing a call's documents in bulk (adapters/server/bulk_mongo.py), against the
MongoDB stand-in that scripts/scale_out.sh starts: the same documents as jac-scale's MongoBackend,
write by write, in a few round trips instead of one per anchor; the server's plugin choosing it
where MongoDB is configured."""

from __future__ import annotations

import math
import sqlite3
import uuid

import pytest
from pymongo import monitoring

from cluster import Cluster
from conftest import db_file, tool_rounds
from contextrender import Engine, store

WRITES = {"insert", "update", "delete", "findAndModify"}
OPENED: list = []  # the clients this module opens, closed when it ends (their monitor threads with them)


@pytest.fixture(scope="module")
def mongo_uri(tmp_path_factory):
    """The stand-in alone (with Redis, unused here), for this module."""
    from jac_scale.memory_hierarchy import _process_cache

    stores = Cluster(tmp_path_factory.mktemp("bulk_mongo"), servers=0)
    had_client = "mongo_client" in _process_cache
    try:
        yield stores.start().state["MONGODB_URI"]
    finally:
        # jac-scale keeps one client a process: the one made for the stand-in goes with it.
        if not had_client and "mongo_client" in _process_cache:
            OPENED.append(_process_cache.pop("mongo_client"))
        for client in OPENED:
            client.close()
        OPENED.clear()
        stores.stop()


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> str:
    """A SQLite store with one session of 60 tool rounds (a few hundred nodes and edges)."""
    engine = Engine(tmp_path_factory.mktemp("engine"))
    engine.ingest("s", tool_rounds(60))
    return db_file(engine)


class Commands(monitoring.CommandListener):
    """pymongo's command monitoring: the names of the commands sent, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def started(self, event) -> None:
        self.names.append(event.command_name)

    def succeeded(self, event) -> None:
        pass

    def failed(self, event) -> None:
        pass

    def writes(self) -> int:
        return sum(1 for name in self.names if name in WRITES)


def backend(kind: type, uri: str, collection: str) -> tuple:
    """A backend of `kind` on its own collection of the stand-in, its commands counted."""
    from pymongo import MongoClient

    commands = Commands()
    made = kind(mongo_url=uri, collection_name=collection)
    made.client = MongoClient(uri, event_listeners=[commands])
    OPENED.append(made.client)
    made.db = made.client[made.db_name]
    made.collection = made.db[collection]
    commands.names.clear()
    return made, commands


def anchors(path: str) -> dict:
    """Every anchor of the SQLite store at `path`, loaded anew (by id), an edge's ends the nodes loaded."""
    memory = store.SharedSqliteStore(path=path)
    ids = [uuid.UUID(row[0]) for row in sqlite3.connect(path).execute("SELECT id FROM anchors")]
    loaded = {id: memory.get(id) for id in ids}
    for anchor in loaded.values():  # an edge's ends: the nodes loaded here, not stubs
        if hasattr(anchor, "source"):
            anchor.source, anchor.target = loaded[anchor.source.id], loaded[anchor.target.id]
    return loaded


def created(loaded: dict):
    from jaclang.runtimelib.changeset import ChangeSet

    changes = ChangeSet()
    for anchor in loaded.values():
        changes.record_create(anchor)
    return changes


def documents(made) -> list[dict]:
    """The collection's documents by id, without the time each was written."""
    return sorted(({k: v for (k, v) in doc.items() if k != "updated_at"} for doc in made.collection.find()),
                  key=lambda doc: doc["_id"])


def test_a_call_of_n_anchors_is_written_in_a_few_round_trips_as_jac_scale_writes_them(mongo_uri, stored):
    from jac_scale.memory_hierarchy import MongoBackend

    from contextrender.server.bulk_mongo import BULK_BATCH, BulkMongoBackend

    (one_by_one, theirs) = backend(MongoBackend, mongo_uri, "one_by_one")
    (bulk, ours) = backend(BulkMongoBackend, mongo_uri, "bulk")
    first, second = anchors(stored), anchors(stored)
    n = len(first)
    assert n > BULK_BATCH // 2
    reported = one_by_one.apply(created(first)), bulk.apply(created(second))
    assert theirs.writes() >= n
    # Nodes, then edges: one bulk write each per BULK_BATCH operations.
    assert ours.writes() <= math.ceil(n / BULK_BATCH) + 2
    assert [sorted(map(str, r.applied)) for r in reported] == [sorted(map(str, first))] * 2
    assert not reported[1].failed and not reported[1].skipped
    assert documents(bulk) == documents(one_by_one) and len(documents(bulk)) == n
    # Read back by jac-scale's own backend: the same anchors.
    from jaclang.runtimelib.serializer import Serializer

    reader, _ = backend(MongoBackend, mongo_uri, "bulk")
    assert all(Serializer.serialize(reader.get(id), include_type=True) == Serializer.serialize(anchor, include_type=True)
               for (id, anchor) in first.items())


def test_edge_list_merges_field_updates_deletes_and_a_lost_race_as_jac_scale(mongo_uri, stored):
    """The same units of work on jac-scale's backend and on this one leave the same documents: an
    edge deleted (its endpoints' edge lists merged with an edge another writer added meanwhile, one
    round trip each), a field changed, and a unit that read a node another call changed since
    (nothing written, the conflict reported)."""
    from jac_scale.memory_hierarchy import MongoBackend
    from jaclang.jac0core.archetype import EdgeAnchor, NodeAnchor
    from jaclang.runtimelib.changeset import ChangeSet

    from contextrender.server.bulk_mongo import BulkMongoBackend

    results = []
    for (kind, name) in ((MongoBackend, "theirs"), (BulkMongoBackend, "ours")):
        made, commands = backend(kind, mongo_uri, f"merges_{name}")
        loaded = anchors(stored)
        made.apply(created(loaded))
        edge = next(a for a in loaded.values() if isinstance(a, EdgeAnchor) and len(a.source.edges) > 1)
        source = str(edge.source.id)
        # Another writer's edge, added after this call read the node.
        made.collection.update_one({"_id": source}, {"$push": {"data.edges": "another-writers-edge"}})
        node = next(a for a in loaded.values() if isinstance(a, NodeAnchor) and a.archetype is not None
                    and hasattr(a.archetype, "raw") and a.id not in (edge.source.id, edge.target.id))
        node.archetype.raw = "changed"
        changes = ChangeSet()
        changes.record_delete(edge)
        changes.record_update(node, {"raw"})
        commands.names.clear()
        report = made.apply(changes)
        assert not report.failed and not report.skipped
        stored_source = made.collection.find_one({"_id": source})["data"]["edges"]
        assert "another-writers-edge" in stored_source and str(edge.id) not in stored_source
        # A unit that read the source at the version it had before: it lost the race.
        stale = ChangeSet()
        node.archetype.raw = "lost"
        stale.record_update(node, {"raw"})
        stale.intents[node.id].cas_version = -5
        before = documents(made)
        lost = made.apply(stale)
        assert lost.conflicts and not lost.applied and documents(made) == before
        results.append((documents(made), sorted(map(str, report.applied)), commands.writes()))
    assert results[1][:2] == results[0][:2]
    # The two edge-list merges one at a time; the edge's delete and the field update one bulk write each.
    assert results[1][2] == 4


def test_the_server_plugin_answers_with_the_bulk_store_where_mongodb_is_configured(mongo_uri, monkeypatch):
    from contextrender.server.bulk_mongo import BulkMongoBackend
    from contextrender.server.plugin import ServerPlugin
    from contextrender.store import SharedSqliteStore

    monkeypatch.setenv("MONGODB_URI", mongo_uri)
    assert isinstance(ServerPlugin.get_persistent_memory({}), BulkMongoBackend)
    # The in-process Engine's contexts name their file: always SQLite.
    assert isinstance(ServerPlugin.get_persistent_memory({"db_path": "/tmp/unused.db"}), SharedSqliteStore)


# Run by the stand-in's Python (.venv-mongo): the same answers from mongoeco's memory engine with
# and without the stand-in's `_id` lookup, and the documents each answer considered.
STANDIN_CHECK = """
import json, sys
sys.path.insert(0, "scripts")
from mongoeco import MongoClient
from mongoeco.engines.memory import MemoryEngine
import mongo_standin

def run():
    considered = [0]
    looked_up = MemoryEngine._candidate_items_for_plan_locked
    def counted(self, *args, **options):
        found = looked_up(self, *args, **options)
        considered[0] += len(found)
        return found
    MemoryEngine._candidate_items_for_plan_locked = counted
    col = MongoClient(engine=MemoryEngine())["t"]["c"]
    col.insert_many([{"_id": f"k{i}", "v": i} for i in range(2000)] + [{"_id": 5, "v": "int"}])
    considered[0] = 0
    answers = [[d["_id"] for d in col.find({"_id": {"$in": ["k7", "k2", "zz"]}})],
               [d["_id"] for d in col.find({"_id": {"$in": ["k7", "k2"]}, "v": 7})],
               [d["_id"] for d in col.find({"$and": [{"_id": "k3"}, {"v": 3}]})],
               col.find_one({"_id": "absent"}), col.find_one({"_id": 5})["v"],
               str(col.update_one({"_id": "new"}, {"$set": {"v": 1}}, upsert=True).upserted_id),
               col.delete_one({"_id": "k1"}).deleted_count, col.count_documents({"_id": {"$in": ["k1", "k0"]}})]
    MemoryEngine._candidate_items_for_plan_locked = looked_up
    return answers, considered[0]

plain = run()
mongo_standin._ids_found_at_once()
print(json.dumps([plain, run()]))
"""


def test_the_stand_in_finds_ids_without_scanning_and_answers_as_mongoeco(mongo_uri):
    """scripts/mongo_standin.py: `_id` equality and `$in` of string ids (found or not) consider only
    the documents with those ids; mongoeco's memory engine considered the whole collection."""
    import json
    import subprocess

    from cluster import REPO

    done = subprocess.run([str(REPO / ".venv-mongo" / "bin" / "python"), "-c", STANDIN_CHECK], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=True)
    ((plain, scanned), (patched, considered)) = json.loads(done.stdout)
    assert patched == plain == [["k2", "k7"], ["k7"], ["k3"], None, "int", "new", 1, 1]
    assert scanned > 2000 and considered <= 12
