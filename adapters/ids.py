"""The ids of the anchors ingestion makes (walkers/impl/ingest.links.impl.jac), in time order.

jaclang gives every anchor it makes an id from its `Anchor.id` field's factory, the standard
library's `uuid4`: 16 bytes of `os.urandom` (a system call) and `UUID.__init__` (Python) for each,
2-8 µs by the machine's load, about 20,000 times for 2,000 tool results in one call. And a random
id lands anywhere in the store's index of ids (`anchors.id`, its primary key): a flush of 2,000 rows
changes about as many of the index's pages, each written whole to SQLite's WAL.

`new_id` makes version-7 UUIDs (RFC 9562): the time in milliseconds in the first 48 bits, then 74
random bits from `os.urandom` (with the version's and the variant's bits), drawn for BLOCK ids at a
time, each UUID set up as `UUID.__init__` leaves one (its number, `is_safe` unknown): under a
microsecond, and the ids a call makes sort together by the millisecond (in no order within one),
after the ones made before while the clock does not step back, so the store's
inserts go to the end of its index. The ids stay unique across a server's forked workers (a child
forgets the random parts its parent drew: `os.register_at_fork`) and restarts (each process draws
its own) by their 74 random bits, as a `uuid4`'s 122 keep them; and across threads (a block's parts
are taken by `list.pop`, atomic under the GIL: none is handed out twice). Nothing reads an id's
version.

When jaclang's factory is not the standard `uuid4` (a caller replaced `uuid.uuid4` before jaclang
was imported, as scripts/row_digest.py does to make the same ids on two checkouts), `new_id` asks
that factory instead, so ingestion's ids come from it in the order jaclang's own would have."""

from __future__ import annotations

import os
import time
import uuid
from uuid import UUID, SafeUUID

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Anchor  # noqa: E402

__all__ = ["BLOCK", "new_id"]

# Ids whose random parts one call of os.urandom draws.
BLOCK = 256
# RFC 9562's version 7: the time's 48 bits above the version's 4 (0111), 12 random bits, the
# variant's 2 (10) and 62 random bits.
_TIME_SHIFT = 80
_VERSION_AND_VARIANT = (7 << 76) | (0b10 << 62)
_RANDOM_A = ((1 << 12) - 1) << 64
_RANDOM_B = (1 << 62) - 1

# jaclang's factory of an anchor's id.
_FACTORY = Anchor.__dataclass_fields__["id"].default_factory
# Whether it is the standard library's uuid4 (else `new_id` asks it).
# (by its code's file: a wrapper made with `functools.wraps(uuid.uuid4)` copies its names, not its code).
_STANDARD = (getattr(getattr(_FACTORY, "__code__", None), "co_filename", None) == uuid.__file__
             and getattr(_FACTORY, "__name__", None) == "uuid4")

# The random parts (the version's and variant's bits set) of the block not handed out yet.
_parts: list[int] = []
_new = object.__new__
_set = object.__setattr__
_UNKNOWN = SafeUUID.unknown
_now_ns = time.time_ns


def _draw() -> None:
    """Add the random parts of BLOCK ids, from os.urandom, to the block."""
    data = os.urandom(10 * BLOCK)
    from_bytes = int.from_bytes
    randoms = [from_bytes(data[start:start + 10]) for start in range(0, 10 * BLOCK, 10)]
    _parts.extend([((bits << 2) & _RANDOM_A) | (bits & _RANDOM_B) | _VERSION_AND_VARIANT for bits in randoms])


def new_id() -> UUID:
    """A new anchor id: a version-7 UUID of this millisecond (from jaclang's factory when it is not `uuid4`)."""
    if not _STANDARD:
        return _FACTORY()
    while True:
        try:
            part = _parts.pop()
            break
        except IndexError:
            _draw()
    made = _new(UUID)
    _set(made, "int", (_now_ns() // 1_000_000) << _TIME_SHIFT | part)
    _set(made, "is_safe", _UNKNOWN)
    return made


os.register_at_fork(after_in_child=_parts.clear)
