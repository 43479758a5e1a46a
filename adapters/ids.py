"""The ids of the anchors ingestion makes (walkers/impl/ingest.links.impl.jac), drawn in blocks.

jaclang gives every anchor it makes an id from its `Anchor.id` field's factory, the standard
library's `uuid4`: 16 bytes of `os.urandom` (a system call) and `UUID.__init__` (Python) for each,
2-8 µs by the machine's load, about 20,000 times for 2,000 tool results in one call. `new_id`
makes the same ids (version-4 UUIDs of 122 random bits from `os.urandom`) from one call of
`os.urandom` for BLOCK of them, each UUID set up as `UUID.__init__` leaves it (its number and
`is_safe` unknown): about 0.6 µs. The ids stay unique across a server's forked workers (a child
forgets the block its parent drew: `os.register_at_fork`) and across restarts (each process draws
its own), and across threads (a block's numbers are taken by `list.pop`, atomic under the GIL: no
number is handed out twice).

When jaclang's factory is not the standard `uuid4` (a caller replaced `uuid.uuid4` before jaclang
was imported, as scripts/row_digest.py does to make the same ids on two checkouts), `new_id` asks
that factory instead, so ingestion's ids come from it in the order jaclang's own would have."""

from __future__ import annotations

import os
import uuid
from uuid import UUID, SafeUUID

from contextrender.jaclang_setup import import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.archetype import Anchor  # noqa: E402

__all__ = ["BLOCK", "new_id"]

# Ids drawn by one call of os.urandom.
BLOCK = 256
# What UUID(bytes=..., version=4) clears and sets in the number: the variant's bits (RFC 4122) and
# the version's.
_CLEAR = ~((0xC000 << 48) | (0xF000 << 64))
_SET = (0x8000 << 48) | (4 << 76)

# jaclang's factory of an anchor's id.
_FACTORY = Anchor.__dataclass_fields__["id"].default_factory
# Whether it is the standard library's uuid4 (else `new_id` asks it).
_STANDARD = getattr(_FACTORY, "__module__", None) == uuid.__name__ and getattr(_FACTORY, "__qualname__", None) == "uuid4"

# The numbers of the current block not handed out yet.
_numbers: list[int] = []
_new = object.__new__
_set = object.__setattr__
_UNKNOWN = SafeUUID.unknown


def _draw() -> None:
    """Add BLOCK version-4 numbers from os.urandom to the block."""
    data = os.urandom(16 * BLOCK)
    from_bytes = int.from_bytes
    _numbers.extend([(from_bytes(data[start:start + 16]) & _CLEAR) | _SET for start in range(0, 16 * BLOCK, 16)])


def new_id() -> UUID:
    """A new anchor id: what `uuid.uuid4()` would give (from jaclang's factory when it is not that)."""
    if not _STANDARD:
        return _FACTORY()
    while True:
        try:
            number = _numbers.pop()
            break
        except IndexError:
            _draw()
    made = _new(UUID)
    _set(made, "int", number)
    _set(made, "is_safe", _UNKNOWN)
    return made


os.register_at_fork(after_in_child=_numbers.clear)
