"""Request bodies parsed as `json.loads` parses them, reusing the last body of the same
conversation: an agent re-sends its whole history at every request, so the messages that the last
body held, byte for byte at the same place, are taken from its parse instead of parsed again.

The body's top-level object is read key by key with json's own scanner (`scan_once`, the C code
`json.loads` runs), the `messages` array element by element, and each element's end is kept; the
next body of the same key whose text starts with the last one's up to the end of its k-th message
(`str.startswith`) reuses those k messages and everything before them, and the scan goes on from
there. Anything else (a body not starting with `{`, another shape, a duplicated `messages` key, an
error of any kind) is parsed by `json.loads` itself: values and errors are json's.

The reused messages are the objects the last parse made: nothing in the proxy changes a request's
messages in place (it copies what it changes), which `tests/test_proxy_bodies.py` checks."""

from __future__ import annotations

import json
from collections import OrderedDict
from json.decoder import WHITESPACE, scanstring
from typing import Any

__all__ = ["Bodies"]

_DECODER = json.JSONDecoder()
_SCAN = _DECODER.scan_once
_SPACE = WHITESPACE.match


class _Parsed:
    """A body's text and what its scan found: the keys and values before `messages`, the
    messages, and the offset in the text right after each message."""

    __slots__ = ("text", "array", "before", "messages", "ends")

    def __init__(self, text: str, array: str, before: list[tuple[str, Any]], messages: list, ends: list[int]) -> None:
        self.text, self.array, self.before, self.messages, self.ends = text, array, before, messages, ends

    def reused(self, text: str) -> int:
        """How many of this body's messages `text` starts with, byte for byte at the same place."""
        ends = self.ends
        if not ends or not text.startswith(self.text[:ends[0]]):
            return 0
        if text.startswith(self.text[:ends[-1]]):
            return len(ends)
        (low, high) = (1, len(ends) - 1)  # ends[low - 1] matches, ends[high] does not
        while low <= high:
            middle = (low + high) // 2
            if text.startswith(self.text[:ends[middle]]):
                low = middle + 1
            else:
                high = middle - 1
        return low


class _NotFast(Exception):
    """The body is not of the shape the scan reads: `json.loads` parses it."""


def _after_space(text: str, at: int) -> int:
    return _SPACE(text, at).end()


def _scan(text: str, last: _Parsed | None, array: str) -> tuple[dict, _Parsed]:
    """The body's value, and its scan (reusing `last`'s messages that `text` starts with); the
    messages are the top-level list named `array`."""
    if last is not None and last.array == array and (k := last.reused(text)):
        (before, messages, ends, at) = (last.before, last.messages[:k], last.ends[:k], last.ends[k - 1])
        pairs = list(before)
    else:
        if not text.startswith("{"):
            raise _NotFast
        (pairs, before, messages, ends, at) = ([], [], None, [], 1)
        at = _after_space(text, at)
        if text[at:at + 1] == "}":
            raise _NotFast  # an empty object: json's
        while True:  # the keys before "messages"
            if text[at:at + 1] != '"':
                raise _NotFast
            (key, at) = scanstring(text, at + 1)
            at = _after_space(text, at)
            if text[at:at + 1] != ":":
                raise _NotFast
            at = _after_space(text, at + 1)
            if key == array and text[at:at + 1] == "[":
                at += 1
                messages = []
                break
            (value, at) = _SCAN(text, at)
            pairs.append((key, value))
            before.append((key, value))
            at = _after_space(text, at)
            if text[at:at + 1] != ",":
                raise _NotFast  # no messages array before the object's end
            at = _after_space(text, at + 1)
        at = _after_space(text, at)
        if text[at:at + 1] == "]":
            raise _NotFast  # an empty list: nothing to reuse
        (message, at) = _SCAN(text, at)
        if not isinstance(message, dict):
            raise _NotFast  # only an object's end ("}") cannot be the start of a longer value
        messages.append(message)
        ends.append(at)
    while True:  # the rest of the messages
        at = _after_space(text, at)
        mark = text[at:at + 1]
        if mark == "]":
            at += 1
            break
        if mark != ",":
            raise _NotFast
        at = _after_space(text, at + 1)
        (message, at) = _SCAN(text, at)
        if not isinstance(message, dict):
            raise _NotFast
        messages.append(message)
        ends.append(at)
    pairs.append((array, messages))
    while True:  # the keys after "messages"
        at = _after_space(text, at)
        mark = text[at:at + 1]
        if mark == "}":
            at += 1
            break
        if mark != ",":
            raise _NotFast
        at = _after_space(text, at + 1)
        if text[at:at + 1] != '"':
            raise _NotFast
        (key, at) = scanstring(text, at + 1)
        if key == array:
            raise _NotFast  # a second one: json's dict keeps the last
        at = _after_space(text, at)
        if text[at:at + 1] != ":":
            raise _NotFast
        (value, at) = _SCAN(text, _after_space(text, at + 1))
        pairs.append((key, value))
    if _after_space(text, at) != len(text):
        raise _NotFast  # extra data: json's error
    if any(key == array for (key, _) in before):
        raise _NotFast
    # The list kept is not the one returned: a caller may change its own list.
    return dict(pairs), _Parsed(text, array, before, list(messages), ends)


class Bodies:
    """Parses request bodies (`parse`), keeping the last one of each key (a conversation: the
    session header sent, else the body's opening bytes), at most `keep` of them and `chars`
    characters of their texts in all (the least recently used forgotten first)."""

    def __init__(self, keep: int = 256, chars: int = 64 << 20) -> None:
        self.keep = keep
        self.chars = chars
        self._held = 0
        self._last: OrderedDict[Any, _Parsed] = OrderedDict()

    def parse(self, raw: bytes, key: Any, array: str = "messages") -> Any:
        """`json.loads(raw)`: the same value, or the same error raised. `array`: the name of the
        top-level list the conversation grows (chat completions' and Messages' `messages`)."""
        # json.loads reads a body whose first two bytes are not zero as UTF-8 (surrogates let
        # through); a zero second byte is UTF-16 or UTF-32.
        if not raw.startswith(b"{") or raw[1:2] == b"\x00" or len(raw) > self.chars // 4:
            return json.loads(raw)
        last = self._forget(key)
        try:
            text = raw.decode("utf-8", "surrogatepass")
            (value, parsed) = _scan(text, last, array)
        except Exception:  # noqa: BLE001 - every other case, errors included, is json's own
            return json.loads(raw)
        self._last[key] = parsed
        self._held += len(text)
        while self._last and (len(self._last) > self.keep or self._held > self.chars):
            self._forget(next(iter(self._last)))
        return value

    def _forget(self, key: Any) -> _Parsed | None:
        parsed = self._last.pop(key, None)
        if parsed is not None:
            self._held -= len(parsed.text)
        return parsed
