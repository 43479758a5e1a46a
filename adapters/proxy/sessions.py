"""The proxy's per-session state: a session named by a header or derived from the conversation,
its lock and request count, the answers it stored (within a memory bound), the encoding it counts
with, the input estimate, and the ingestion of each answer once it is complete: with the next
request's render when that request comes back within the answer delay and re-sends it, else on
its own (docs/design-decisions.md, "The answer stored with the next request")."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from contextrender import core
from contextrender.core import UnknownSession, cache_bytes_setting, content_text, get_tokenizer, normal_form, same_event
from contextrender.proxy.interfaces import Backend, sent_unchanged

__all__ = ["Answer", "SessionState", "Sessions", "derive_session", "model_encoding", "named_session"]

log = logging.getLogger("contextrender.proxy")

_DIGITS = re.compile(r"\d+")
# The stored answers the proxy remembers, least recently used sessions forgotten first: this
# share of CONTEXTRENDER_INDEX_CACHE_MB (the engine's indexes hold the rest; answers are small).
STATE_SHARE = 16
# A session's state without its answers (lock, counters, its table entry).
STATE_BYTES = 600


def chain_events(messages: list[dict]) -> int:
    """How many events of `messages` the engine chains: all but the leading system (or
    developer) messages, which it keeps as the system prompt."""
    lead = next((i for i, m in enumerate(messages) if not (isinstance(m, dict) and m.get("role") in ("system", "developer"))), len(messages))
    return len(messages) - lead


def derive_session(messages: list[dict]) -> str:
    """The session of a conversation that names none: a hash of its stable prefix, the leading
    system/developer messages (with every number blanked: agents put dates and times there) and
    the first user message. Every later call of the same run sends the same prefix, so it maps to
    the same session; two runs that start identically share one (send `X-ContextRender-Session`
    to keep them apart)."""
    prefix: list[list[str]] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role in ("system", "developer"):
            prefix.append([role, _DIGITS.sub("#", content_text(message.get("content")))])
            continue
        if role == "user":
            prefix.append([role, content_text(message.get("content"))])
        break
    digest = hashlib.sha256(json.dumps(prefix, ensure_ascii=False).encode()).hexdigest()
    return f"proxy-{digest[:24]}"


def named_session(value: bytes) -> tuple[str, str]:
    """The session a header names, from the value's bytes as sent: its storage key, and its name
    for display. The name is the bytes decoded as UTF-8 (bytes that are not UTF-8 read as
    Latin-1, the one other encoding HTTP headers have had). The key is the name itself when the
    bytes are UTF-8 and the name is a valid session id (engine.validate: at most 256 printable
    characters); else (longer, a tab or another control character, bytes that are not UTF-8) a
    digest of the bytes: any name the agent sends is managed, and two names never share a key."""
    try:
        name = value.decode("utf-8")
    except UnicodeDecodeError:
        name = value.decode("latin-1")
    else:
        try:
            core.check_session_id(name)
            return name, name
        except core.InvalidRequest:
            pass
    return f"proxy-named-{hashlib.sha256(value).hexdigest()[:32]}", name


def model_encoding(model: str) -> str:
    """The token encoding for a model family: Claude models get the `claude` estimate (o200k
    scaled, see engine.measure.SCALED_ENCODINGS), GPT-4 and GPT-3.5 cl100k, others o200k."""
    name = model.lower().rsplit("/", 1)[-1]
    if "claude" in name:
        return "claude"
    if name == "gpt-4" or name.startswith(("gpt-4-", "gpt-3.5")):
        return "cl100k_base"
    return core.DEFAULT_ENCODING


@dataclass(eq=False)
class Answer:
    """An answer not stored yet: the message (None: only its usage report is left, a later request
    having been rendered meanwhile), at `position` of the message list, after `at` events of the
    chain; the usage report (with the estimate); the list its request sent (as the session stores
    it); the timer that stores it alone."""

    turn: int
    position: int
    message: dict | None
    usage: dict
    at: int
    sent: list
    timer: asyncio.TimerHandle | None = None


class SessionState:
    def __init__(self) -> None:
        # The session's name as the agent sent it (its key when it named none, or a valid one).
        self.name = ""
        self.lock = asyncio.Lock()
        self.turn = 0
        self.answers: dict[int, dict] = {}
        # Bytes it holds (estimated: its answers as JSON, plus STATE_BYTES).
        self.size = STATE_BYTES
        # The encoding this process has checked the session counts with (None: not yet).
        self.encoding: str | None = None
        # What the format layer remembered of the last forwarded request (prompt cache placement).
        self.previous: Any = None
        # Token counts of the last system prompt and tool list seen (the input estimate).
        self.counted: dict[str, tuple[str, int]] = {}
        self.warned = False
        # Whether its last request went upstream unmanaged (warned once until it is managed again).
        self.unmanaged = False
        # Whether this process has given the session its name (`Sessions.check_name`).
        self.named = False
        # The history last forwarded (rendered), for the cached-prefix share (contextrender/metrics.py).
        self.rendered: list | None = None
        # The last forwarded body's list items and their JSON texts, by id (restores.encoded_body).
        self.encoded: dict[int, tuple[Any, str]] = {}
        # The last answer, until it is stored (with the next request's render, or alone).
        self.pending: Answer | None = None
        # The message list the last request sent, and its normal forms (`Sessions.reconcile`).
        self.sent: list = []
        self.normal: list = []
        # Each stored answer's position found the same as the agent's copy at the last request:
        # (the answer, the normal form it was compared with), the very objects (`Sessions.reconcile`).
        self.matched: dict[int, tuple[dict, Any]] = {}


def _common_prefix(a: list, b: list) -> int:
    """How many leading items of `a` and `b` are equal."""
    n = 0
    for (x, y) in zip(a, b):
        if x is not y and x != y:
            break
        n += 1
    return n


def _answer_bytes(message: dict) -> int:
    return 2 * len(json.dumps(message, ensure_ascii=False)) + STATE_BYTES


class Sessions:
    """Every session's state, least recently used first: its lock, its request count, and the
    answers the proxy stored, by their position in the message list; within `max_state_bytes`."""

    def __init__(self, backend: Backend, answer_delay: float = 0.0) -> None:
        self.backend = backend
        # Seconds an answer waits for the next request of its session to be stored with its
        # render (0: stored alone right after the response).
        self.answer_delay = answer_delay
        self._tasks: set[asyncio.Future] = set()
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()
        self.max_state_bytes = cache_bytes_setting() // STATE_SHARE
        self.state_bytes = 0

    def session(self, session_id: str) -> SessionState:
        """The session's state, marked as just used; the least recently used idle sessions are
        forgotten while the states hold more than `max_state_bytes` (their answers then match by
        normal form only, as the engine matches echoes)."""
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = SessionState()
            self.state_bytes += state.size
        self._sessions.move_to_end(session_id)
        while self.state_bytes > self.max_state_bytes and len(self._sessions) > 1:
            (oldest, old) = next(iter(self._sessions.items()))
            if old.lock.locked() or old is state or old.pending is not None:
                break  # in use, or an answer to store: forget it later
            del self._sessions[oldest]
            self.state_bytes -= old.size
        return state

    def remember(self, state: SessionState, position: int, message: dict) -> None:
        self.forget(state, [position])
        state.answers[position] = message
        size = _answer_bytes(message)
        state.size += size
        self.state_bytes += size

    def forget(self, state: SessionState, positions: list[int]) -> None:
        for position in positions:
            state.matched.pop(position, None)
            if position in state.answers:
                size = _answer_bytes(state.answers.pop(position))
                state.size -= size
                self.state_bytes -= size

    def reconcile(self, session_id: str, messages: list) -> list:
        """The message list as the session stores it: assistant messages in normal form, and
        each answer the proxy stored in place of the agent's copy of it (agents rebuild answers
        from streams or SDK objects: `content` "" for null, extra keys in tool calls). Without
        this the engine, which compares exactly, would take every echoed answer for a rewrite."""
        state = self.session(session_id)
        # An agent re-sends the history it sent last time and adds to it: the messages equal to
        # the last request's keep their normal forms (normal_form is a function of the value),
        # the rest are put in normal form (about 0.5 ms a request at 350 messages, in Jac).
        same = _common_prefix(messages, state.sent)
        normal = state.normal[:same] + [normal_form(m) for m in messages[same:]]
        (state.sent, state.normal) = (messages, normal)
        messages = list(normal)
        stored = state.answers
        for position in sorted(stored):
            if position < len(messages) and self._same(state, position, stored[position], messages[position]):
                messages[position] = stored[position]
                continue
            # History rewritten (or cut) here: the engine forks; later answers are on the old branch.
            self.forget(state, [p for p in stored if p >= position])
            break
        return messages

    @staticmethod
    def _same(state: SessionState, position: int, answer: dict, incoming: Any) -> bool:
        """same_event(answer, incoming), compared once for the same two objects: an agent re-sends
        its history, whose normal forms `reconcile` keeps, so only answers at new places are
        compared (a Jac function, about 5 us each; every stored answer at every request before)."""
        seen = state.matched.get(position)
        if seen is not None and seen[0] is answer and seen[1] is incoming:
            return True
        if not same_event(answer, incoming):
            return False
        state.matched[position] = (answer, incoming)
        return True

    def check_name(self, session_id: str, state: SessionState) -> None:
        """Keep the name the agent sent on the session, where its key is not that name (a digest:
        `named_session`), so that get_session, list_sessions and the inspector show it (once per
        session and process; it also creates the session). A backend that cannot store it (an
        older server) leaves the session unnamed, and managed."""
        if state.named or not state.name or state.name == session_id:
            return
        state.named = True
        try:
            self.backend.create_session(session_id, name=state.name)
        except Exception as exc:  # noqa: BLE001 - a name is for display: never worth an unmanaged session
            log.warning("session %s: its name %r was not stored: %s", session_id, state.name, exc)

    @staticmethod
    def checked(session_id: str, state: SessionState, encoding: str) -> bool:
        """Whether `check_encoding` has nothing to do (its name stored or none to store, and
        the encoding checked): the request then takes no worker thread for it."""
        return state.encoding == encoding and (state.named or not state.name or state.name == session_id)

    def check_encoding(self, session_id: str, state: SessionState, encoding: str) -> None:
        """Count a new session's tokens with its model family's encoding (once per session and
        process), after giving it its name (`check_name`). A session's own setting wins, and one
        that already holds events keeps the encoding it was counted with (its stored counts would
        not match)."""
        self.check_name(session_id, state)
        if state.encoding == encoding:
            return
        try:
            info = self.backend.get_session(session_id)
        except UnknownSession:
            info = {"events": 0, "config": {}}
        chosen = info["config"].get("encoding")
        if chosen is None and info["events"] == 0 and encoding != core.DEFAULT_ENCODING:
            self.backend.configure(session_id, encoding=encoding)
        elif (chosen or core.DEFAULT_ENCODING) != encoding:
            log.warning("session %s counts tokens with %s, not %s (its model's): set on an earlier request or by configure_session",
                        session_id, chosen or core.DEFAULT_ENCODING, encoding)
        state.encoding = encoding

    def estimate(self, state: SessionState, encoding: str, result: Any, tools: Any) -> int:
        """The whole input the upstream will count, estimated: system prompt, rendered history,
        current message and tool definitions (the first and last cached per session: long and
        mostly unchanged between calls)."""
        tokenizer = get_tokenizer(encoding)
        messages = list(result.messages)
        lead = next((i for (i, m) in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
        system = messages[:lead]
        current = messages[-1:] if len(messages) > lead and messages[-1].get("role") == "user" else []

        def cached(kind: str, value: Any, count: Callable[[], int]) -> int:
            key = json.dumps(value, ensure_ascii=False, sort_keys=True)
            if state.counted.get(kind, ("", 0))[0] != key:
                state.counted[kind] = (key, count())
            return state.counted[kind][1]

        total = result.history_tokens + tokenizer.history_tokens(current)
        total += cached("system", system, lambda: tokenizer.history_tokens(system))
        if tools:
            total += cached("tools", tools, lambda: tokenizer.count(json.dumps(tools, ensure_ascii=False)))
        return total

    def answered(self, session_id: str, turn: int, position: int, estimate: int, at: int,
                 sent: list | None = None) -> Callable[..., BackgroundTask | None]:
        """What to do with the answer to the session's request number `turn` (its message at
        `position` of the list `sent`, after `at` events of the chain), once it is complete:
        remember it, and store it with the next request's render, or alone after the response
        when no request comes within the answer delay."""
        # `extra_estimate`: the estimated input of the request's restore rounds, whose usage the
        # report includes.
        def record(message: dict | None, usage: dict, extra_estimate: int = 0) -> BackgroundTask | None:
            state = self.session(session_id)
            if state.turn != turn:
                message = None  # a later request of the session has been rendered meanwhile
            if message is not None:
                self.remember(state, position, message)
            if usage:
                usage = usage | {"estimated_input_tokens": estimate + extra_estimate}
            if message is None and not usage:
                return None
            answer = Answer(turn, position, message, usage, at, sent or [])
            if self.answer_delay <= 0:
                return BackgroundTask(self.store_answer, session_id, answer)
            earlier, state.pending = state.pending, answer
            # Held before the agent can send its next request (the response is not sent yet); the
            # timer starts after the response.
            return BackgroundTask(self._hold, session_id, answer, earlier)

        return record

    async def _hold(self, session_id: str, answer: Answer, earlier: Answer | None) -> None:
        if earlier is not None:  # two answers of one session in flight: the earlier one alone, now
            self._cancel(earlier)
            await self.store_answer(session_id, earlier)
        state = self.session(session_id)
        if state.pending is answer:
            answer.timer = asyncio.get_running_loop().call_later(self.answer_delay, self._store_later, session_id, answer)

    def _store_later(self, session_id: str, answer: Answer) -> None:
        task = asyncio.ensure_future(self.store_pending(session_id, answer))
        self._tasks.add(task)  # held: the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _cancel(answer: Answer) -> None:
        if answer.timer is not None:
            answer.timer.cancel()

    async def store_pending(self, session_id: str, answer: Answer) -> None:
        """Store `answer` alone if it is still the session's pending one (the timer's end)."""
        state = self.session(session_id)
        async with state.lock:
            if state.pending is not answer:
                return  # taken by a request meanwhile
            state.pending = None
            await self.store_held(session_id, state, answer)

    async def store_all(self) -> None:
        """Store every pending answer alone (the proxy stops)."""
        for (session_id, state) in list(self._sessions.items()):
            if state.pending is not None:
                self._cancel(state.pending)
                await self.store_pending(session_id, state.pending)

    async def take_answer(self, session_id: str, state: SessionState, prepared: list) -> Answer | None:
        """Under the session's lock, before its request is rendered: the pending answer, for the
        render to store with its usage report, when `prepared` (the list as the session stores it)
        re-sends it right after the very list its request sent (or it is a usage report alone);
        else (None) the answer is stored alone first, where it would have been after its response."""
        answer, state.pending = state.pending, None
        if answer is None:
            return None
        self._cancel(answer)
        if answer.message is None or (
            answer.position < len(prepared) and prepared[answer.position] is answer.message
            and prepared[:answer.position] == answer.sent
        ):
            return answer
        await self.store_held(session_id, state, answer, alone=True)
        return None

    async def store_answer(self, session_id: str, answer: Answer, alone: bool = False) -> None:
        state = self.session(session_id)
        async with state.lock:
            await self.store_held(session_id, state, answer, alone)

    async def store_held(self, session_id: str, state: SessionState, answer: Answer, alone: bool = False) -> None:
        """Store the answer alone (the caller holds the session's lock). `alone`: the next request,
        about to be rendered, does not re-send it (or its render failed)."""
        # Else a next request of the session, rendered meanwhile, has ingested it with its own list.
        messages = [answer.message] if answer.message is not None and (alone or state.turn == answer.turn) else []
        if not messages and not answer.usage:
            return
        # Placed after the events its request sent: a resent earlier turn's answer does not land
        # after the later events the session holds (the engine forks there if it differs).
        options = ({"usage": answer.usage} if answer.usage else {}) | ({"at": answer.at} if messages else {})
        try:
            await run_in_threadpool(sent_unchanged, self.backend.ingest, session_id, messages, append=True, **options)
        except Exception as exc:  # noqa: BLE001 - an answer that cannot be stored must not break the agent
            log.warning("session %s: the answer was not ingested: %s", session_id, exc)
