"""The rows the store writes for created anchors (adapters/rows.py `anchor_row`): byte for byte the
row jaclang's `_anchor_to_row` writes, for every archetype of the graph with its edges, for the
values jaclang's serialiser treats apart, and for a store written by jaclang's serialiser before."""

from __future__ import annotations

import dataclasses
import enum
import json
import sqlite3
import typing
import uuid
from datetime import datetime

import numpy as np

from conftest import assistant, call, tool, trace_prefix, user

from contextrender import Engine, rows, store

from graph import context as graph  # noqa: E402  (a Jac module: importable once contextrender is)
from jaclang.jac0core.archetype import Access, AccessLevel, EdgeArchetype, NodeArchetype, Permission, Root  # noqa: E402
from jaclang.jac0core.runtime import JacRuntime  # noqa: E402
from jaclang.runtimelib.typecache import get_field_types  # noqa: E402

# jaclang's own row function, as it is before any test patches it.
JACLANG_ROW = store.jac_memory._anchor_to_row
GRAPH_CLASSES = sorted(
    (cls for cls in vars(graph).values()
     if isinstance(cls, type) and issubclass(cls, (NodeArchetype, EdgeArchetype)) and cls.__module__ == "graph.context"),
    key=lambda cls: cls.__name__)


class Colour(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    """An int subclass whose repr is not its number: json writes the number, so must the row."""
    LOW = 1


class Count(int):
    def __repr__(self) -> str:
        return f"Count({int(self)})"


class Ratio(float):
    def __repr__(self) -> str:
        return f"Ratio({float(self)})"


class Word(str):
    """A subclass of a JSON type: jaclang's serialiser takes it as it is, so must the row."""


def _same_row(anchor) -> tuple:
    ours, jaclangs = rows.anchor_row(anchor), JACLANG_ROW(anchor)
    assert ours[:6] == jaclangs[:6], (ours[4], jaclangs[4])
    assert datetime.fromisoformat(ours[6]).utcoffset().total_seconds() == 0
    return ours


def _value(annotation, n: int):
    kind = typing.get_origin(annotation) or annotation
    return {
        str: f'text {n} "quoted" \\ üñï ✓ \u2028 \n\t', int: 7 * n - 3, float: n + 0.25, bool: n % 2 == 0,
        list: ["x", n, 2.5, None, {"k": [True, "v"]}, [1, [2]]],
        dict: {"a": [1, 2.5, None], n: {"nested": {"deep": "ü"}}, "flag": False, "colour": Colour.RED, "word": Word("w")},
    }[kind]


def _instance(cls, n: int):
    fields = get_field_types(cls)
    return cls(**{name: _value(annotation, n) for (name, annotation) in fields.items()})


def _persist(anchor, owner: uuid.UUID) -> None:
    anchor.persistent = True
    anchor.root = owner
    anchor.access = Permission(all=AccessLevel.READ, roots=Access(anchors={str(owner): AccessLevel.WRITE}))


def test_every_archetype_of_the_graph_with_its_edges_gets_jaclangs_row():
    owner = uuid.uuid4()
    nodes = [_instance(cls, n) for (n, cls) in enumerate(GRAPH_CLASSES) if issubclass(cls, NodeArchetype)]
    edges = []
    for (n, cls) in enumerate(c for c in GRAPH_CLASSES if issubclass(c, EdgeArchetype)):
        (source, target) = (nodes[n % len(nodes)], nodes[(n + 1) % len(nodes)])
        edge = _instance(cls, n)
        JacRuntime.build_edge(is_undirected=n % 3 == 0, conn_type=edge, conn_assign=None)(source.__jac__, target.__jac__)
        edges.append(edge)
    generic = JacRuntime.build_edge(is_undirected=False, conn_type=None, conn_assign=None)(nodes[0].__jac__, nodes[-1].__jac__)
    made = nodes + edges + [generic]
    for (n, archetype) in enumerate(made):
        if n % 2:
            _persist(archetype.__jac__, owner)
    covered = set()
    for archetype in made:
        _same_row(archetype.__jac__)
        covered.add(type(archetype).__name__)
    assert covered == {cls.__name__ for cls in GRAPH_CLASSES} | {"GenericEdge"}
    # Nodes with no edge, a root (jaclang's own row), an unpersisted edge between them.
    lone = _instance(graph.Session, 3)
    _same_row(lone.__jac__)
    _same_row(Root().__jac__)


def test_values_jaclangs_walk_treats_apart_give_its_row():
    session = _instance(graph.Session, 2)
    session.extra_note = "an attribute the class does not declare"  # dir() finds it: jaclang writes it
    session.figures = {"shadows": "a method"}  # not callable on this instance: written
    session.events = len  # a callable value: jaclang skips it
    session.name = Word("a str subclass")
    # Number subclasses with their own repr, as whole values: json writes the number.
    (session.extra_level, session.extra_count, session.extra_ratio, session.extra_numpy) = (Level.LOW, Count(3), Ratio(0.5), np.float64(0.1))
    session.config = {"level": AccessLevel.CONNECT, 1.5: (1, "tuple"), "set": Colour.RED}
    _same_row(session.__jac__)
    result = _instance(graph.ToolResult, 4)
    result.__jac_attic__ = {"dropped_field": [1, 2]}  # preserved schema drift: written back
    _same_row(result.__jac__)


def test_an_archetype_with_a_property_is_left_to_jaclang(monkeypatch):
    """jaclang's walk evaluates a property (and writes its value): such a class is not taken apart."""
    class Labelled(graph.Message):
        @property
        def label(self) -> str:
            return f"{self.role}:{self.position}"

    message = Labelled(position=1, turn=0, raw="{}", tokens=2, role="user")
    called: list = []
    monkeypatch.setattr(rows.jac_memory, "_anchor_to_row", lambda anchor: called.append(anchor) or JACLANG_ROW(anchor))
    row = rows.anchor_row(message.__jac__)
    assert called == [message.__jac__] and '"label": "user:1"' in row[4]


def test_the_store_writes_created_rows_without_jaclangs_serialiser(tmp_path, monkeypatch):
    """Every created row of a real session (results, reuse, a fork, a restore, summaries, epochs) is
    jaclang's row, made by `anchor_row`; jaclang's serialiser makes none of them (only roots)."""
    engine = Engine(tmp_path / "store")
    kinds: list[str] = []
    made_by_jaclang: list[str] = []

    def compared(anchor):
        kinds.append(type(anchor.archetype).__name__)
        return _same_row(anchor)

    monkeypatch.setattr(store, "anchor_row", compared)
    monkeypatch.setattr(store.jac_memory, "_anchor_to_row",
                        lambda anchor: made_by_jaclang.append(type(anchor.archetype).__name__) or JACLANG_ROW(anchor))
    messages = trace_prefix(turns=12)
    engine.ingest("s", messages)
    engine.configure("s", on_rewrite="fork")
    engine.render("s", budget=900)
    engine.render("s", messages, budget=700, selector="compact", summariser="offline")
    rewritten = messages[:6] + [user("start again from here")]
    engine.ingest("s", rewritten)
    engine.ingest("s", rewritten + [assistant(None, call("cx", "cat", {"path": "a.py"})), tool("cx", "print('a')")])
    engine.restore("s", "r1")
    expected = {"Session", "SessionDirectory", "SessionShelf", "Message", "ToolCall", "ToolResult", "Next", "Calls",
                "Answered", "Reuses", "Superseded", "Restored", "SummaryNote", "Summarised", "RenderEpoch", "Epoch", "GenericEdge"}
    assert expected <= set(kinds), expected - set(kinds)
    assert set(made_by_jaclang) <= {"Root"}, made_by_jaclang


def test_a_store_written_by_jaclangs_serialiser_reads_and_grows_the_same(tmp_path, monkeypatch):
    messages = trace_prefix(turns=10)
    before = Engine(tmp_path / "before")
    with monkeypatch.context() as patched:
        patched.setattr(store, "anchor_row", JACLANG_ROW)  # as the store wrote rows before
        before.ingest("s", messages[:9])
        before.render("s", budget=800)
    now = Engine(tmp_path / "now")
    now.ingest("s", messages[:9])
    now.render("s", budget=800)
    for engine in (before, now):
        engine.ingest("s", messages)
    assert before.get_session("s", include_messages=True)["messages"] == now.get_session("s", include_messages=True)["messages"]
    assert before.render("s", messages, budget=900).messages == now.render("s", messages, budget=900).messages
    counts = []
    for engine in (before, now):
        with sqlite3.connect(str(next(engine.store.rglob("*.db")))) as conn:
            counts.append(conn.execute("SELECT arch_type, count(*) FROM anchors GROUP BY arch_type ORDER BY 1").fetchall())
    assert counts[0] == counts[1]


def test_field_values_are_dataclass_fields():
    """The values made here cover every field type the graph declares (a new one would fail above)."""
    for cls in GRAPH_CLASSES:
        for field in dataclasses.fields(cls):
            _value(get_field_types(cls)[field.name], 1)


def test_an_ids_text_is_remembered_and_the_memory_bounded(monkeypatch):
    monkeypatch.setattr(rows, "ID_TEXTS_MAX", 3)
    monkeypatch.setattr(rows, "_id_texts", {})
    ids = [uuid.uuid4() for _ in range(5)]
    assert [rows.id_text(id) for id in ids] == [str(id) for id in ids]
    assert len(rows._id_texts) <= 3
    again = uuid.UUID(str(ids[-1]))  # an equal id, another object: the same text
    assert rows.id_text(again) is rows.id_text(ids[-1])


def test_the_ids_texts_are_forgotten_after_each_flush(tmp_path):
    """A UUID is an object the cyclic collector tracks: a big call's ids kept would make every later
    full collection walk them."""
    engine = Engine(tmp_path / "store")
    engine.ingest("s", [user("start"), assistant(None, call("c1", "bash", {"cmd": "ls"})), tool("c1", "a.py b.py")])
    assert rows._id_texts == {} and rows._id_jsons == {}


def test_an_ids_json_text_is_remembered_by_its_number(monkeypatch):
    """A row writes an id as `json.dumps(str(id))`, remembered by the UUID's number (a UUID's own
    hash is Python code): an equal id, another object, gets the same text; the memory is bounded."""
    monkeypatch.setattr(rows, "ID_TEXTS_MAX", 3)
    monkeypatch.setattr(rows, "_id_jsons", {})
    ids = [uuid.uuid4() for _ in range(5)]
    assert [rows._id_json(id) for id in ids] == [json.dumps(str(id)) for id in ids]
    assert len(rows._id_jsons) <= 3 and set(rows._id_jsons) <= {id.int for id in ids}
    assert rows._id_json(uuid.UUID(str(ids[-1]))) is rows._id_json(ids[-1])
    assert rows._id_json("not-a-uuid \"x\"") == json.dumps('not-a-uuid "x"')


def test_a_values_text_is_json_dumps_of_it():
    """A row's text is made of fixed parts and each value's `value_text`: byte for byte `json.dumps`
    of the value, for the scalars it writes itself (escapes, non-ASCII, surrogates, big and
    negative numbers, floats that print long, NaN and the infinities) and the rest it hands on."""
    values = ["", "plain", 'quote " back \\ slash', "tab\tnew\nline\x00\x1f", "üñ 中文 😀", "\ud800", Word("sub"),
              0, -1, 2**70, True, False, None, 0.1, -0.0, 1e300, 1 / 3, 5e-324, float("nan"), float("inf"), float("-inf"),
              [1, "a", None, [2.5]], {"k": [True], "x": {"y": "z"}}, {}, [], Colour.RED.value,
              Level.LOW, Count(3), Ratio(0.5), np.float64(0.1)]
    for value in values:
        assert rows.value_text(value) == json.dumps(value), value


def test_a_container_of_scalars_is_serialised_as_jaclang_serialises_it_and_as_a_copy():
    """`serialised_value` copies a list of scalars, or a dict of scalars by str keys, whole (its
    types told in C): jaclang's `_serialize_value` of it, for the scalars' subclasses (an Enum of
    int, a str subclass, a numpy float), keys that are not str, nesting and empty ones; and a copy,
    never the value itself (a merge keeps the result in its remembered parse of the row)."""
    from jaclang.runtimelib.serializer import Serializer

    values = [[], {}, [1, "a", None, 2.5, True], {"k": 1, "l": "x", "m": None, "n": 0.5, "o": False},
              [Level.LOW, 1], [Word("sub"), "a"], [np.float64(0.1)], {"a": Count(3)}, {"r": Ratio(0.5)},
              {1: "one"}, {True: 1, "x": 2}, {None: 1}, {Word("key"): 1}, [[1, 2], {"a": [3]}], {"a": {"b": [1, "c"]}},
              [(1, 2)], {"t": (1, "x")}, [Colour.RED], {"c": Colour.RED}]
    for value in values:
        made = rows.serialised_value(value)
        expected = Serializer._serialize_value(value, True)
        assert json.dumps(made) == json.dumps(expected) and json.dumps(made, sort_keys=True, default=str) == json.dumps(
            expected, sort_keys=True, default=str), value
        assert made is not value or not isinstance(value, (list, dict)), value
    scalars = [1, "a", None]
    made = rows.serialised_value(scalars)
    scalars.append(2)
    assert made == [1, "a", None]
