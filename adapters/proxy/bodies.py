"""A request body parsed as `json.loads` parses it, reusing the last body of the same session where
the new one only adds to its history. An agent re-sends its whole history at every request (165 kB
a body on average on the peer bench), and `json.loads` made every object of it again. A body that
starts with the last one's bytes up to the end of its history's last item (an object) is read from
there: the keys before the history and the items are the last parse's, and the rest (the items
added, the keys after the history) is parsed by `json.loads` itself, in the state and at the
nesting the body's own text leaves json's parser in, so that every value and every error is json's
(docs/performance.md, "The proxy's CPU per request, eleventh pass").

One body is kept per session and protocol (`X-ContextRender-Session`), or, for a request that names
no session, per protocol and digest of the body's first UNNAMED_KEY_BYTES bytes (`unnamed_key`:
an agent's requests start alike; the value is json.loads's whichever body was kept, so sharing a
key costs reuse, never a value; docs/performance.md, thirteenth pass), within a bound in bytes
(the bytes kept and the objects' sizes). A body that does not extend the last one is parsed by
`json.loads` alone; where the last one ends is found (one scan of its history by json's scanner)
only when the next body starts with its first half, and not again for that session when it then
was not extended."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import OrderedDict
from json.decoder import WHITESPACE, scanstring
from typing import Any

__all__ = ["Bodies", "unnamed_key"]

# json.loads's own scanner (the decoder's default settings) and whitespace.
_SCAN = json.JSONDecoder().scan_once
_WS = WHITESPACE.match
# What the rest of a body is parsed after: an object whose first key no rest holds (a rest without
# the escape \u0000 holds no string with U+0000), its value a list whose first item is an object.
# The rest is then read as the body's own text is read after the last kept item: inside the
# top-level object, inside a list, after an object.
_OPEN = b'{"\\u0000":[{}'
_OPEN_KEY = "\x00"
_OPEN_LIST = 10  # where that list starts
# A kept entry without its body and its session's name (the entry, the key's tuple, the
# OrderedDict's slot).
_ENTRY_BYTES = 300
# A body's objects take at least this many times its bytes on agent text (1.59 the least over 77
# coding conversations' bodies): a body whose bytes times this are over a quarter of the bound
# is not kept, nor its history searched for (a search parses it again, to be thrown away).
_OBJECTS_PER_BYTE = 1.5
# The leading bytes that name the kept body of a request without a session name: past the model
# and the start of the history (a system prompt, the task), so that one agent's requests share a
# key once their bodies are longer than this (shorter ones are parsed whole: 0.1 ms at most).
UNNAMED_KEY_BYTES = 16384


def unnamed_key(path: str, raw: bytes) -> tuple[str, None, bytes]:
    """The key of the kept body for a request to `path` that names no session: the protocol's
    path and a digest of the body's first UNNAMED_KEY_BYTES bytes (a body is reused only by a body
    that starts with all of its bytes up to its history's last item, whatever the key)."""
    return (path, None, hashlib.blake2b(raw[:UNNAMED_KEY_BYTES], digest_size=16).digest())


def _footprint(value: Any) -> int:
    """The bytes a parsed value holds: sys.getsizeof of it and of everything in it (a key string
    counted at each use, an upper bound where json shares it)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _key_bytes(key: Any) -> int:
    """What a kept entry's key holds: its strings (the session's name, as the agent sent it)."""
    return sum(sys.getsizeof(part) for part in key) if isinstance(key, tuple) else sys.getsizeof(key)


def _item_end(text: str, list_end: int) -> int:
    """Where the last item of the list that ends at `list_end` ends (before its `]` and whitespace)."""
    end = list_end - 1
    while text[end - 1] in " \t\n\r":
        end -= 1
    return end


class _Kept:
    """A session's last body: its bytes (`raw`) until where its history ends is found; then the
    bytes up to the end of its history's last item (`prefix`), the keys before the history
    (`head`) and the items, as parsed."""

    __slots__ = ("raw", "prefix", "head", "items", "size", "scan")

    def __init__(self, raw: bytes, scan: bool) -> None:
        self.raw: bytes | None = raw
        self.prefix: bytes | None = None
        self.head: dict = {}
        self.items: list = []
        self.size = len(raw) + _ENTRY_BYTES
        # Whether the end of its history may be looked for (not after a search that led to no reuse).
        self.scan = scan

    def find_end(self, history: str) -> bool:
        """Find where the history ends in `raw` (a body json.loads accepted): the keys before it and
        its items parsed once by json's scanner. False where it is not a list ending with an object."""
        raw = self.raw
        if raw is None or raw[:1] != b"{" or json.detect_encoding(raw) != "utf-8":
            return False
        try:
            text = raw.decode("utf-8", "surrogatepass")
            (head, at) = ({}, _WS(text, 1).end())
            while text[at:at + 1] == '"':
                (name, at) = scanstring(text, at + 1)
                at = _WS(text, _WS(text, at).end() + 1).end()  # past the colon
                if name == history:
                    if text[at:at + 1] != "[":
                        return False
                    (items, end) = _SCAN(text, at)
                    break
                (head[name], at) = _SCAN(text, at)
                at = _WS(text, at).end()
                if text[at:at + 1] != ",":
                    return False
                at = _WS(text, at + 1).end()
            else:
                return False
        except (ValueError, RecursionError, StopIteration):
            return False
        if not items or not isinstance(items[-1], dict):
            return False
        self.prefix = raw[:len(text[:_item_end(text, end)].encode("utf-8", "surrogatepass"))]
        (self.raw, self.head, self.items) = (None, head, items)
        self.size = len(self.prefix) + _footprint(head) + _footprint(items) + _ENTRY_BYTES
        return True

    def extend(self, raw: bytes, history: str) -> dict | None:
        """`raw`'s value when it starts with `prefix` and json.loads reads the rest (None: parse it
        whole), the kept body then moved on to it."""
        rest = raw[len(self.prefix):]
        if b"\\u0000" in rest:
            return None
        try:
            text = (_OPEN + rest).decode("utf-8", "surrogatepass")
            whole = json.loads(text)
        except (ValueError, RecursionError):
            return None
        added = whole.pop(_OPEN_KEY)[1:]
        value = dict(self.head)
        value[history] = self.items + added
        value.update(whole)  # the keys after the history, as json.loads sets them (a key again: its last value)
        if added:
            if not isinstance(added[-1], dict):
                self.prefix = None  # nothing to reuse next time
                return value
            (_, end) = _SCAN(text, _OPEN_LIST)  # json.loads read it: the same list, to find where it ends
            grown = len(text[len(_OPEN):_item_end(text, end)].encode("utf-8", "surrogatepass"))
            self.prefix = raw[:len(self.prefix) + grown]
            listed = sys.getsizeof(self.items)
            self.items = self.items + added
            self.size += grown + _footprint(added) + sys.getsizeof(self.items) - listed
        return value


class Bodies:
    """The last body of each session and protocol, least recently used first, within `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.total = 0
        self._kept: OrderedDict[Any, _Kept] = OrderedDict()

    def parse(self, raw: bytes, key: Any, history: str) -> Any:
        """`json.loads(raw)`: its value, or its error. `key`: the session and protocol of the request,
        or `unnamed_key`'s (None: nothing is kept); `history`: the key of its history."""
        if key is None:
            return json.loads(raw)
        kept = self._kept.pop(key, None)
        scan = True
        if kept is not None:
            self.total -= kept.size + _key_bytes(key)
            searched = kept.prefix is None and kept.scan and raw.startswith(kept.raw[:len(kept.raw) // 2])
            if searched:
                kept.find_end(history)
            if kept.prefix is not None and raw.startswith(kept.prefix):
                value = kept.extend(raw, history)
                if value is not None:
                    if kept.prefix is not None:
                        self._keep(key, kept)
                    return value
            # A search for the end of the history that led to no reuse is not made again for this session.
            scan = kept.scan and not searched
        value = json.loads(raw)
        self._keep(key, _Kept(raw if scan else b"", scan))  # not to be searched: its bytes are not kept
        return value

    def _keep(self, key: Any, kept: _Kept) -> None:
        quarter = self.max_bytes // 4
        if kept.size > quarter or (kept.raw and len(kept.raw) * _OBJECTS_PER_BYTE > quarter):
            kept = _Kept(b"", scan=False)  # too large to keep: parsed whole from now on, not searched again
        self._kept[key] = kept
        self.total += kept.size + _key_bytes(key)
        while self.total > self.max_bytes:
            (oldest_key, oldest) = self._kept.popitem(last=False)
            self.total -= oldest.size + _key_bytes(oldest_key)
