"""The ids of the anchors ingestion makes (adapters/ids.py `new_id`): version-7 UUIDs (RFC 9562) in
time order, never one twice (across blocks, threads and a fork), jaclang's own factory asked when it
is not the standard `uuid4`, and every anchor of an ingestion with an id of its own."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from conftest import assistant, call, tool, user

from contextrender import Engine, ids

REPO = Path(__file__).resolve().parent.parent
# An id's bits below its milliseconds: its random parts (and the version's and variant's bits, the same in all).
RANDOM_PARTS = (1 << 80) - 1


def test_new_ids_are_version_7_uuids_of_their_time() -> None:
    before = time.time_ns() // 1_000_000
    made = [ids.new_id() for _ in range(3 * ids.BLOCK + 5)]
    after = time.time_ns() // 1_000_000
    for id in made:
        assert type(id) is uuid.UUID and id.version == 7 and id.variant == uuid.RFC_4122
        assert before <= id.int >> 80 <= after
        assert id.is_safe is uuid.SafeUUID.unknown
        again = uuid.UUID(str(id))
        assert again == id and hash(again) == hash(id) and again.bytes == id.bytes
    assert len({id.int for id in made}) == len(made)
    # Made a millisecond apart or more, they sort in the order made (their index entries: at its end).
    time.sleep(0.002)
    later = ids.new_id()
    assert all(str(id) < str(later) for id in made)


def test_the_random_part_has_74_bits_of_the_draw() -> None:
    drawn = bytes(range(10)) * ids.BLOCK
    part = int.from_bytes(drawn[:10])
    ids._parts.clear()
    try:
        os_urandom = ids.os.urandom
        ids.os.urandom = lambda n: drawn[:n]
        ids._draw()
    finally:
        ids.os.urandom = os_urandom
    made = ids._parts.pop()
    ids._parts.clear()
    assert made & ((1 << 62) - 1) == part & ((1 << 62) - 1)  # the draw's low 62 bits
    assert (made >> 64) & 0xFFF == (part >> 62) & 0xFFF  # and its next 12
    assert made >> 76 == 7 and (made >> 62) & 0b11 == 0b10  # the version's and the variant's bits


def test_threads_never_share_an_id() -> None:
    found: list[list[uuid.UUID]] = [[] for _ in range(4)]

    def draw(into: list) -> None:
        for _ in range(5 * ids.BLOCK):
            into.append(ids.new_id())

    threads = [threading.Thread(target=draw, args=(into,)) for into in found]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Their random parts (the milliseconds alone would tell ids of different moments apart).
    every = [id.int & RANDOM_PARTS for into in found for id in into]
    assert len(set(every)) == len(every) == 4 * 5 * ids.BLOCK


def test_a_forked_child_does_not_repeat_its_parents_block() -> None:
    ids.new_id()  # a block drawn, most of it still to hand out
    (read, write) = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its ids, to the parent
        try:
            os.write(write, "".join(f"{ids.new_id().int:032x}" for _ in range(10)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    # Their random parts: the child's ids are of an earlier millisecond than the parent's next ones.
    child = {int(text[i:i + 32], 16) & RANDOM_PARTS for i in range(0, len(text), 32)}
    parent = {ids.new_id().int & RANDOM_PARTS for _ in range(10)}
    assert len(child) == 10 and not child & parent


def test_a_replaced_factory_is_asked() -> None:
    # The row digest replaces uuid.uuid4 before anything is imported: its ids must be the anchors'.
    script = ("import uuid, itertools\n"
              "numbers = itertools.count(1)\n"
              "uuid.uuid4 = lambda: uuid.UUID(int=next(numbers), version=4)\n"
              "from contextrender import ids\n"
              "print(ids.new_id().int, ids.new_id().int)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert [int(n) for n in out] == [uuid.UUID(int=n, version=4).int for n in (1, 2)]


def test_a_wrapped_factory_is_asked_too() -> None:
    # A wrapper made with functools.wraps carries uuid4's names: it is still not the standard one.
    script = ("import functools, uuid\n"
              "asked = []\n"
              "standard = uuid.uuid4\n"
              "uuid.uuid4 = functools.wraps(standard)(lambda: asked.append(1) or standard())\n"
              "from contextrender import ids\n"
              "print(ids.new_id().version, len(asked))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["4", "1"]


def test_an_ingestion_gives_each_anchor_its_own_id(tmp_path: Path) -> None:
    messages = [user("Find the orders.")]
    for i in range(40):
        messages.append(assistant(None, call(f"c{i}", "lookup", {"order": f"ORD-{i}"})))
        messages.append(tool(f"c{i}", f"order ORD-{i} shipped to depot {i % 3}"))
    Engine(tmp_path / "store").ingest("s", messages)
    stored = []
    for path in (tmp_path / "store").rglob("*"):
        if path.is_file() and path.read_bytes()[:16] == b"SQLite format 3\x00":
            with sqlite3.connect(path) as conn:
                stored += [(uuid.UUID(id), kind) for (id, kind) in conn.execute("SELECT id, arch_type FROM anchors")]
    assert len(stored) > 200 and len({id for (id, _) in stored}) == len(stored)
    made = [id for (id, kind) in stored if kind in {"Message", "ToolCall", "ToolResult", "Next", "Calls", "Answered", "Reuses"}]
    assert len(made) > 200 and all(id.version == 7 for id in made)  # (a directory's and shelves' ids are named: version 5)


def test_a_new_nodes_anchor_is_the_one_jaclangs_property_makes() -> None:
    from graph import context as graph  # (Jac modules: importable once contextrender is)
    from walkers import ingest

    def message() -> object:
        return graph.Message(position=1, turn=1, raw="{}", tokens=3, at=0.0, role="user")

    (mine, theirs) = (message(), message())
    made = ingest._node_anchor(mine)
    assert mine.__jac__ is made and ingest._node_anchor(mine) is made  # kept on the node, as the property keeps it
    expected = theirs.__jac__  # jaclang's NodeArchetype.__jac__
    assert type(made) is type(expected) and made.archetype is mine and made.id != expected.id and made.id.version == 7
    assert {k: v for (k, v) in vars(made).items() if k not in ("id", "archetype", "access")} \
        == {k: v for (k, v) in vars(expected).items() if k not in ("id", "archetype", "access")}
    assert type(made.access) is type(expected.access) and made.access is not expected.access
    assert (made.access.all, made.access.roots.anchors) == (expected.access.all, expected.access.roots.anchors)
    assert list(vars(made)) == list(vars(expected))  # the same fields in the same order
    # A node whose anchor is already made keeps it.
    assert ingest._node_anchor(theirs) is expected
