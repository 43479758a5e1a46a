"""A context's working set with a commit pass that does not hash its new anchors. jaclang's commit
(`TieredMemory._collect_into`) hashes every anchor of the working set to find what changed, the new
ones too, whose hash it then ignores (a new anchor is written whole): a third of the commit on a
long ingestion, in which a server call cannot give way to the others. The Engine's contexts
(`OneCommitMemory`, set by adapters/local.py) and the server's (`server_memory_class`, set by the
server plugin's `create_j_context`, adapters/server/plugin.py) record new anchors without it."""

from __future__ import annotations

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import NodeAnchor, Root  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.changeset import ApplyReport, ChangeSet  # noqa: E402

__all__ = ["NewAnchorsUnhashed", "OneCommitMemory", "RebaselinedInSlices", "jaclang_checks_access", "server_memory_class"]

# Written anchors re-baselined between two give-way points after a server flush.
REBASELINE_SLICE = 500


class NewAnchorsUnhashed:
    """A working set's commit pass without hashing its new anchors. jaclang's commit
    (`TieredMemory._collect_into`) hashes every anchor of the working set to find what changed,
    the new ones too, whose hash it then ignores (a new anchor is written whole). Here new anchors
    are recorded as jaclang records them, without the hash (a third of the commit on a long
    ingestion), giving way to other calls between them on the server (engine/courtesy.jac: this
    pass runs before the write transaction), and without jaclang's write check of each when
    jaclang's own hooks answer it (it grants every new anchor); the anchors loaded from the store
    go through jaclang's own pass. Mixed into jaclang's working set (OneCommitMemory, the Engine's) and
    jac-scale's (`server_memory_class`, the server's)."""

    def _collect_into(self, changes: ChangeSet) -> None:
        from jaclang import JacRuntimeInterface as Jac

        working = list(self.__mem__.items())
        fresh = [anchor for (_, anchor) in working
                 if anchor.hash == 0 and anchor.persistent and anchor.is_populated()
                 and not ((intent := changes.intents.get(anchor.id)) is not None and intent.is_delete())]
        if fresh:
            new_ids = {anchor.id for anchor in fresh}
            self.__mem__.clear()
            self.__mem__.update((key, anchor) for (key, anchor) in working if key not in new_ids)
        try:
            super()._collect_into(changes)
        finally:
            if fresh:
                self.__mem__.clear()
                self.__mem__.update(working)
        from contextrender import core

        give_way = core.give_way
        # jaclang's write check answers yes for a new (unhashed) anchor; asked only when a plugin
        # answers the checks instead of jaclang.
        ask = not jaclang_checks_access()
        for anchor in fresh:
            give_way()
            # jaclang's rule for a new anchor: an edgeless node (but a root) is garbage, not data.
            if isinstance(anchor, NodeAnchor) and not isinstance(anchor.archetype, Root) and not anchor.edges:
                continue
            if not ask or Jac.check_write_access(anchor, op_hint="field_write"):
                changes.record_create(anchor)


class RebaselinedInSlices:
    """jaclang's re-baselining after a flush (`TieredMemory._post_apply`: every written anchor hashed
    again, so that a later commit of the context finds it unchanged), run by jaclang's own pass on
    slices of REBASELINE_SLICE written anchors, giving way to the other calls between slices
    (engine/courtesy.jac): after a 40,000-message ingestion it is seconds in which a server call
    otherwise never gives way. Each slice's pass sees only its own anchors' intents."""

    def _post_apply(self, apply_report: ApplyReport) -> None:
        applied = apply_report.applied
        if len(applied) <= REBASELINE_SLICE:
            super()._post_apply(apply_report)
            return
        from contextrender import core

        intents = self.changes.intents
        try:
            for start in range(0, len(applied), REBASELINE_SLICE):
                part = ApplyReport()
                part.applied = applied[start:start + REBASELINE_SLICE]
                self.changes.intents = {key: intents[key] for key in part.applied if key in intents}
                super()._post_apply(part)
                core.give_way()
        finally:
            self.changes.intents = intents


# The plugin that holds jaclang's own hook implementations (generate_plugin_helpers names it).
_JACLANG_IMPL = "JacRuntimeInterfaceImpl"


def jaclang_checks_access() -> bool:
    """Whether jaclang's own hooks alone answer the write check and the access level it asks
    (no plugin registered its own). Then a new anchor (hash 0, not yet stored) is writable:
    `check_access_level` answers WRITE for it before looking at any root, and the write check
    grants anything above CONNECT."""
    from jaclang.jac0core.runtime import plugin_manager

    return all([impl.plugin_name for impl in getattr(plugin_manager.hook, name).get_hookimpls()] == [_JACLANG_IMPL]
               for name in ("check_write_access", "check_access_level"))


class OneCommitMemory(NewAnchorsUnhashed, jac_memory.TieredMemory):
    """jaclang's working set for a context that commits once (the Engine's calls): new anchors
    unhashed at the commit. The Engine sets it on each call's context (adapters/local.py), whose
    re-baselining after the flush it also skips."""


_server_memory: list[type] = []


def server_memory_class() -> type:
    """jac-scale's working set (`ScaleTieredMemory`: its caches and backends as they are) with new
    anchors unhashed at the commit. A server context may commit more than once (the walker's
    commit, then the close's backstop), so jac-scale's re-baselining after each flush stays (the
    anchors it wrote are hashed then, and a later commit of the context finds them unchanged), in
    slices that give way between them."""
    if not _server_memory:
        from jac_scale.memory_hierarchy import ScaleTieredMemory

        _server_memory.append(type("ServerMemory", (NewAnchorsUnhashed, RebaselinedInSlices, ScaleTieredMemory), {
            "__doc__": server_memory_class.__doc__, "__module__": __name__}))
    return _server_memory[0]
