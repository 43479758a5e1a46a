"""A scripted OpenAI-compatible server for tests and benchmarks, and a helper that serves any ASGI
app on a free loopback port from a background thread.

    with FakeUpstream() as upstream:          # http://127.0.0.1:<port>/v1
        upstream.enqueue(content="hello")     # next answer (default: a canned one)
        ...                                   # point a client or the proxy at upstream.base_url
        upstream.requests[-1].json            # what it received, headers included

Streaming answers (`"stream": true`) are cut into several SSE chunks; the exact bytes sent are kept
in `Recorded.sent`, so a test can compare them with what a client got through the proxy.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

__all__ = ["FakeUpstream", "LoopbackServer", "Recorded", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """Serves an ASGI app with uvicorn on 127.0.0.1 in a daemon thread (a context manager)."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the loopback server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@dataclass
class Recorded:
    """One request the fake upstream received, and what it answered."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    sent: bytes = b""
    handling_s: float = 0.0

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class _Script:
    content: str | None = "Done."
    tool_calls: list[dict] = field(default_factory=list)
    status: int = 200


class FakeUpstream:
    """An OpenAI chat-completions server on loopback that records every request."""

    MODELS = {"object": "list", "data": [{"id": "fake-model", "object": "model", "created": 0, "owned_by": "contextrender"}]}

    def __init__(self, chunk_chars: int = 4, default_tool: str | None = None) -> None:
        """`default_tool`: when nothing is enqueued, answer with one call of this tool (a fresh call
        id each time, as an agent loop needs) instead of the text "Done."."""
        self.requests: list[Recorded] = []
        self._default_tool = default_tool
        self._scripts: deque[_Script] = deque()
        self._chunk_chars = chunk_chars
        self._counter = 0
        self._lock = threading.Lock()
        self.app = self._build()
        self._server: LoopbackServer | None = None

    # -- scripting

    def enqueue(self, content: str | None = "Done.", tool_calls: list[dict] | None = None, status: int = 200) -> None:
        """The next answer: assistant text and/or tool calls (OpenAI shape), or an error status."""
        self._scripts.append(_Script(content, list(tool_calls or []), status))

    @property
    def base_url(self) -> str:
        assert self._server, "start the fake upstream first (use it as a context manager)"
        return f"{self._server.url}/v1"

    def __enter__(self) -> FakeUpstream:
        self._server = LoopbackServer(self.app).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server:
            self._server.__exit__(*exc)

    # -- the server

    def _next(self) -> tuple[int, _Script]:
        with self._lock:
            self._counter += 1
            if self._scripts:
                return self._counter, self._scripts.popleft()
            if self._default_tool:
                arguments = json.dumps({"path": f"src/module_{self._counter}.py"})
                call = {"id": f"call_fake_{self._counter}", "type": "function", "function": {"name": self._default_tool, "arguments": arguments}}
                return self._counter, _Script(content=None, tool_calls=[call])
            return self._counter, _Script()

    def _build(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.api_route("/v1/models", methods=["GET", "HEAD"])
        async def models(request: Request) -> Response:
            self.requests.append(Recorded(request.method, request.url.path, dict(request.headers), b""))
            return JSONResponse(self.MODELS, headers={"x-fake-upstream": "models"})

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            start = time.perf_counter()
            body = await request.body()
            record = Recorded("POST", request.url.path, dict(request.headers), body)
            self.requests.append(record)
            number, script = self._next()
            payload = json.loads(body)
            model = payload.get("model", "fake-model")
            if script.status != 200:
                record.handling_s = time.perf_counter() - start
                error = {"error": {"message": "scripted failure", "type": "fake_error", "code": script.status}}
                return JSONResponse(error, status_code=script.status)
            if payload.get("stream"):
                chunks = self._chunks(number, model, script)
                record.sent = b"".join(chunks)
                record.handling_s = time.perf_counter() - start

                async def emit():
                    for chunk in chunks:
                        yield chunk

                return StreamingResponse(emit(), media_type="text/event-stream", headers={"x-fake-upstream": str(number)})
            message: dict[str, Any] = {"role": "assistant", "content": script.content, "refusal": None}
            if script.tool_calls:
                message["tool_calls"] = script.tool_calls
            answer = {
                "id": f"chatcmpl-fake-{number}", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if script.tool_calls else "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            record.sent = json.dumps(answer).encode()
            record.handling_s = time.perf_counter() - start
            return Response(record.sent, media_type="application/json", headers={"x-fake-upstream": str(number)})

        @app.get("/_fake/last")
        async def last() -> Response:
            # The body of the last chat request, for benchmarks that replay it directly.
            chats = [r for r in self.requests if r.path == "/v1/chat/completions"]
            return Response(chats[-1].body if chats else b"{}", media_type="application/json")

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def unknown(request: Request, path: str) -> Response:
            self.requests.append(Recorded(request.method, request.url.path, dict(request.headers), await request.body()))
            return JSONResponse({"error": {"message": f"no route {request.url.path}", "type": "invalid_request_error"}}, status_code=404)

        return app

    def _chunks(self, number: int, model: str, script: _Script) -> list[bytes]:
        def frame(delta: dict, finish: str | None = None) -> bytes:
            chunk = {
                "id": f"chatcmpl-fake-{number}", "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return f"data: {json.dumps(chunk)}\n\n".encode()

        frames = [frame({"role": "assistant", "content": ""})]
        text = script.content or ""
        for i in range(0, len(text), self._chunk_chars):
            frames.append(frame({"content": text[i : i + self._chunk_chars]}))
        for index, call in enumerate(script.tool_calls):
            function = call["function"]
            frames.append(frame({"tool_calls": [{
                "index": index, "id": call["id"], "type": "function",
                "function": {"name": function["name"], "arguments": ""},
            }]}))
            arguments = function.get("arguments", "")
            for i in range(0, len(arguments), self._chunk_chars):
                frames.append(frame({"tool_calls": [{"index": index, "function": {"arguments": arguments[i : i + self._chunk_chars]}}]}))
        frames.append(frame({}, "tool_calls" if script.tool_calls else "stop"))
        frames.append(b"data: [DONE]\n\n")
        return frames


def main() -> None:
    """`python -m contextrender_adapters.fakeupstream --port 9000`: the fake server on its own."""
    import argparse

    parser = argparse.ArgumentParser(description="A scripted OpenAI-compatible server on loopback (canned answers).")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--tool", default=None, help="answer every request with a call of this tool")
    args = parser.parse_args()
    uvicorn.run(FakeUpstream(default_tool=args.tool).app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
