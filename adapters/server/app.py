"""What ContextRender adds to `jac start`'s HTTP server (a jaclang plugin: the `jac` entry point
`server` in pyproject.toml).

- Errors that say what to fix: a walker that raises one of ContextRender's errors answers with
  its HTTP status (400, 404, 409) and message instead of jac-scale's generic 500; other failures
  stay 500, with the traceback in the server log and never in the response.
- Request bodies: at most CONTEXTRENDER_MAX_BODY_MB (default 32; 413), arriving without a pause
  longer than CONTEXTRENDER_BODY_TIMEOUT seconds (default 30) and within ten times that (408);
  JSON without NaN/Infinity or lone surrogates and at most 64 deep (400 naming the field); a walker body
  that names a field the walker does not have gets 400 (jac-scale would drop it silently).
- One request at a time per session: calls on one (user, session_id) wait for each other, from
  reading the body to the last byte of the answer, so jaclang's commit is inside; different
  sessions run in parallel. The lock is per process (docs/server-and-security.md).
- Only the caller's own graph: jac-scale's `POST /walker/<name>/<node_id>` routes (a walker spawned
  on any node id, another user's included) and `POST /function/<name>` routes (module functions
  such as `jobj`) are not served.
- No public secrets: the server refuses to start with jac-scale's built-in JWT secret or a weak
  one, and its admin portal is off unless CONTEXTRENDER_ADMIN_PASSWORD sets a strong password
  (jac-scale would create `admin` / `changeme`). CONTEXTRENDER_DEV=1 allows weak ones locally.
- CONTEXTRENDER_HOST: the interface to listen on (jac-scale always binds 0.0.0.0).

jac-scale builds its FastAPI app in its server class; this module is a jaclang plugin whose
server class is jac-scale's with these additions. jaclang loads the plugins of the `jac` entry
point group when it is imported, and the last plugin registered answers first: importing
jac-scale's plugin here registers it before this one, whatever order the entry points come in.
"""

from __future__ import annotations
import dataclasses
import gc
import logging
import os
import secrets
import sys
from typing import Any

import jac_scale.plugin  # noqa: F401  (registers jac-scale's server class hook before ours)
from starlette.requests import Request

from contextrender import store
from contextrender.limits import use_guarded_http
from contextrender.metrics import CountRequests, ServerMetrics, metrics_response
from contextrender.server import access_table
from contextrender.server import distributed
from contextrender.server.accounts import LoginThrottle, logout_route
from contextrender.server.cors import settle_cors
from contextrender.server.guard import REFUSED_PREFIXES, RequestGuard
from contextrender.server.secret_checks import (  # noqa: F401 (PUBLIC_DEFAULT_SECRET, strength_problem: re-exported)
    PUBLIC_DEFAULT_SECRET, admin_password, check_jwt_secret, check_monitoring_password, strength_problem,
)
from contextrender.server.errors import map_walker_error  # noqa: F401 (re-exported)
from contextrender.settings import start_setting

logger = logging.getLogger("contextrender.server")

# Python's own switch interval (sys.getswitchinterval() at start-up: 5 ms).
DEFAULT_SWITCH_INTERVAL_MS = 5.0


def use_switch_interval() -> float:
    """The server process's GIL switch interval, CONTEXTRENDER_SWITCH_INTERVAL milliseconds: how long
    a thread computing keeps the interpreter before a request's thread that waits for it gets its
    turn (docs/performance.md, "Issue 30, third round"). Applied; the milliseconds set."""
    milliseconds = start_setting("CONTEXTRENDER_SWITCH_INTERVAL", DEFAULT_SWITCH_INTERVAL_MS, unit="milliseconds")
    sys.setswitchinterval(milliseconds / 1000)
    return milliseconds


def server_class() -> type:
    from jac_scale.config_loader import get_scale_config
    from jac_scale.serve import JacAPIServer
    from starlette.middleware import Middleware

    class ContextRenderServer(JacAPIServer):
        # Jac compiles an archetype's `postinit` to the dataclass `__post_init__`.
        def __post_init__(self) -> None:
            config = get_scale_config()
            check_jwt_secret(config.get_jwt_config()["secret"])
            store.busy_timeout()  # a malformed CONTEXTRENDER_STORE_BUSY_TIMEOUT stops the start, saying so
            use_switch_interval()  # so does a malformed CONTEXTRENDER_SWITCH_INTERVAL
            check_monitoring_password(config.get_monitoring_config())
            self.admin_password = admin_password()
            # jac-scale reads these when it registers the admin routes: off, or on with the
            # operator's password in place of its `changeme`.
            settings = config.load().setdefault("admin", {})
            settings["enabled"] = self.admin_password is not None
            if self.admin_password is not None:
                settings.update(default_password=self.admin_password, require_password_reset=False)
            super().__post_init__()
            settle_cors(self.server.app.user_middleware)  # jac-scale's reflects any origin (adapters/server/cors.py)
            try:  # a header read timeout and a cap on connections per client (contextrender/limits.py)
                use_guarded_http()
            except ValueError as bad:
                raise SystemExit(f"ContextRender refuses to start: {bad}") from None
            # Access levels from the compile cache instead of a compile from source (about half
            # of a warm start; adapters/server/access_table.py). The first load is get_walkers() below.
            access_table.use_cached_tables(self.introspector)
            # Walkers that create their session (`create`), and delete_session.
            root_writers = {name for (name, cls) in self.get_walkers().items() if getattr(cls, "create", False)}
            self.server.app.user_middleware.append(Middleware(
                RequestGuard, fields_of=self.request_fields, admin=self.admin_password is not None,
                root_writers=root_writers | {"delete_session"},
            ))
            # Failed logins throttled (429 with Retry-After; adapters/server/accounts.py).
            self.server.app.user_middleware.append(Middleware(LoginThrottle))
            # Requests counted by endpoint and status, outermost: refusals too (contextrender/metrics.py).
            self.metrics = ServerMetrics(self.get_walkers)
            self.server.app.user_middleware.insert(0, Middleware(CountRequests, metrics=self.metrics))
            # Several processes on one store (adapters/server/distributed.py, docs/scale-out.md); nothing without Redis.
            distributed.install(self.server.app, root_writers | {"delete_session"})
            host = os.environ.get("CONTEXTRENDER_HOST") or config.get_server_config().get("host") or "0.0.0.0"
            run_server = self.server.run_server

            def serve(*args: Any, **kwargs: Any) -> Any:
                # Load the models now, then move everything loaded so far out of the garbage
                # collector's full walks (it lives as long as the process): otherwise one of the
                # first requests pays for a walk of the whole start-up heap (about 1.6 s here).
                from contextrender import core

                core.warm_up()
                gc.collect()
                gc.freeze()
                return run_server(*args, **{**kwargs, "host": host})

            self.server.run_server = serve

        def _print_startup_banner(self, dev: bool, no_client: bool) -> None:
            """jac-scale prints a start-up banner and jaclang prints its own after it: one is enough."""

        def register_llm_telemetry_endpoints(self) -> None:
            """jac-scale's LLM telemetry is admin routes and a litellm callback that feeds them;
            registering it imports litellm (4-16 s of the start here). With the portal off its
            routes are not served, so it is left out."""
            if self.admin_password is not None:
                super().register_llm_telemetry_endpoints()

        def register_admin_endpoints(self) -> None:
            super().register_admin_endpoints()
            self.settle_admin_account()

        def settle_admin_account(self) -> None:
            """The admin account's password is CONTEXTRENDER_ADMIN_PASSWORD, set again at every
            start; with the portal off, an account an older start left with jac-scale's default
            password gets a random one (set the variable to use the account again)."""
            username = get_scale_config().get_admin_config().get("username", "admin")
            users = self.user_manager
            account = users.find_user_by_identity(username)
            if account is None:
                return
            user_id = account.get("user_id", "")
            if self.admin_password is not None:
                if users.authenticate(username, self.admin_password) is None:
                    users.reset_password_by_user_id(user_id, self.admin_password)
                    logger.warning("admin account %r: password set from CONTEXTRENDER_ADMIN_PASSWORD", username)
                users.set_requires_password_reset(user_id, False)
            elif users.authenticate(username, "changeme") is not None:
                users.reset_password_by_user_id(user_id, secrets.token_urlsafe(32))
                logger.warning("admin account %r had jac-scale's default password: replaced by a random one", username)

        def _register_endpoints(self) -> None:
            super()._register_endpoints()
            # Not served (RequestGuard answers these paths with a 404 that says why): jac-scale's
            # POST /walker/<name>/{nd} (a walker spawned on any node id, another user's included),
            # POST /function/<name> for the module's functions (`jobj` among them), the client-app
            # routes, and the admin routes while the portal is off.
            refused = tuple(REFUSED_PREFIXES) + (() if self.admin_password is not None else ("/admin",))
            self.server._endpoints[:] = [e for e in self.server._endpoints
                                         if not e.path.startswith(refused) and not e.path.endswith("/{nd}")]
            # The session inspector (docs/inspector.md): the page and its files at /contextrender/; its data
            # comes from POST /walker/<name> with the token of the user who logs in on it.
            from contextrender.inspector import routes as inspector

            for path, handler in inspector.server_routes():
                self.server.app.add_api_route(path, handler, methods=["GET"], include_in_schema=False)
            # GET /metrics (Prometheus; loopback clients unless configured): jac-scale's own, admin-only
            # one takes the path when its monitoring is on.
            if not get_scale_config().get_monitoring_config().get("enabled"):
                self.server.app.add_api_route("/metrics", self.metrics_route, methods=["GET"], include_in_schema=False)
            # Logout revokes the token (jac-scale has none; adapters/server/accounts.py).
            self.server.app.add_api_route("/user/logout", logout_route(self.user_manager), methods=["POST"], tags=["User APIs"])

        async def metrics_route(self, request: Request) -> Any:
            return metrics_response(self.metrics, request.client.host if request.client else None)

        def request_fields(self, walker: str, caller: str | None) -> set[str] | None:
            """The fields a request to `walker` may name (its `has` fields); None for no such walker,
            or one that needs a login the caller has not got (the walker answers 401)."""
            cls = self.get_walkers().get(walker)
            if cls is None or (caller is None and self.introspector.is_auth_required_for_walker(walker)):
                return None
            # `reports` is every walker's output, not something a request sets.
            return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.name != "reports"}

    return ContextRenderServer


