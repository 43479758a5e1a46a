"""What an anchor kept between two Engine calls was when a call took it (adapters/working_set.py
`Kept.lend`), and the commit's change check of it without hashing it.

jaclang's commit hashes every anchor of the working set (a serialisation of the whole anchor and a
JSON text of it) to find what changed, and a kept anchor the last call wrote needs a baseline (the
same again, field by field) before that check can tell anything: the results a call loads, the
session, the render epoch, each hashed twice a call although most of them did not change. Here an
anchor taken from the kept ones is remembered as it was: each field's value (a str, int, float,
bool or None, whose object is kept: a field is rarely changed in place, and a change replaces it)
or the JSON text of any other value (a dict or a list may change in place), its edges' ids, its
version, root and access. At the commit a field is the same when it is the same object, or an
equal value that serialises alike (a float by its repr), or the same text: exactly when jaclang's
field hash would find it unchanged. An anchor found unchanged is left out of jaclang's pass; one
whose fields or edge set changed is recorded as jaclang records it (the edge delta, then the
changed fields, after its access checks); any other change (access, version, root, the edges'
order alone, a field jaclang does not know) goes through jaclang's own pass, with the baseline a
load would have given it (`baseline`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Anchor, EdgeAnchor, NodeAnchor, Permission  # noqa: E402
from jaclang.runtimelib.changeset import ChangeSet, snapshot_field_hashes  # noqa: E402
from jaclang.runtimelib.serializer import Serializer  # noqa: E402
from jaclang.runtimelib.typecache import get_field_types  # noqa: E402

from contextrender.rows import field_names, serialised_value  # noqa: E402

__all__ = ["UNKNOWN_HASH", "Lent", "lent", "rebaseline", "remember_edges"]

# The hash of an anchor whose baseline was not taken: never a value of Python's `hash` (which
# gives -2 for -1), and not 0 (jaclang's "new"), so that any pass of jaclang over it finds it changed.
UNKNOWN_HASH = -1
# Values compared by object, then by value: a str, int, bool or None serialises as its value.
_PLAIN = (str, int, bool, type(None))


class _Text(str):
    """The JSON text of a field's value that is not plain (a dict, a list...), as jaclang's field
    hash serialises it."""


# The texts of an empty dict and an empty list (or tuple), the most common values that are not plain.
_EMPTY = {dict: _Text("{}"), list: _Text("[]"), tuple: _Text("[]")}


def _json_text(value: Any) -> str:
    """`value`'s JSON text as jaclang's field hash makes it (`Serializer._serialize_value`, the JSON
    types taken as they are: adapters/rows.py)."""
    return json.dumps(serialised_value(value), sort_keys=True, default=str)


def _text(value: Any) -> _Text | None:
    """`value`'s JSON text as jaclang's field hash makes it; None for one holding an archetype or
    another object (serialised with its type or as a reference: left to jaclang)."""
    if not value and type(value) in _EMPTY:
        return _EMPTY[type(value)]
    text = _json_text(value)
    return None if '"__module__"' in text or '"$ref"' in text else _Text(text)


def _frame(anchor: Anchor) -> tuple:
    """What the anchor's hash covers besides its fields and a node's edges: its access as its
    level for all and for each root (equal ones serialise alike), else as its text."""
    access = anchor.access
    if type(access) is Permission and type(access.roots.anchors) is dict:
        access = (access.all, dict(access.roots.anchors))
    else:
        access = json.dumps(Serializer._serialize_value(access, True), sort_keys=True, default=str)
    if isinstance(anchor, EdgeAnchor):
        ends = (anchor.source.id if anchor.source else None, anchor.target.id if anchor.target else None, anchor.is_undirected)
    else:
        ends = (getattr(anchor, "version", None),)
    return (anchor.root, anchor.persistent, access, ends)


def _same(now: Any, then: Any) -> bool:
    if now is then:
        return True
    if type(then) is _Text:
        return type(now) not in _PLAIN and type(now) is not float and _text(now) == then
    if type(now) is not type(then):
        return False
    return repr(now) == repr(then) if type(now) is float else now == then


@dataclass(slots=True)
class Lent:
    """An anchor as a call took it: `baselined` when it has the hash and field hashes a load gives
    (else its hash is UNKNOWN_HASH until the commit)."""

    anchor: Anchor
    baselined: bool
    names: tuple[str, ...]
    values: list
    frame: tuple
    edges: tuple[UUID, ...]

    def settle(self, changes: ChangeSet) -> bool:
        """At the commit: record what changed, as jaclang's pass records it, and tell whether the
        anchor is settled (False: it goes through jaclang's pass, with its baseline set)."""
        from jaclang import JacRuntimeInterface as Jac

        anchor = self.anchor
        arch = anchor.archetype
        edges = tuple([e.id for e in anchor.edges]) if isinstance(anchor, NodeAnchor) else ()
        if field_names(arch) != self.names or _frame(anchor) != self.frame or (edges != self.edges and set(edges) == set(self.edges)):
            self.baseline()
            return False
        dirty = {name for (name, then) in zip(self.names, self.values) if not _same(getattr(arch, name, None), then)}
        delta = None
        if edges != self.edges:
            # jaclang's `NodeAnchor.edge_delta`: against the edge ids it was loaded (or lent) with.
            (now, initial) = (set(edges), anchor.__dict__.get("_initial_edge_ids"))
            delta = (now - initial, initial - now) if initial is not None else None
        if (edges != self.edges and not (delta and (delta[0] or delta[1]))) or not dirty <= get_field_types(type(arch)).keys() or (
                delta is not None and not Jac.check_connect_access(anchor)) or (dirty and not Jac.check_write_access(anchor, op_hint="field_write")):
            self.baseline()
            return False
        if delta is not None:
            changes.record_edge_delta(anchor, list(delta[0]), list(delta[1]))
            intent = changes.intents.get(anchor.id)
            if intent is not None:
                intent.cas_version = Jac.get_context().read_versions.get(anchor.id)
        if dirty:
            changes.record_update(anchor, dirty)
        return True

    def baseline(self) -> None:
        """The field hashes a load would have given the anchor, from its values as taken (its
        whole hash stays unknown: jaclang's pass finds it changed, then looks field by field)."""
        if self.baselined:
            return
        then = dict(zip(self.names, self.values))
        hashes = {}
        for name in get_field_types(type(self.anchor.archetype)):
            value = then.get(name, then)
            hashes[name] = None if value is then else hash(value if type(value) is _Text else json.dumps(value, sort_keys=True, default=str))
        object.__setattr__(self.anchor.archetype, "__jac_field_hashes__", hashes)


def lent(anchor: Anchor, baselined: bool) -> Lent | None:
    """`anchor` as it is now; None when it cannot be told apart field by field (its class is left
    to jaclang's serialiser, a field holds an archetype or another object, or the archetype
    carries jaclang's attic of dropped fields)."""
    arch = anchor.archetype
    names = field_names(arch)
    if names is None or arch.__dict__.get("__jac_attic__"):
        return None
    values: list = []
    for name in names:
        value = getattr(arch, name, None)
        if type(value) not in _PLAIN and type(value) is not float:
            value = _text(value)
            if value is None:
                return None
        values.append(value)
    edges = tuple([e.id for e in anchor.edges]) if isinstance(anchor, NodeAnchor) else ()
    return Lent(anchor, baselined, names, values, _frame(anchor), edges)


def rebaseline(anchor: Anchor) -> None:
    """What a load from the store sets for the commit's change check (and jaclang's re-baselining
    after a flush): the whole anchor's hash (`Serializer._compute_hash`), each field's
    (`snapshot_field_hashes`), the edge ids it was loaded with. Both hashes from one serialisation
    of the anchor when no field holds an archetype or another object (none serialised with its
    type: `"__module__"` nowhere in a field's text), which jaclang's field pass serialises apart."""
    arch = anchor.archetype
    try:
        data = Serializer.serialize(anchor, include_type=True)
        anchor.hash = hash(json.dumps(data, sort_keys=True))
        serialised = data["archetype"]
        texts = {name: json.dumps(serialised.get(name), sort_keys=True, default=str) for name in get_field_types(type(arch))}
    except Exception:  # noqa: BLE001  (as jaclang's hash: 0 when it cannot serialise)
        (anchor.hash, texts) = (0, None)
    if texts is not None and not any('"__module__"' in text for text in texts.values()):
        object.__setattr__(arch, "__jac_field_hashes__", {name: hash(text) for (name, text) in texts.items()})
    else:
        snapshot_field_hashes(anchor)
    remember_edges(anchor)


def remember_edges(anchor: Anchor) -> None:
    """A node's edge ids as it has them now, as a load sets them: the baseline of jaclang's
    `NodeAnchor.edge_delta` (and of `Lent.settle`'s)."""
    if isinstance(anchor, NodeAnchor):
        anchor.__dict__["_initial_edge_ids"] = frozenset(e.id for e in anchor.edges)
