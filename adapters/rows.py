"""The rows the store (adapters/store.py) writes, byte for byte the rows jaclang writes, made
without jaclang's generic serialiser where it can be:

- **A created anchor's row** (`anchor_row`): jaclang's `_anchor_to_row` (the anchor through
  `Serializer.serialize(anchor, include_type=True)`, dumped by `json.dumps`, with its class's
  columns).
- **A stored row merged on its text** (`merge_stored_text`): jaclang's merge of an edge-list
  change and dirty fields, made on the row's JSON (tests/test_store.py compares it with jaclang's).
  A row the store read or wrote before (the session, the render epoch, a result reused at every
  call) is taken from its remembered parse when its stored text is the same (`_seen`), and a merge
  by id writes anew only the row's text from its edge list on (`merge_edge_ids`).

jaclang's serialiser finds an archetype's fields with `dir()` on each instance (every class of the
MRO merged and sorted, each name looked up twice to skip the callable ones) and sends every value
through a chain of `isinstance` tests: a third of the samples of a 2,000-result ingestion went to it. Here the
names are worked out once per class (and per shape of the instance's own attributes), and values of
the JSON types (exact `str`, `int`, `float`, `bool`, `None`, and lists and dicts of them) are taken as
they are; anything else (an enum, an object, a subclass of a JSON type) goes to jaclang's
`Serializer._serialize_value`, and a root, a walker's or an object's anchor, an archetype with
schema rules (`__jac_schema__`) or with a descriptor jaclang's `dir()` walk would evaluate (a
property) to jaclang's `_anchor_to_row` whole. tests/test_rows.py compares the rows with jaclang's.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import types
from datetime import datetime, timezone
from typing import Any, NamedTuple
from uuid import UUID

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Access, EdgeAnchor, NodeAnchor, Permission, Root  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.changeset import WriteIntent  # noqa: E402
from jaclang.runtimelib.exceptions import WriteConflict  # noqa: E402
from jaclang.runtimelib.serializer import Serializer  # noqa: E402
from jaclang.runtimelib.typecache import get_field_types  # noqa: E402

__all__ = ["INSERT_ROW", "anchor_row", "field_names", "forget_id_texts", "id_text", "row_time", "time_rows", "merge_edge_ids", "merge_stored_text",
           "serialised_value"]

# jaclang's insert of a whole row (SqliteMemory._merge_write, its branch for a row not stored yet).
INSERT_ROW = """
    INSERT OR REPLACE INTO anchors
        (id, type, arch_module, arch_type, fingerprint, data, format_version, updated_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""

# Class attributes jaclang's walk always finds callable on an instance (unless the instance shadows them).
_METHODS = (types.FunctionType, staticmethod, classmethod)
# archetype class -> its public names that are not methods, or None when jaclang's serialiser must
# serialise its instances (schema rules, a property or another descriptor, a custom `dir()`).
_classes: dict[type, frozenset | None] = {}
# (archetype class, the instance's own attribute names) -> the names jaclang's walk visits, in order.
_names: dict[tuple, tuple[str, ...]] = {}


# UUID -> its text: a row names each id about three times (an edge's own row, its ends' edge lists)
# and every row its root; `str(UUID)` is Python (1.8 µs here) where a lookup is 0.2 µs. Keyed by
# value, so an entry is never stale; emptied when it reaches ID_TEXTS_MAX and after each flush
# (`forget_id_texts`: a UUID is an object the cyclic collector tracks, and a big call's ids kept
# here made every later full collection walk them: the next calls' ingestion x0.85).
_id_texts: dict[UUID, str] = {}
ID_TEXTS_MAX = 200_000


def id_text(id: UUID) -> str:
    """`str(id)`, remembered until the flush ends."""
    text = _id_texts.get(id)
    if text is None:
        if len(_id_texts) >= ID_TEXTS_MAX:
            _id_texts.clear()
        text = _id_texts[id] = str(id)
    return text


def forget_id_texts() -> None:
    """Drop the remembered ids' texts (the store does after each flush)."""
    _id_texts.clear()


# The time written in every row of the flush this thread is making (`time_rows`).
_flush = threading.local()


def time_rows(now: str | None) -> None:
    """Write `now` (an ISO time) as the time of every row this thread writes from now on, or (None)
    each row's own time again: the store gives each flush one time, instead of asking the clock
    for each row (a few µs a row)."""
    _flush.time = now


def row_time() -> str:
    """A row's `updated_at`: its flush's time, else now."""
    now = getattr(_flush, "time", None)
    return now if now is not None else datetime.now(timezone.utc).isoformat()


def _class_names(cls: type) -> frozenset | None:
    """The public names of `cls` (its MRO's) that are not methods, or None when its instances are
    left to jaclang's serialiser."""
    if cls in _classes:
        return _classes[cls]
    found: frozenset | None = None
    if not hasattr(cls, "__jac_schema__") and not hasattr(cls, "__getattr__") and cls.__dir__ is object.__dir__ \
            and type(cls).__dir__ is type.__dir__ and cls.__getattribute__ is object.__getattribute__:
        data = set()
        for name in dir(cls):
            if name.startswith("_"):
                continue
            static = next(klass.__dict__[name] for klass in cls.__mro__ if name in klass.__dict__)
            if isinstance(static, _METHODS):
                continue
            if hasattr(type(static), "__get__"):
                break  # a property or another descriptor: evaluated by jaclang's walk, left to it
            data.add(name)
        else:
            found = frozenset(data)
    _classes[cls] = found
    return found


def _attr_names(arch: Any, known: frozenset) -> tuple[str, ...]:
    """The names `dir(arch)` gives that do not start with "_", in its (sorted) order, but the
    class's methods that the instance does not shadow (callable: jaclang skips them)."""
    own = tuple(arch.__dict__)
    key = (type(arch), own)
    names = _names.get(key)
    if names is None:
        mine = {name for name in own if not name.startswith("_")}
        names = _names[key] = tuple(sorted(known | mine))
    return names


def field_names(arch: Any) -> tuple[str, ...] | None:
    """The names of `arch`'s fields jaclang's serialiser writes, in its order (the public names
    `dir()` gives that are not methods, whose value is not callable); None when its class is left
    to jaclang's serialiser (schema rules, a property or another descriptor, a custom `dir()`).
    adapters/lent.py compares an anchor field by field by these names."""
    known = _class_names(type(arch))
    if known is None:
        return None
    return tuple([name for name in _attr_names(arch, known) if not callable(getattr(arch, name))])


def serialised_value(val: Any) -> Any:
    """`Serializer._serialize_value(val, include_type=True)`, the JSON types taken as they are."""
    kind = type(val)
    if kind is str or kind is int or kind is float or kind is bool or val is None:
        return val
    if kind is list:
        return [serialised_value(item) for item in val]
    if kind is dict:
        return {str(key): serialised_value(item) for (key, item) in val.items()}
    return Serializer._serialize_value(val, True)


def _access(access: Any) -> Any:
    if type(access) is Permission and type(access.roots) is Access:
        return {"all": access.all.value, "roots": {"anchors": {_text(k): v.value for (k, v) in access.roots.anchors.items()}}}
    return Serializer._serialize_value(access, True)


def _text(id: Any) -> str:
    """`str(id)`: a UUID's remembered (`id_text`)."""
    return id_text(id) if type(id) is UUID else str(id)


def anchor_row(anchor: Any) -> tuple:
    """jaclang's `_anchor_to_row(anchor)`: (type, arch_module, arch_type, fingerprint, data,
    format_version, updated_at)."""
    kind = type(anchor)
    arch = anchor.__dict__.get("archetype")
    cls = type(arch)
    known = _class_names(cls) if (kind is NodeAnchor or kind is EdgeAnchor) and arch is not None else None
    if known is None or not anchor.is_populated() or isinstance(arch, Root):
        return jac_memory._anchor_to_row(anchor)
    attrs: dict[str, Any] = {"__type__": cls.__name__, "__module__": cls.__module__}
    for name in _attr_names(arch, known):
        value = getattr(arch, name)
        if not callable(value):
            attrs[name] = serialised_value(value)
    attic = getattr(arch, "__jac_attic__", None)
    if isinstance(attic, dict) and attic:
        attrs["__jac_attic__"] = Serializer._serialize_value(attic, True)
    data: dict[str, Any] = {
        "__type__": kind.__name__, "__module__": kind.__module__, "id": id_text(anchor.id),
        "root": _text(anchor.root) if anchor.root else None, "persistent": anchor.persistent,
        "access": _access(anchor.access), "archetype": attrs,
    }
    if kind is NodeAnchor:
        data["edges"] = [_text(edge.id) for edge in anchor.edges]
        data["version"] = anchor.version
    else:
        data["source"] = _text(anchor.source.id) if anchor.source else None
        data["target"] = _text(anchor.target.id) if anchor.target else None
        data["is_undirected"] = anchor.is_undirected
    fingerprint = getattr(cls, "__jac_fingerprint__", None)
    return (kind.__name__, cls.__module__, cls.__name__, fingerprint if isinstance(fingerprint, str) and fingerprint else None,
            json.dumps(data), jac_memory.SQLITE_DB_FORMAT_VERSION, row_time())


class _Seen(NamedTuple):
    """A node row the store read or wrote in its current format: its text, that text parsed (never
    changed: a merge changes a copy), and, once a merge by id needed them, its edge ids as
    integers and the text before its edge list (None when the text is not `json.dumps` of the
    parse with the edges and the version last: then the row is dumped whole)."""

    text: str
    data: dict
    ints: list[int] | None = None
    head: str | None = None


# Row id -> the node row last read or written in its current format (`_Seen`). A merge whose stored
# text is the one seen takes its parse instead of `json.loads` (the row it wrote the call before:
# a session, a render epoch, a result reused again and again): a memo of a pure function of the
# text, so never stale. Emptied when its texts pass SEEN_CHARS_MAX characters.
_seen: dict[str, _Seen] = {}
_seen_chars = [0]
SEEN_CHARS_MAX = 4_000_000


def _remember(key: str, seen: _Seen | None) -> None:
    """Remember (or, None, forget) the row of `key`."""
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


def _current_node(key: str, stored: tuple, cls: type | None) -> _Seen | None:
    """The stored node row, parsed, when it is stored in the current format of `cls` (its class
    now: the same module and name, fingerprint and fields, so the stored row is what jaclang would
    write for it), else None."""
    (_, arch_module, arch_type, fingerprint, text, format_version) = stored
    if cls is None or (arch_module, arch_type) != (cls.__module__, cls.__name__) or format_version != jac_memory.SQLITE_DB_FORMAT_VERSION \
            or not fingerprint or fingerprint != getattr(cls, "__jac_fingerprint__", None) or stored[0] != "NodeAnchor":
        return None
    seen = _seen.get(key)
    if seen is not None and seen.text == text:
        return seen
    try:
        data = json.loads(text)
    except ValueError:
        return None
    stored_arch = data.get("archetype") if isinstance(data, dict) else None
    if not isinstance(stored_arch, dict) or set(stored_arch) - {"__type__", "__module__"} != set(get_field_types(cls)) \
            or not isinstance(data.get("edges"), list) or not isinstance(data.get("version"), int):
        return None
    seen = _Seen(text, data)
    _remember(key, seen)
    return seen


def _tail(edges: list[str], version: int) -> str:
    """The end of a node row's text from its edge list on, as `json.dumps` writes it."""
    return '"edges": ' + json.dumps(edges) + ', "version": ' + json.dumps(version) + "}"


def _head(seen: _Seen) -> str | None:
    """The text of `seen`'s row before its edge list, when its text is `json.dumps` of its parse
    with the edge list and the version last (so a new edge list and version can follow it)."""
    if list(seen.data)[-2:] != ["edges", "version"] or json.dumps(seen.data) != seen.text:
        return None
    return seen.text[:len(seen.text) - len(_tail(seen.data["edges"], seen.data["version"]))]


# Edge ids as str(UUID) writes them, each followed by a comma.
_CANONICAL_IDS = re.compile(r"(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12},)*")


def merge_edge_ids(conn: sqlite3.Connection, key: str, stored: tuple, added_ids: list[UUID]) -> bool:
    """The row jaclang's merge writes for a stored node that a call gave new edges (`added_ids`, in
    the order it linked them) without changing anything else, made from the stored row alone: the
    call never loaded the node. A load would have given it the stored edges, in their order, and
    the stored ids as the baseline of its edge delta (`NodeAnchor.edge_delta`); the call appended
    the new edges. The same sets are built here from the same ids in the same order (a set's order
    follows how it was built), so the merged list is the one jaclang's merge (and
    `merge_stored_text`) writes, and the version is advanced as it advances it. Only for a row in
    the current format of its class (`_current_node`); False for any other, which the store
    merges as jaclang would the node loaded from it."""
    (arch_module, arch_type) = stored[1:3]
    cls = Serializer._get_class(arch_module, arch_type) if arch_module and arch_type else None
    seen = _current_node(key, stored, cls)
    if seen is None or isinstance(cls, type) and issubclass(cls, Root):
        return False
    # The ids as the integers of their UUIDs (a UUID hashes as its integer and equals by it, so the
    # same sets are laid out alike and iterate in the same order), read without making a UUID.
    texts = seen.data["edges"]
    stored_ids = seen.ints
    if stored_ids is None and _CANONICAL_IDS.fullmatch(",".join(texts) + ("," if texts else "")):
        stored_ids = [int(e.replace("-", ""), 16) for e in texts]
    elif stored_ids is None:  # (not in jaclang's rows: each id as str(UUID) writes it)
        stored_ids = [UUID(e).int for e in texts]
        texts = [str(UUID(int=e)) for e in stored_ids]
    text_of = dict(zip(stored_ids, texts))
    for id in added_ids:
        text_of[id.int] = id_text(id)
    # NodeAnchor.edge_delta on the node as loaded, the new edges appended.
    initial = set(frozenset(e for e in stored_ids))
    current = set(e for e in stored_ids + [id.int for id in added_ids])
    (added, removed) = (set(current - initial), set(initial - current))
    merged = list((set(stored_ids) | added) - removed)
    data = dict(seen.data)
    data["edges"] = [text_of[e] for e in merged]
    if added or removed:
        data["version"] += 1
    # The row's text up to its edge list is the stored one: only what follows is written anew.
    head = seen.head if seen.head is not None or seen.ints is not None else _head(seen)
    text = head + _tail(data["edges"], data["version"]) if head is not None else json.dumps(data)
    conn.execute(INSERT_ROW, (key, "NodeAnchor", arch_module, arch_type, stored[3], text,
                              jac_memory.SQLITE_DB_FORMAT_VERSION, row_time()))
    _remember(key, _Seen(text, data, merged, head))
    return True


def merge_stored_text(conn: sqlite3.Connection, key: str, stored: tuple, intent: WriteIntent) -> bool:
    """jaclang's merge of an edge-list change and dirty fields into the stored row, made on the
    row's JSON instead of on the node deserialised from it and serialised whole again: the
    stored values are kept as stored, only the edge list, the version, the access and the dirty
    fields are replaced, each as jaclang would serialise it. So a node's large contents (a
    result's text, a session's system prompt and render log) are not deserialised, serialised
    and hashed again when the node gets an edge or a counter changes. Only for a node stored
    in the current format of its current class (the same fields, so the stored row is what
    jaclang would write for it); False for anything else, which jaclang merges."""
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
    access = Serializer._serialize_value(anchor.access, include_type=True)
    if json.dumps(data.get("access"), sort_keys=True, default=str) != json.dumps(access, sort_keys=True, default=str):
        data["access"] = access
        changed = True
    dirty = [f for f in intent.fields if f in fields]
    for name in dirty:
        stored_arch[name] = Serializer._serialize_value(getattr(arch, name), include_type=True)
    if intent.fields:
        changed = True  # as jaclang: a flagged field is written, even to the same value
    if changed:
        text = json.dumps(data)
        conn.execute(INSERT_ROW, (key, "NodeAnchor", arch_module, arch_type, fingerprint, text,
                               jac_memory.SQLITE_DB_FORMAT_VERSION, row_time()))
        _remember(key, _Seen(text, data))
    return True
