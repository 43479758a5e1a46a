"""The engine in-process: the Jac walkers run on a local graph store, no server needed."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from jaclang.jac0core.runtime import JacRuntime, JacUtils
from jaclang.lib import spawn

from contextrender_adapters import core
from contextrender_adapters.endpoints import ENDPOINTS, EndpointMethods

DEFAULT_STORE = os.environ.get("CONTEXTRENDER_STORE", ".contextrender")

# The endpoint walkers, loaded with this module: the Jac modules take seconds to load, which
# belongs to start-up (the proxy's, a replay's), not to the first call.
WALKERS = {name: getattr(core, name) for name in ENDPOINTS}

__all__ = ["Engine", "DEFAULT_STORE"]


class Engine(EndpointMethods):
    """ContextRender on a local graph store (SQLite under `store`/.jac/data).

    Every endpoint is a method (adapters/endpoints.py): `ingest` reports an IngestSummary,
    `render`, `explain` and `render_variants` RenderResults, `configure` the RenderConfig.
    Every call is committed before it returns, so what a call acknowledged survives a crash.
    Calls are serialised: one engine is safe to share between threads.
    """

    def __init__(self, store: str | os.PathLike[str] = DEFAULT_STORE) -> None:
        self.store = Path(store).resolve()
        self.store.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _call(self, walker: str, **fields: Any) -> Any:
        return self._run(WALKERS[walker](**fields))

    def _run(self, walker: Any) -> Any:
        # A fresh execution context per call, like a server request: its commit scans only the
        # nodes this call loaded or made, not every node the process has seen.
        with self._lock:
            ctx = JacUtils.create_j_context(user_root=None, base_path_dir=str(self.store))
            token = JacRuntime.push_request_context(ctx)
            try:
                walker.in_process = True
                # The spawn ends with jaclang's commit to the store: acknowledged means durable.
                done = spawn(walker, ctx.get_root())
            except BaseException:
                # A failed call leaves nothing behind (as on the server): drop its uncommitted
                # writes before close() would commit them.
                ctx.mem.abort()
                raise
            finally:
                JacRuntime.reset_request_context(token)
                ctx.close()
        return done.outcome
