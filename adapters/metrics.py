"""Prometheus metrics of the server and the proxy: `GET /metrics` in Prometheus' text format
(prometheus_client), one registry per app (docs/server-and-security.md, docs/proxy-and-protocols.md).

Both count requests by endpoint and status (`contextrender_requests_total`) and time them
(`contextrender_request_seconds`): on the server the endpoint is the walker's name (`render_context`:
the render histogram), `/user/<action>`, or `other`; on the proxy it is the protocol's path, with
the protocol (`chat`, `messages`, `responses`), or `passthrough`, `inspector`, `metrics`. The
proxy also records its renders (`contextrender_proxy_render_seconds`), the time a managed request
spends in the proxy before it is forwarded (`contextrender_proxy_time_in_proxy_seconds`), the
history tokens before and after the render (`contextrender_proxy_history_tokens_before_total`,
`_after_total`), the share of a rendered history's messages that repeat the session's previous
forwarded history as a prefix (`contextrender_proxy_cached_prefix_share`: what a provider's
prompt cache can reuse), the restore calls it answered (`contextrender_proxy_restores_total` by
outcome) and the requests it forwarded unmanaged (`contextrender_proxy_unmanaged_total` by reason).

`/metrics` answers loopback clients only (as the proxy's inspector), unless
CONTEXTRENDER_METRICS_CLIENTS=any (a scraper on another machine; the figures hold no message text).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from contextrender.limits import is_loopback

__all__ = ["CountRequests", "ProxyMetrics", "ServerMetrics", "metrics_response", "metrics_problem"]

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
SHARES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("contextrender_requests", "Requests answered, by endpoint, protocol and status",
                                ["endpoint", "protocol", "status"], registry=self.registry)
        self.request_seconds = Histogram("contextrender_request_seconds", "Time from a request's arrival to the start of its answer",
                                         ["endpoint", "protocol"], buckets=SECONDS, registry=self.registry)
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def of(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, kept. prometheus_client's `labels` checks and converts the
        values and takes the metric's lock at every call (7 calls a proxied request: 7.4 us of its
        15 us of metrics); for the same values it always returns the same child, which is kept
        here by metric and values (as many entries as prometheus_client keeps children). What
        would make a kept child stale is the child removed from its metric (`remove`, `clear`):
        nothing does."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child


class ServerMetrics(_Metrics):
    """The server's: requests and their time, by endpoint (the walker's name)."""

    def __init__(self, walkers: Callable[[], Any]) -> None:
        super().__init__()
        self.walkers = walkers

    def endpoint(self, path: str) -> tuple[str, str]:
        if path.startswith("/walker/"):
            name = path.removeprefix("/walker/")
            return (name if name in self.walkers() else "unknown_walker"), ""
        if path.startswith("/user/") and path.count("/") == 2:
            return path, ""
        if path == "/metrics":
            return "metrics", ""
        return "other", ""


class ProxyMetrics(_Metrics):
    """The proxy's: requests, renders, time in the proxy, tokens, prefix share, restores, unmanaged."""

    def __init__(self, protocols: dict[str, str]) -> None:
        super().__init__()
        self.protocols = protocols  # path -> protocol name
        r = self.registry
        self.render_seconds = Histogram("contextrender_proxy_render_seconds", "The backend's render of one request's history",
                                        ["protocol"], buckets=SECONDS, registry=r)
        self.in_proxy_seconds = Histogram("contextrender_proxy_time_in_proxy_seconds",
                                          "Time a managed request spent in the proxy before it was forwarded upstream",
                                          ["protocol"], buckets=SECONDS, registry=r)
        self.tokens_before = Counter("contextrender_proxy_history_tokens_before", "History tokens of the requests as the agent sent them",
                                     ["protocol"], registry=r)
        self.tokens_after = Counter("contextrender_proxy_history_tokens_after", "History tokens of the requests as forwarded (rendered)",
                                    ["protocol"], registry=r)
        self.prefix_share = Histogram("contextrender_proxy_cached_prefix_share",
                                      "Share of a rendered history's messages that repeat the session's previous forwarded history as a prefix",
                                      ["protocol"], buckets=SHARES, registry=r)
        self.restores = Counter("contextrender_proxy_restores", "Restore calls the proxy answered, by outcome",
                                ["outcome"], registry=r)
        self.unmanaged = Counter("contextrender_proxy_unmanaged", "Conversation requests forwarded without a render, by reason",
                                 ["protocol", "reason"], registry=r)

    def endpoint(self, path: str) -> tuple[str, str]:
        if path in self.protocols:
            return path, self.protocols[path]
        if path == "/metrics":
            return "metrics", ""
        if path == "/contextrender" or path.startswith("/contextrender/"):
            return "inspector", ""
        return "passthrough", ""

    def rendered(self, protocol: str, before: int, after: int, seconds: float) -> None:
        self.of(self.render_seconds, protocol).observe(seconds)
        self.of(self.tokens_before, protocol).inc(max(before, 0))
        self.of(self.tokens_after, protocol).inc(max(after, 0))

    def prefix(self, protocol: str, previous: list | None, rendered: list) -> None:
        """Record the share of `rendered` repeating `previous` (the session's last) as a prefix."""
        if previous is None or not rendered:
            return
        shared = 0
        for (old, new) in zip(previous, rendered):
            if old != new:
                break
            shared += 1
        self.of(self.prefix_share, protocol).observe(shared / len(rendered))


class CountRequests:
    """ASGI middleware: every HTTP request counted by endpoint, protocol and status, and timed to
    the start of its answer."""

    def __init__(self, app: Any, metrics: _Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        (endpoint, protocol) = self.metrics.endpoint(scope["path"])
        started = time.perf_counter()
        status = {"code": 0}

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start" and not status["code"]:
                status["code"] = message["status"]
                self.metrics.of(self.metrics.request_seconds, endpoint, protocol).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.metrics.of(self.metrics.requests, endpoint, protocol, str(status["code"] or 500)).inc()


def _loopback(host: str) -> bool:
    # Starlette's test client names itself "testclient".
    return is_loopback(host) or host == "testclient"


def metrics_problem(client_host: str | None) -> str:
    """Why `/metrics` is refused to this client ("" when it is not)."""
    setting = os.environ.get("CONTEXTRENDER_METRICS_CLIENTS", "loopback").strip().lower()
    if setting == "any" or _loopback(client_host or ""):
        return ""
    return (f"/metrics answers loopback clients only (this client is {client_host or 'unknown'}); "
            "set CONTEXTRENDER_METRICS_CLIENTS=any to let a scraper on another machine read it")


def metrics_response(metrics: _Metrics, client_host: str | None) -> Any:
    """The answer to `GET /metrics`: the registry in Prometheus' text format, or 403."""
    from starlette.responses import JSONResponse, Response

    problem = metrics_problem(client_host)
    if problem:
        return JSONResponse({"ok": False, "type": "error", "data": None, "error": {"code": "FORBIDDEN", "message": problem}},
                            status_code=403)
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
