"""An anchor as a call took it from the kept ones (adapters/lent.py): its fields are named as
jaclang's serialiser names them (adapters/rows.py `field_names`, one helper for the rows and for
this check), and an archetype whose class jaclang's serialiser must walk (a property) is not taken
apart, so that jaclang's own field hashes decide what changed."""

from __future__ import annotations

import numpy

from contextrender import lent as lent_module
from contextrender import rows
from contextrender.jaclang_setup import import_jaclang

import_jaclang()

from graph import context as graph  # noqa: E402  (a Jac module: importable once contextrender is)
from jaclang.jac0core.archetype import NodeArchetype  # noqa: E402
from jaclang.runtimelib.changeset import derive_dirty_fields, snapshot_field_hashes  # noqa: E402
from jaclang.runtimelib.changeset import ChangeSet  # noqa: E402
from jaclang.runtimelib.serializer import Serializer  # noqa: E402
from jaclang.runtimelib.typecache import get_field_types  # noqa: E402
from test_rows import GRAPH_CLASSES, _instance  # noqa: E402


def _serialised_names(arch) -> tuple[str, ...]:  # noqa: ANN001
    return tuple(name for name in Serializer.serialize(arch.__jac__, include_type=True)["archetype"] if not name.startswith("__"))


def test_the_names_are_the_fields_jaclang_serialises_and_hashes():
    for (n, cls) in enumerate(cls for cls in GRAPH_CLASSES if issubclass(cls, NodeArchetype)):
        arch = _instance(cls, n)
        names = rows.field_names(arch)
        assert names == _serialised_names(arch)
        snapshot_field_hashes(arch.__jac__)
        assert set(names) == set(arch.__jac_field_hashes__) == set(get_field_types(cls))
    session = _instance(graph.Session, 2)
    session.events = len  # a callable value: jaclang neither writes it nor (as a value) compares it
    session.extra_note = "undeclared"  # dir() finds it: jaclang writes it
    assert rows.field_names(session) == _serialised_names(session)
    assert "events" not in rows.field_names(session) and "extra_note" in rows.field_names(session)


def test_a_changed_field_is_the_one_jaclangs_field_hashes_find():
    result = _instance(graph.ToolResult, 3)
    anchor = result.__jac__
    snapshot_field_hashes(anchor)
    taken = lent_module.lent(anchor, baselined=True)
    result.tokens += 1
    result.raw = result.raw + " more"
    changes = ChangeSet()
    assert taken.settle(changes)
    assert changes.intents[anchor.id].fields == derive_dirty_fields(anchor) == {"tokens", "raw"}


def test_an_archetype_with_a_property_is_left_to_jaclangs_field_hashes():
    """jaclang's serialiser evaluates a property, and its row writes it: such a class is not taken
    apart here either (before, this check evaluated the property itself as a field)."""
    class Labelled(graph.Message):
        @property
        def label(self) -> str:
            return f"{self.role}:{self.position}"

    message = Labelled(position=1, turn=0, raw="{}", tokens=2, role="user")
    assert rows.field_names(message) is None
    assert lent_module.lent(message.__jac__, baselined=True) is None


def _epoch_taken():
    """A RenderEpoch with dicts and lists in its fields, with a load's field hashes, taken."""
    epoch = graph.RenderEpoch(key="k", shown=[1, 2, 3], condensed={"4": "text <cut>", "7": "x"},
                              marker_listing={"r1": [1, 2.5, None, True]}, start={"from": "epoch", "upto": 9})
    snapshot_field_hashes(epoch.__jac__)
    return (epoch, lent_module.lent(epoch.__jac__, baselined=True))


def test_a_field_is_dirty_exactly_when_jaclangs_field_hash_says_so():
    """Changed in place, replaced by an equal value in another key order or by a value of another
    type (True for 1, a tuple for a list, a str subclass), a set in a field, bytes-like values
    (which marshal would write alike): each field is dirty exactly when jaclang's field hash says
    so, and the baseline is the hashes a load gives."""
    class Tag(str):
        pass

    changes_made = [
        lambda e: e.shown.append(4),                                     # in place
        lambda e: setattr(e, "condensed", {"7": "x", "4": "text <cut>"}),  # another order: the same text
        lambda e: setattr(e, "marker_listing", {"r1": [True, 2.5, None, True]}),  # 1 -> True: another text
        lambda e: setattr(e, "shown", (1, 2, 3)),                        # a tuple: the same text
        lambda e: setattr(e, "start", {"from": Tag("epoch"), "upto": 9}),  # a str subclass: the same text
        lambda e: setattr(e, "start", {"from": "epoch", "upto": 9.0}),   # 9 -> 9.0: another text
        lambda e: setattr(e, "condensed", {"4": {"a", "b"}}),            # a set
        lambda e: setattr(e, "condensed", {"4": b"text <cut>"}),         # bytes
        lambda e: setattr(e, "condensed", {"4": bytearray(b"text <cut>")}),  # the same bytes, another type
        lambda e: setattr(e, "start", {"from": "epoch", "upto": numpy.int64(9)}),
        lambda e: setattr(e, "start", {"from": "epoch", "upto": numpy.float64(9.0)}),
        lambda e: None,
    ]
    for change in changes_made:
        (epoch, taken) = _epoch_taken()
        change(epoch)
        expected = derive_dirty_fields(epoch.__jac__)
        changes = ChangeSet()
        assert taken.settle(changes)
        intent = changes.intents.get(epoch.__jac__.id)
        assert (intent.fields if intent is not None else set()) == expected
    (epoch, _) = _epoch_taken()
    loaded = dict(epoch.__jac_field_hashes__)
    taken = lent_module.lent(epoch.__jac__, baselined=False)
    object.__setattr__(epoch, "__jac_field_hashes__", {})
    taken.baseline()
    assert epoch.__jac_field_hashes__ == loaded
