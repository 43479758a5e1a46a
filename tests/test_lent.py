"""An anchor as a call took it from the kept ones (adapters/lent.py): its fields are named as
jaclang's serialiser names them (adapters/rows.py `field_names`, one helper for the rows and for
this check), and an archetype whose class jaclang's serialiser must walk (a property) is not taken
apart, so that jaclang's own field hashes decide what changed."""

from __future__ import annotations

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
