"""Stored rows merged on their text, byte for byte the rows jaclang's merge writes (the store,
adapters/store.py, calls them inside its flush's transaction):

- **An edge-list change and dirty fields** (`merge_stored_text`): jaclang deserialises the stored
  node, sets the change and serialises it whole (a result's text, a session's system prompt and
  render log); here the change is made on the row's JSON (tests/test_store.py compares it with
  jaclang's).
- **Edges added to a stored node by its id** (`merge_edge_ids`, adapters/by_id.py), the node never
  loaded: its merged edge list stored apart from its row (adapters/edge_lists.py).

A row the store read or wrote before (the session, the render epoch, a result reused at every call)
is taken from its remembered parse when its stored text is the same (`_seen`). The memo is the process's: the threads of a
server writing different store files share it, so it is changed under a lock (its size is exact).
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from typing import NamedTuple
from uuid import UUID

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Access, NodeAnchor, Permission, Root  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.changeset import WriteIntent  # noqa: E402
from jaclang.runtimelib.exceptions import WriteConflict  # noqa: E402
from jaclang.runtimelib.serializer import Serializer  # noqa: E402
from jaclang.runtimelib.typecache import get_field_types  # noqa: E402

from contextrender.edge_lists import write_edge_list  # noqa: E402
from contextrender.rows import INSERT_ROW, id_text, row_time, serialised_value  # noqa: E402

__all__ = ["merge_edge_ids", "merge_stored_text"]

class _Seen(NamedTuple):
    """A node row the store read or wrote in its current format: its text, that text parsed (never
    changed: a merge changes a copy), and, once a merge by id needed them, its edge ids as
    integers."""

    text: str
    data: dict
    ints: list[int] | None = None


# Row id -> the node row last read or written in its current format (`_Seen`). A merge whose stored
# text is the one seen takes its parse instead of `json.loads` (the row it wrote the call before:
# a session, a render epoch, a result reused again and again): a memo of a pure function of the
# text, so never stale. Emptied when its texts pass SEEN_CHARS_MAX characters.
# Changed only under `_seen_lock` (the server's threads share it): its character count stays exact.
_seen: dict[str, _Seen] = {}
_seen_chars = [0]
_seen_lock = threading.Lock()
SEEN_CHARS_MAX = 4_000_000


def _remember(key: str, seen: _Seen | None) -> None:
    """Remember (or, None, forget) the row of `key`."""
    with _seen_lock:
        old = _seen.pop(key, None)
        if old is not None:
            _seen_chars[0] -= len(old.text)
        if seen is None:
            return
        if _seen_chars[0] + len(seen.text) > SEEN_CHARS_MAX:
            _seen.clear()
            _seen_chars[0] = 0
        _seen[key] = seen
        _seen_chars[0] += len(seen.text)


def _no_number(word: str) -> float:
    raise ValueError(f"{word} is no JSON number")


def _current_node(key: str, stored: tuple, cls: type | None) -> _Seen | None:
    """The stored node row, parsed, when it is stored in the current format of `cls` (its class
    now: the same module and name, fingerprint and fields, so the stored row is what jaclang would
    write for it) and holds no float that is no number (`json.dumps` writes NaN or Infinity, which
    SQLite's JSON functions refuse: the store's view could not read such a row with its edge list
    apart, adapters/edge_lists.py), else None."""
    (_, arch_module, arch_type, fingerprint, text, format_version) = stored
    if cls is None or (arch_module, arch_type) != (cls.__module__, cls.__name__) or format_version != jac_memory.SQLITE_DB_FORMAT_VERSION \
            or not fingerprint or fingerprint != getattr(cls, "__jac_fingerprint__", None) or stored[0] != "NodeAnchor":
        return None
    seen = _seen.get(key)
    if seen is not None and seen.text == text:
        return seen
    try:
        data = json.loads(text, parse_constant=_no_number)
    except ValueError:
        return None
    stored_arch = data.get("archetype") if isinstance(data, dict) else None
    if not isinstance(stored_arch, dict) or set(stored_arch) - {"__type__", "__module__"} != set(get_field_types(cls)) \
            or not isinstance(data.get("edges"), list) or not isinstance(data.get("version"), int):
        return None
    seen = _Seen(text, data)
    _remember(key, seen)
    return seen


def _id_list(edges: list[str]) -> str:
    """The JSON text of a list of edge ids as `str(UUID)` writes them (hex digits and dashes: no
    escapes), without `json.dumps` (a Python call, its encoder made anew, for each list)."""
    return '["' + '", "'.join(edges) + '"]' if edges else "[]"


# Edge ids as str(UUID) writes them, each followed by a comma.
_CANONICAL_IDS = re.compile(r"(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12},)*")


def merge_edge_ids(conn: sqlite3.Connection, key: str, stored: tuple, added_ids: list[UUID],
                   apart: tuple[str, int] | None = None) -> bool:
    """The edge list and version jaclang's merge writes for a stored node that a call gave new edges
    (`added_ids`, in the order it linked them) without changing anything else, made from the
    stored row alone (the call never loaded the node) and stored apart from the row, which stays as
    it is (adapters/edge_lists.py). `apart`: the node's edge list (its JSON text) and version
    already stored apart, None when its row holds them. A load would have given the node the
    stored edges, in their order, and the stored ids as the baseline of its edge delta
    (`NodeAnchor.edge_delta`); the call appended the new edges. The same sets are built here from
    the same ids in the same order (a set's order follows how it was built), so the merged list
    is the one jaclang's merge (and `merge_stored_text`) writes, and the version is advanced as it
    advances it. Only for a row in the current format of its class (`_current_node`); False for
    any other, which the store merges as jaclang would the node loaded from it."""
    (arch_module, arch_type) = stored[1:3]
    cls = Serializer._get_class(arch_module, arch_type) if arch_module and arch_type else None
    seen = _current_node(key, stored, cls)
    if seen is None or isinstance(cls, type) and issubclass(cls, Root):
        return False
    # The ids as the integers of their UUIDs (a UUID hashes as its integer and equals by it, so the
    # same sets are laid out alike and iterate in the same order), read without making a UUID.
    if apart is None:
        (texts, version, stored_ids) = (seen.data["edges"], seen.data["version"], seen.ints)
    else:
        (texts, version, stored_ids) = (json.loads(apart[0]), apart[1], None)
    if stored_ids is None and _CANONICAL_IDS.fullmatch(",".join(texts) + ("," if texts else "")):
        stored_ids = [int(e.replace("-", ""), 16) for e in texts]
        if apart is None:
            _remember(key, seen._replace(ints=stored_ids))
    elif stored_ids is None:  # (not in jaclang's rows: each id as str(UUID) writes it)
        stored_ids = [UUID(e).int for e in texts]
        texts = [str(UUID(int=e)) for e in stored_ids]
    text_of = dict(zip(stored_ids, texts))
    for id in added_ids:
        text_of[id.int] = id_text(id)
    new = [id.int for id in added_ids]
    stored_set = set(stored_ids)
    if len(new) == 1 and new[0] not in stored_set:
        # The usual link: one edge that is not stored. The delta below is then ({it}, {}): what
        # is stored stays, so nothing is removed.
        (added, removed) = ({new[0]}, set())
    else:
        # NodeAnchor.edge_delta on the node as loaded, the new edges appended.
        initial = set(frozenset(stored_ids))  # (a list is iterated as a generator is: the same set)
        current = set(stored_ids + new)
        (added, removed) = (set(current - initial), set(initial - current))
    merged = list((stored_set | added) - removed)
    if added or removed:
        version += 1
    write_edge_list(conn, key, _id_list([text_of[e] for e in merged]), version)
    return True


def _same_access(stored: object, access: object) -> bool:
    """Whether the stored access (parsed) is `access` as jaclang serialises it, compared as jaclang's
    merge compares them (their JSON texts with sorted keys): for the usual access, no root granted,
    without making either text (an equal value of another type, say `true` for 1, is another text)."""
    if type(access) is Permission and type(access.roots) is Access and not access.roots.anchors and type(stored) is dict:
        level = access.all.value
        return stored == {"all": level, "roots": {"anchors": {}}} and type(stored["all"]) is type(level)
    serialised = Serializer._serialize_value(access, include_type=True)
    return json.dumps(stored, sort_keys=True, default=str) == json.dumps(serialised, sort_keys=True, default=str)


def merge_stored_text(conn: sqlite3.Connection, key: str, stored: tuple, intent: WriteIntent,
                      edge_lists: dict[int, list[str]] | None = None) -> bool:
    """jaclang's merge of an edge-list change and dirty fields into the stored row, made on the
    row's JSON instead of on the node deserialised from it and serialised whole again: the
    stored values are kept as stored, only the edge list, the version, the access and the dirty
    fields are replaced, each as jaclang would serialise it. So a node's large contents (a
    result's text, a session's system prompt and render log) are not deserialised, serialised
    and hashed again when the node gets an edge or a counter changes. The row is written whole,
    its edge list in it (a list stored apart goes: adapters/edge_lists.py; an edge-only change
    stored apart here too was measured dearer in the proxy: docs/performance.md). Only for a
    node stored in the current format of its current class (the same fields, so the stored row
    is what jaclang would write for it); False for anything else, which jaclang merges.
    `edge_lists`, when given, gets the node's stored edge list after the merge (none when its
    row was deleted), by its id's number."""
    anchor = intent.anchor
    arch = anchor.archetype
    if intent.is_create() or not isinstance(anchor, NodeAnchor) or arch is None or isinstance(arch, Root):
        return False
    cls = type(arch)
    (arch_module, arch_type, fingerprint) = stored[1:4]
    seen = _current_node(key, stored, cls)
    if seen is None:
        return False
    fields = get_field_types(cls)
    data = dict(seen.data)  # (the parse is remembered as it is: the merge changes a copy)
    stored_arch = data["archetype"] = dict(data["archetype"])
    changed = False
    own_ids = [e.id for e in anchor.edges]
    edges = [str(e) for e in own_ids]
    if data["edges"] != edges:
        delta = anchor.edge_delta()
        if delta is not None:
            # As jaclang: the delta applied to the stored list (a concurrent writer's edges
            # survive), in the order its set gives, after its version check.
            added, removed = set(delta[0]), set(delta[1])
            if (added or removed) and intent.cas_version is not None and data["version"] != intent.cas_version:
                raise WriteConflict(anchor_id=anchor.id, expected_version=intent.cas_version, actual_version=data["version"])
            # The stored ids the node holds too are taken from its edges, not parsed again (the
            # same ids, so the same set and its order); only a concurrent writer's are parsed.
            id_of = dict(zip(edges, own_ids))
            text_of = dict(zip(own_ids, edges))
            stored_ids = [id_of.get(e) or UUID(e) for e in data["edges"]]
            known = set(stored_ids) | set(own_ids)
            merged = (set(stored_ids) | added) - removed
            data["edges"] = [text_of.get(e) or str(e) for e in merged if e in known]
            if added or removed:
                data["version"] += 1
                anchor.version = data["version"]
        else:
            data["edges"] = edges
        if not data["edges"]:
            conn.execute("DELETE FROM anchors WHERE id = ?", (key,))
            _remember(key, None)
            return True
        changed = True
    if not _same_access(data.get("access"), anchor.access):
        data["access"] = Serializer._serialize_value(anchor.access, include_type=True)
        changed = True
    dirty = [f for f in intent.fields if f in fields]
    for name in dirty:
        stored_arch[name] = serialised_value(getattr(arch, name))
    if intent.fields:
        changed = True  # as jaclang: a flagged field is written, even to the same value
    if changed:
        try:  # (a float that is no number: written as jaclang writes it, not remembered: `_current_node`)
            (text, seen) = (json.dumps(data, allow_nan=False), True)
        except ValueError:
            (text, seen) = (json.dumps(data), False)
        conn.execute(INSERT_ROW, (key, "NodeAnchor", arch_module, arch_type, fingerprint, text,
                               jac_memory.SQLITE_DB_FORMAT_VERSION, row_time()))
        _remember(key, _Seen(text, data) if seen else None)
    if edge_lists is not None:
        edge_lists[anchor.id.int] = data["edges"]
    return True
