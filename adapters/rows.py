"""The rows the store (adapters/store.py) creates, byte for byte the rows jaclang writes, made
without jaclang's generic serialiser where it can be: a created anchor's row (`anchor_row`) is
jaclang's `_anchor_to_row` (the anchor through `Serializer.serialize(anchor, include_type=True)`,
dumped by `json.dumps`, with its class's columns). A stored row merged on its text is
adapters/merges.py's.

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
import json.encoder
import threading
import types
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Access, AccessLevel, EdgeAnchor, NodeAnchor, Permission, Root  # noqa: E402
from jaclang.runtimelib import memory as jac_memory  # noqa: E402
from jaclang.runtimelib.serializer import Serializer  # noqa: E402

__all__ = ["INSERT_ROW", "anchor_row", "field_names", "forget_id_texts", "id_text", "row_time", "time_rows", "serialised_value", "value_text"]

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
_UNSEEN = object()


# UUID -> its text: a row names each id about three times (an edge's own row, its ends' edge lists)
# and every row its root; `str(UUID)` is Python (1.8 µs here) where a lookup is 0.2 µs. Keyed by
# the UUID's number (`UUID.int`: a UUID's own `__hash__` is Python code, about 0.5 µs, and a
# 2,000-result flush makes about 120,000 lookups), so an entry is never stale; emptied when it
# reaches ID_TEXTS_MAX and after each flush (`forget_id_texts`: a big call's ids kept here made
# every later full collection walk them: the next calls' ingestion x0.85).
_id_texts: dict[int, str] = {}
# The same, in quotes: a UUID's JSON text as a row writes it (`_id_json`).
_id_jsons: dict[int, str] = {}
ID_TEXTS_MAX = 200_000


def id_text(id: UUID) -> str:
    """`str(id)`, remembered until the flush ends."""
    number = id.int
    text = _id_texts.get(number)
    if text is None:
        if len(_id_texts) >= ID_TEXTS_MAX:
            _id_texts.clear()
        text = _id_texts[number] = str(id)
    return text


def forget_id_texts() -> None:
    """Drop the remembered ids' texts (the store does after each flush)."""
    _id_texts.clear()
    _id_jsons.clear()


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
    left to jaclang's serialiser. A `__getattr__` is left to it too, but a Root's, which answers
    only `shared` (a name `dir()` does not give, so never one the serialiser asks for)."""
    found = _classes.get(cls, _UNSEEN)
    if found is not _UNSEEN:
        return found
    found = None
    if not hasattr(cls, "__jac_schema__") and getattr(cls, "__getattr__", Root.__getattr__) is Root.__getattr__ \
            and cls.__dir__ is object.__dir__ \
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


# The JSON scalars serialised as they are (exact types: a subclass, an Enum of int say, is not one).
_SCALARS = frozenset({str, int, float, bool, type(None)})
_STR_KEYS = frozenset({str})


def serialised_value(val: Any) -> Any:
    """`Serializer._serialize_value(val, include_type=True)`, the JSON types taken as they are. A list
    of scalars, or a dict of scalars by str keys (most of a render's figures and lists), is copied
    whole: its types told by `map(type, ...)` in C, not by a call for each item."""
    kind = type(val)
    if kind in _SCALARS:
        return val
    if kind is list:
        if set(map(type, val)) <= _SCALARS:
            return list(val)
        return [serialised_value(item) for item in val]
    if kind is dict:
        if set(map(type, val)) <= _STR_KEYS and set(map(type, val.values())) <= _SCALARS:
            return dict(val)
        return {str(key): serialised_value(item) for (key, item) in val.items()}
    return Serializer._serialize_value(val, True)


# A JSON string's text as `json.dumps` writes it (ensure_ascii): json's own C function.
_string_text = json.encoder.encode_basestring_ascii
_INFINITIES = (float("inf"), float("-inf"))


def value_text(value: Any) -> str:
    """`json.dumps(value)`: the JSON scalars written here as json writes them (its string encoder,
    `int.__repr__`, `float.__repr__`), anything else by `json.dumps`. A row's text is made of these
    and fixed parts: the same bytes as `json.dumps` of the row's dict, without building the dict."""
    kind = type(value)
    if kind is str:
        return _string_text(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return int.__repr__(value)
    if kind is float and value == value and value not in _INFINITIES:
        return float.__repr__(value)
    return json.dumps(value)


def _access_text(access: Any) -> str:
    """The access's JSON text, as jaclang's serialiser writes it. With no roots granted it is one
    of the level's fixed texts (the level's number read as `_value_`: an enum's `value` is a Python
    property)."""
    if type(access) is Permission and type(access.roots) is Access:
        anchors = access.roots.anchors
        if not anchors:
            level = access.all
            if type(level) is AccessLevel:
                return _NO_ROOTS[level._value_]
            return _no_roots_text(level.value)
        return json.dumps({"all": access.all.value, "roots": {"anchors": {_text(k): v.value for (k, v) in anchors.items()}}})
    return json.dumps(Serializer._serialize_value(access, True))


def _no_roots_text(level: Any) -> str:
    """The access's text at the level numbered `level` when no root is granted anything."""
    return '{"all": ' + value_text(level) + ', "roots": {"anchors": {}}}'


# An access level's number -> its `_no_roots_text`.
_NO_ROOTS = {level.value: _no_roots_text(level.value) for level in AccessLevel}


def _text(id: Any) -> str:
    """`str(id)`: a UUID's remembered (`id_text`)."""
    return id_text(id) if type(id) is UUID else str(id)


def _id_json(id: Any) -> str:
    """`json.dumps(str(id))`: a UUID's text needs no escape (remembered as `id_text`)."""
    if type(id) is not UUID:
        return _string_text(str(id))
    number = id.int
    text = _id_jsons.get(number)
    if text is None:
        if len(_id_jsons) >= ID_TEXTS_MAX:
            _id_jsons.clear()
        text = _id_jsons[number] = '"' + id_text(id) + '"'
    return text


# Archetype class -> the row text's fixed beginning for a node's anchor, its archetype's beginning,
# and the row's columns of the class (`_row_heads`); the same for an edge's.
_node_heads: dict[type, tuple[str, str, str, str]] = {}
_edge_heads: dict[type, tuple[str, str, str, str]] = {}
# (archetype class, the instance's own attribute names) -> each field's name and its key's text in
# the row (`, "name": `), in jaclang's order (`_fields`).
_keyed: dict[tuple, tuple[tuple[str, str], ...]] = {}


def _row_heads(kind: type, cls: type) -> tuple[str, str, str, str]:
    heads = _node_heads if kind is NodeAnchor else _edge_heads
    found = heads.get(cls)
    if found is None:
        found = heads[cls] = (
            '{"__type__": ' + _string_text(kind.__name__) + ', "__module__": ' + _string_text(kind.__module__) + ', "id": ',
            '{"__type__": ' + _string_text(cls.__name__) + ', "__module__": ' + _string_text(cls.__module__),
            cls.__module__, cls.__name__)
    return found


def _fields(arch: Any, known: frozenset) -> tuple[tuple[str, str], ...]:
    """`_attr_names(arch, known)`, each name with its key's text in the row."""
    key = (type(arch), tuple(arch.__dict__))
    fields = _keyed.get(key)
    if fields is None:
        fields = _keyed[key] = tuple([(name, ", " + _string_text(name) + ": ") for name in _attr_names(arch, known)])
    return fields


def _field_text(value: Any) -> str:
    """`value_text(serialised_value(value))`, a `str` (most fields) written first."""
    if type(value) is str:
        return _string_text(value)
    return value_text(serialised_value(value))


def anchor_row(anchor: Any) -> tuple:
    """jaclang's `_anchor_to_row(anchor)`: (type, arch_module, arch_type, fingerprint, data,
    format_version, updated_at). The data is the text `json.dumps` writes for jaclang's dict of
    the anchor, made directly: its keys in jaclang's order, each value's text by `value_text`."""
    kind = type(anchor)
    arch = anchor.__dict__.get("archetype")
    if arch is None or not (kind is NodeAnchor or kind is EdgeAnchor):
        return jac_memory._anchor_to_row(anchor)
    cls = type(arch)
    known = _class_names(cls)
    if known is None or not anchor.is_populated() or isinstance(arch, Root):
        return jac_memory._anchor_to_row(anchor)
    (head, arch_head, module, name) = _row_heads(kind, cls)
    root = anchor.root
    fields = "".join([key + _field_text(value) for (field, key) in _fields(arch, known)
                      if not callable(value := getattr(arch, field))])
    attic = getattr(arch, "__jac_attic__", None)
    if isinstance(attic, dict) and attic:
        fields += ', "__jac_attic__": ' + json.dumps(Serializer._serialize_value(attic, True))
    start = (f'{head}{_id_json(anchor.id)}, "root": {_id_json(root) if root else "null"}, "persistent": '
             f'{value_text(anchor.persistent)}, "access": {_access_text(anchor.access)}, "archetype": {arch_head}{fields}}}')
    if kind is NodeAnchor:
        data = (f'{start}, "edges": [{", ".join([_id_json(edge.id) for edge in anchor.edges])}], "version": '
                f'{value_text(anchor.version)}}}')
    else:
        (source, target) = (anchor.source, anchor.target)
        data = (f'{start}, "source": {_id_json(source.id) if source else "null"}, "target": '
                f'{_id_json(target.id) if target else "null"}, "is_undirected": {value_text(anchor.is_undirected)}}}')
    fingerprint = getattr(cls, "__jac_fingerprint__", None)
    return (kind.__name__, module, name, fingerprint if isinstance(fingerprint, str) and fingerprint else None,
            data, jac_memory.SQLITE_DB_FORMAT_VERSION, row_time())
