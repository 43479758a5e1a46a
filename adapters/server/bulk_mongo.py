"""jac-scale's MongoDB store (`MongoBackend`) with a call's documents written in bulk. jac-scale's
`apply` writes one document per anchor, each its own round trip and its own command in MongoDB: a
big ingestion creates several anchors per message. `BulkMongoBackend.apply` sends each stage's
creates, field updates and deletes in `bulk_write`s of BULK_BATCH unordered operations, the same
operation each as jac-scale's (an upsert of the whole document for a create, a `$set` of the changed
fields, a delete by id), and gives way to the server's other calls between them
(engine/courtesy.jac). On the one-process MongoDB stand-in this shortened a 10,000-message call
(x0.57-0.68) and lengthened the other users' waits (docs/performance.md, "Many users on MongoDB
and Redis"). The server plugin's `get_persistent_memory` (adapters/server/plugin.py)
answers with it where MongoDB is configured, as it answers with the SQLite store otherwise.

What stays jac-scale's, unchanged:
- **The order of the stages** (nodes, edges, edge lists, fields, edge deletes, node deletes): a
  bulk write holds operations of one stage only, so a call cut short (kill -9) leaves at most an
  unreferenced document, never a reference to a missing one. Within a stage no write depends on
  another (an operation whose dependency is in the pending bulk write waits for it to be sent).
- **A failed write poisons its dependents**: an operation MongoDB refused (its index in the bulk
  write's errors) fails, and what depends on it is skipped, as when jac-scale's single write raised.
- **The read-set check before anything is written** (a read-gated node whose stored version moved:
  the whole call writes nothing and replays), in one `$in` read.
- **Edge-list merges** (`EDGE_LIST_DELTA`: another writer's edges kept, the node's version compared
  and bumped) go through jac-scale's own `_put_node_atomic`, one node at a time: each needs the
  merged document back, and a call changes the edge lists of few stored nodes.
- **The stored documents**, byte for byte (jac-scale's `_anchor_to_doc` and `serialize_fields`):
  stores written before read and write as they did.

Not done here: re-hashing each written anchor as jac-scale's single writes do. The commit
re-baselines every applied anchor right after `apply` (`TieredMemory._post_apply`, in slices that
give way: adapters/working_set.py), so that hash was computed twice, the first time without giving way."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from jac_scale.memory_hierarchy import MongoBackend, _anchor_to_doc, logger
from jaclang.runtimelib.changeset import ApplyReport, ChangeSet, WriteIntent, WriteOp
from jaclang.runtimelib.exceptions import WriteConflict
from jaclang.runtimelib.serializer import Serializer
from jaclang.runtimelib.utils import to_uuid

__all__ = ["BULK_BATCH", "BulkMongoBackend"]

# Operations in one bulk write (a stage with more is sent in several, giving way between them).
BULK_BATCH = 100


class BulkMongoBackend(MongoBackend):
    """jac-scale's MongoBackend whose `apply` writes a stage's documents in bulk (module docstring)."""

    def apply(self, changeset: ChangeSet) -> ApplyReport:
        report = ApplyReport()
        if changeset.is_empty() or self.client is None:
            return report
        stages = changeset.staged()
        if self._race_lost(stages, report):
            return report
        poisoned: set = set()
        for stage in stages:
            pending: list[tuple[WriteIntent, Any]] = []
            queued: set = set()  # the pending intents' anchors
            for intent in stage:
                if intent.depends_on & queued:
                    self._send(pending, report, poisoned)
                    queued.clear()
                if deps := intent.depends_on & poisoned:
                    dep = next(iter(deps))
                    report.skipped[intent.anchor.id] = f"dependency {dep} failed"
                    poisoned.add(intent.anchor.id)
                    logger.error(f"MongoDB apply: skipping {intent.op.name} on {intent.anchor.id}: dependency {dep} failed")
                    continue
                if intent.op == WriteOp.EDGE_LIST_DELTA:
                    self._apply_alone(intent, report, poisoned)
                    continue
                try:
                    pending.append((intent, self._operation(intent)))
                    queued.add(intent.anchor.id)
                except Exception as error:  # the document could not be made (jac-scale's single write raised here)
                    self._failed(intent, error, report, poisoned)
                if len(pending) >= BULK_BATCH:
                    self._send(pending, report, poisoned)
                    queued.clear()
            self._send(pending, report, poisoned)
        return report

    def _race_lost(self, stages: list[list[WriteIntent]], report: ApplyReport) -> bool:
        """jac-scale's check before writing: a node this call read (cas_version set) whose stored
        version moved since means the call lost a race; then nothing is written (the conflicts are
        in `report`, and the request replays)."""
        read_gated = {str(to_uuid(intent.anchor.id)): intent.cas_version
                      for stage in stages for intent in stage if intent.cas_version is not None}
        if not read_gated:
            return False
        stored = {str(doc.get("_id")): int(doc.get("data", {}).get("version", 0))
                  for doc in self.collection.find({"_id": {"$in": list(read_gated)}}, {"data.version": 1})}
        for (key, expected) in read_gated.items():
            if key in stored and stored[key] != expected:
                conflict = WriteConflict(anchor_id=to_uuid(key), expected_version=expected, actual_version=stored[key])
                report.failed[conflict.anchor_id] = conflict.message()
                report.conflicts.append(conflict)
        return bool(report.conflicts)

    def _operation(self, intent: WriteIntent) -> Any:
        """The bulk write's operation for `intent`, the write jac-scale's `_apply_one` makes; None
        where it writes nothing (an anchor that is not persistent, no field to set)."""
        from pymongo import DeleteOne, UpdateOne

        from contextrender import core

        core.give_way()  # making a document serialises the anchor
        anchor = intent.anchor
        key = str(to_uuid(anchor.id))
        if intent.is_delete():
            return DeleteOne({"_id": key})
        if not anchor.persistent:
            return None
        if intent.op == WriteOp.FIELD_UPDATE:
            fields = Serializer.serialize_fields(anchor, intent.fields) if intent.fields else {}
            if not fields:
                return None
            update: dict[str, object] = {f"data.archetype.{name}": value for (name, value) in fields.items()}
            update["updated_at"] = datetime.now(timezone.utc).isoformat()
            return UpdateOne({"_id": key}, {"$set": update})
        self.put_count += 1
        return UpdateOne({"_id": key}, {"$set": _anchor_to_doc(anchor)}, upsert=True)

    def _send(self, pending: list[tuple[WriteIntent, Any]], report: ApplyReport, poisoned: set) -> None:
        """Send the pending operations in one unordered bulk write (then empty `pending`): those
        MongoDB refused fail, the others are applied; nothing is known of a bulk write that raised
        otherwise (the connection lost): all of its operations fail."""
        from pymongo.errors import BulkWriteError

        from contextrender import core

        sent = [(intent, operation) for (intent, operation) in pending if operation is not None]
        refused: dict[int, str] = {}
        try:
            if sent:
                self.collection.bulk_write([operation for (_, operation) in sent], ordered=False)
        except BulkWriteError as error:
            details = error.details or {}
            if details.get("writeConcernErrors"):
                refused = {i: str(details["writeConcernErrors"][0].get("errmsg")) for i in range(len(sent))}
            refused |= {int(e["index"]): str(e.get("errmsg")) for e in details.get("writeErrors", [])}
        except Exception as error:
            refused = {i: f"{type(error).__name__}: {error}" for i in range(len(sent))}
        failed = {id(sent[i][0]): message for (i, message) in refused.items()}
        for (intent, _) in pending:
            if id(intent) in failed:
                self._failed(intent, failed[id(intent)], report, poisoned)
            else:
                report.applied.append(intent.anchor.id)
        pending.clear()
        core.give_way()

    def _apply_alone(self, intent: WriteIntent, report: ApplyReport, poisoned: set) -> None:
        """One intent through jac-scale's own write (`_apply_one`), as its `apply` runs each."""
        try:
            self._apply_one(intent)
            report.applied.append(intent.anchor.id)
        except WriteConflict as conflict:
            # A lost race: poisons like a failed write, and the request replays.
            poisoned.add(intent.anchor.id)
            report.failed[intent.anchor.id] = conflict.message()
            report.conflicts.append(conflict)
            logger.debug(f"MongoDB apply: write conflict on {intent.anchor.id}: {conflict.message()}")
        except Exception as error:
            self._failed(intent, error, report, poisoned)

    @staticmethod
    def _failed(intent: WriteIntent, error: Exception | str, report: ApplyReport, poisoned: set) -> None:
        poisoned.add(intent.anchor.id)
        report.failed[intent.anchor.id] = str(error)
        described = f"{type(error).__name__}: {error}" if isinstance(error, Exception) else error
        logger.error(f"MongoDB apply: {intent.op.name} failed for {intent.anchor.id}: {described}")
