"""The engine in-process: the Jac walkers run on a local graph store, no server needed."""

from __future__ import annotations

import contextlib
import copy
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contextrender.jaclang_setup import compile_notice, import_jaclang

import_jaclang()  # before any jaclang import of this module: without the server's plugins

from jaclang.jac0core.runtime import JacRuntime, JacUtils  # noqa: E402
from jaclang.lib import spawn  # noqa: E402
from jaclang.runtimelib.exceptions import WriteConflict  # noqa: E402

from contextrender import by_id, core, store, working_set  # noqa: E402
from contextrender.endpoints import ENDPOINTS, EndpointMethods  # noqa: E402
from contextrender.locks import KeyedLocks  # noqa: E402

DEFAULT_STORE = os.environ.get("CONTEXTRENDER_STORE", ".contextrender")
# A call that loses a race for a shared node (jaclang's optimistic concurrency) runs again,
# on the graph as the winner left it, at most this many times in all.
MAX_ATTEMPTS = 5

# The endpoint walkers, loaded with this module: the Jac modules take seconds to load, which
# belongs to start-up (the proxy's, a replay's), not to the first call.
# The first load in a checkout compiles them, once, and says so (compile_notice).
with compile_notice():
    WALKERS = {name: getattr(core, name) for name in ENDPOINTS}
# The store every execution context opens: jaclang's SQLite store with a busy timeout and short
# commits (adapters/store.py).
store.install()

__all__ = ["Engine", "DEFAULT_STORE"]


def _unshared(report: Any, promised: bool = False) -> Any:
    """A call's report with its messages copied: a rendered message is the session index's own
    dict (and a caller that decorates what it was given, say with a cache breakpoint, would
    otherwise change what the next call compares its history with). A RenderResult is copied
    too: the index keeps the render itself (the next render counts what it shares with it, the
    render log's cached tokens), with the index's own messages (compared by identity first).
    A caller under the promise never to change a message (`promised`: engine/messages.jac
    SENT_UNCHANGED, the proxy) gets a render's messages as the index's own, in a list of its
    own: the promise covers the messages it is given as well as the ones it sends
    (tests/test_proxy_bodies.py checks that the proxy changes no rendered message), and their
    copy was 0.036 ms a render.
    A client's reports are parsed from JSON and share nothing already."""
    if isinstance(report, list):
        return [_unshared(item, promised) for item in report]
    if isinstance(report, core.RenderResult):
        report = copy.copy(report)
        report.messages = list(report.messages) if promised else core.detached(report.messages)
        report.decisions = list(report.decisions)  # its other list: the caller's own too
    elif isinstance(report, core.Restoration):
        report.message = core.detached(report.message)
    elif isinstance(report, dict):
        report = core.detached(report)
    return report


class Engine(EndpointMethods):
    """ContextRender on a local graph store (SQLite under `store`/.jac/data).

    Every endpoint is a method (adapters/endpoints.py): `ingest` reports an IngestSummary,
    `render`, `explain` and `render_variants` RenderResults, `configure` the RenderConfig.
    Every call is committed before it returns, so what a call acknowledged survives a crash.
    One engine is safe to share between threads: calls on the same session take turns, calls on
    different sessions run side by side.
    """

    def __init__(self, store: str | os.PathLike[str] = DEFAULT_STORE) -> None:
        core.serve_young_collections()  # fewer young collections in its process (engine/courtesy.jac)
        self.store = Path(store).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self._locks = KeyedLocks()
        self._keepalive = self._open_keepalive()
        # The anchors the last call left, for the next, while nobody else wrote the store: the
        # idle connection watches for other writers (adapters/working_set.py KeptAnchors).
        self._kept = working_set.KeptAnchors(self._keepalive, getattr(self, "_keepalive_path", None))

    def _open_keepalive(self) -> sqlite3.Connection | None:
        """An idle connection to the store's SQLite file, open while the engine lives. Each call
        opens and closes its own (a fresh execution context); when the last connection to a
        WAL database closes, SQLite checkpoints and deletes the WAL, and the next open rebuilds
        it and rewrites jaclang's schema row: 25-30 ms a call here, against 2 ms with this one
        connection kept open (the WAL stays; SQLite still checkpoints it as it grows)."""
        ctx = JacUtils.create_j_context(user_root=None, base_path_dir=str(self.store))
        path = getattr(ctx.mem.l3, "path", None)
        ctx.close()
        if not isinstance(path, str):
            return None  # another backend (a plugin's L3): nothing to keep open
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(path, check_same_thread=False)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
        self._keepalive_path = path
        return connection

    def warm_up(self) -> None:
        """Load the tokenizer and the local embedding model now: on first use they take about half
        a second, which otherwise falls on the first call (a proxy calls this before it serves).
        A remote embedding model is not called."""
        core.warm_up()

    def close(self) -> None:
        """Release the store (the engine's calls still work after it, only slower)."""
        self._kept.close()
        if self._keepalive is not None:
            store.release(self._keepalive_path)
            self._keepalive.close()
            self._keepalive = None

    def _call(self, walker: str, **fields: Any) -> Any:
        session_id = fields.get("session_id")
        return _unshared(self._run(lambda: WALKERS[walker](**fields), session_id), core.SENT_UNCHANGED.get())

    def _run(self, build: Callable[[], Any], session_id: str | None = None) -> Any:
        """Run the endpoint walker `build()` makes on the store, in a fresh execution context (like a
        server request: its commit scans only the nodes this call loaded or made, not every node
        the process has seen), holding the session's lock."""
        # An id that is not a string gets no lock: the walker refuses it before touching anything.
        held = self._locks.hold(session_id) if isinstance(session_id, str) else contextlib.nullcontext()
        with held:
            gone_before = False
            for attempt in range(1, MAX_ATTEMPTS + 1):
                try:
                    return self._attempt(build())
                except WriteConflict as conflict:
                    # A result gone from the store: one replay (it loads the session afresh), then its name.
                    if isinstance(conflict, by_id.ResultGone):
                        if gone_before:
                            raise core.ContextRenderError(conflict.message()) from None
                        gone_before = True
                    if attempt == MAX_ATTEMPTS:
                        raise core.ContextRenderError(
                            f"the store kept changing under this call ({MAX_ATTEMPTS} attempts); retry it"
                        ) from None
        raise AssertionError("unreachable")

    def _attempt(self, walker: Any) -> Any:
        # The root the context loads first is taken from the anchors the last call left, if kept.
        lending = store.LENDER.set(self._kept.take)
        try:
            ctx = JacUtils.create_j_context(user_root=None, base_path_dir=str(self.store))
        finally:
            store.LENDER.reset(lending)
        # This context commits once: new anchors are not hashed at the commit (adapters/working_set.py).
        kept = None
        if type(ctx.mem) is working_set.jac_memory.TieredMemory:
            ctx.mem.__class__ = working_set.OneCommitMemory
            # The anchors the last call left, if nobody else wrote the store since.
            kept = self._kept.lend_to(ctx.mem)
        applied: list[Any] = []
        recorded: set[Any] = set()
        l3 = ctx.mem.l3
        if l3 is not None:
            # Keep what each flush reports: jaclang logs a write it could not make and goes on.
            # And what each was asked to write: an anchor asked for but not written is not kept.
            flush = l3.apply
            l3.apply = lambda changes: recorded.update(changes.intents) or applied.append(flush(changes)) or applied[-1]
            # After its flush jaclang hashes every written node again, to tell later commits of
            # the context what is unchanged; this context commits once and is dropped (a quarter
            # of the commit's time on ingestion); the anchors kept for the next call are hashed
            # when it takes them.
            ctx.mem._post_apply = lambda report: None
        token = JacRuntime.push_request_context(ctx)
        try:
            # The spawn ends with jaclang's commit (one transaction), which logs and swallows
            # its own failures: they are read from what the flush reported.
            done = spawn(walker, ctx.get_root())
            if not applied:
                # Nothing was flushed: commit what is left (if anything is; closing did it before),
                # on this call's connection. It raises a lost race.
                ctx.mem.commit()
            if applied and applied[-1].conflicts:
                raise applied[-1].conflicts[0]  # a lost race: run again on the winner's graph
            if applied and applied[-1].failed:
                raise core.ContextRenderError(f"the store did not take this call's writes: {next(iter(applied[-1].failed.values()))}")
            # Everything this call changed is stored: closing need not hash every node it loaded
            # again to look for changes (a third of the commit's time on ingestion). Acknowledged
            # means durable.
            working = dict(ctx.mem.__mem__)
            ctx.mem.__mem__.clear()
            if kept is not None:
                written = {id for report in applied for id in report.applied}
                # A flush that left out a change it was given (skipped, or nothing applied): the
                # anchors may hold what is not stored, keep none.
                complete = recorded <= written and not any(report.skipped or report.failed for report in applied)
                self._kept.give_back(ctx.mem, kept, working if complete else None, written)
                kept = None
            ctx.close()
        except BaseException:
            # A failed call leaves nothing behind (as on the server): drop its uncommitted
            # writes before closing would commit them, and keep none of its anchors.
            if kept is not None:
                self._kept.give_back(ctx.mem, kept, None, set())
            ctx.mem.abort()
            ctx.close()
            raise
        finally:
            JacRuntime.reset_request_context(token)
        return done.reports[0]
