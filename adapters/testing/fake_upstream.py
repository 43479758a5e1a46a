"""A scripted server speaking OpenAI chat completions, OpenAI Responses and Anthropic Messages,
for tests and benchmarks (`loopback.py` serves it, or any ASGI app, on a free loopback port from a
background thread).

    with FakeUpstream() as upstream:          # http://127.0.0.1:<port>/v1
        upstream.enqueue(content="hello")     # next answer (default: a canned one), any protocol
        ...                                   # point a client or the proxy at upstream.base_url
        upstream.requests[-1].json            # what it received, headers included

Streaming answers (`"stream": true`) are cut into several SSE chunks; the exact bytes sent are kept
in `Recorded.sent`, so a test can compare them with what a client got through the proxy.

Like the real services, `/v1/messages` refuses (400, Anthropic's error shape) a request whose
`tool_use` blocks are not answered by `tool_result` blocks in the next turn, or whose thinking
blocks do not carry the signature it gave them; `/v1/responses` one whose function calls and
outputs do not pair up (`fake_checks.py`). Usage is reported with input tokens = request bytes / 4.

A scripted model can also restore what the proxy left out: `enqueue_restore()` answers, in the
protocol asked, with a call of the restore tool for the handle a restore hint in the request names
(the first a stub names, else the first of the fold index, or the one given), as a model that reads
its stubs and the index would; when the request does not offer the tool, or names no handle, it
answers with text that says so (a real model cannot call a tool it is not given).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from contextrender.testing.fake_checks import messages_problem, responses_problem, signature
from contextrender.testing.loopback import LoopbackServer, free_port

__all__ = ["FakeUpstream", "LoopbackServer", "Recorded", "free_port", "signature"]


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
    # Reasoning shown before the answer: an Anthropic thinking block, a Responses reasoning item.
    thinking: str | None = None
    # A restore call of the handle a hint in the request names ("" the first one; None: no restore).
    restore: str | None = None


# A restore hint as ContextRender writes it (engine/notices.jac restore_hint).
_HINT = re.compile(r'call contextrender_restore with handle "([^"]+)"')
# The fold index's heading where the tool is offered (engine/notices.jac FOLD_INDEX_HEADING); a line
# per tool follows it, "read_file results: r1 (src/a.py) r2", each handle a word of its own.
_INDEX_HEADING = "call contextrender_restore with a handle, or a query to find one."
_INDEX_ENTRY = re.compile(r"(?<!\S)([rp][0-9]+)(?!\S)")


def strings(value: Any) -> Iterator[str]:
    """Every string in a request's JSON (texts, a tool result's content or output), in order."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (dict, list)):
        for v in (value.values() if isinstance(value, dict) else value):
            yield from strings(v)


def named_handles(payload: dict) -> list[str]:
    """The handles a request names for the restore tool, in order (its tools' text aside): those of
    restore hints (stubs, notes of cut or compacted results) first, then the fold index's, each once."""
    texts = list(strings({k: v for (k, v) in payload.items() if k != "tools"}))
    index = [line.partition(" results:")[2] for text in texts
             for line in text.partition(_INDEX_HEADING)[2].splitlines() if " results:" in line]
    hinted = [h for text in texts for h in _HINT.findall(text)]
    return list(dict.fromkeys(hinted + [h for line in index for h in _INDEX_ENTRY.findall(line)]))


def offered_tools(payload: dict) -> list[str]:
    """The names of the tools a request offers, in any of the three protocols' shapes."""
    tools = payload.get("tools") if isinstance(payload.get("tools"), list) else []
    return [str(t.get("name") or (t.get("function") or {}).get("name") or "") for t in tools if isinstance(t, dict)]


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


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

    def enqueue(self, content: str | None = "Done.", tool_calls: list[dict] | None = None, status: int = 200,
                thinking: str | None = None) -> None:
        """The next answer: assistant text and/or tool calls (OpenAI shape, rendered in the
        protocol asked), reasoning before them, or an error status."""
        self._scripts.append(_Script(content, list(tool_calls or []), status, thinking))

    def enqueue_restore(self, handle: str = "", content: str | None = None, thinking: str | None = None) -> None:
        """The next answer: a call of the restore tool for `handle`, or for the first handle a
        restore hint in the request names (with `content` before it and reasoning)."""
        self._scripts.append(_Script(content, [], 200, thinking, restore=handle))

    def discard_enqueued(self) -> int:
        """Drop the answers enqueued and not yet asked for (a run that ended early leaves them for
        the next one); how many there were."""
        with self._lock:
            count = len(self._scripts)
            self._scripts.clear()
        return count

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
            return await self._conversation(
                request, lambda payload: "",
                lambda message, status: {"error": {"message": message, "type": "fake_error", "code": status}},
                self._completion,
                lambda number, script, answer, payload: self._chunks(
                    number, answer["model"], script, bool((payload.get("stream_options") or {}).get("include_usage"))
                ),
            )

        @app.post("/v1/messages")
        async def messages(request: Request) -> Response:
            return await self._conversation(
                request, messages_problem,
                lambda message, status: {"type": "error", "error": {"type": "invalid_request_error" if status == 400 else "api_error", "message": message}},
                self._message, lambda number, script, answer, payload: self._message_events(answer),
            )

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            return await self._conversation(
                request, responses_problem,
                lambda message, status: {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}},
                self._response, lambda number, script, answer, payload: self._response_events(answer),
            )

        @app.get("/_fake/last")
        async def last(path: str = "/v1/chat/completions") -> Response:
            # The body of the last request to `path`, for benchmarks that replay it directly.
            chats = [r for r in self.requests if r.path == path]
            return Response(chats[-1].body if chats else b"{}", media_type="application/json")

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def unknown(request: Request, path: str) -> Response:
            self.requests.append(Recorded(request.method, request.url.path, dict(request.headers), await request.body()))
            return JSONResponse({"error": {"message": f"no route {request.url.path}", "type": "invalid_request_error"}}, status_code=404)

        return app

    async def _conversation(self, request: Request, problem_of: Any, error_of: Any, answer_of: Any, events_of: Any) -> Response:
        """One conversation request: checked as the real service would (`problem_of`), answered
        with the next script in the protocol's shape, whole or as events."""
        start = time.perf_counter()
        body = await request.body()
        record = Recorded("POST", request.url.path, dict(request.headers), body)
        self.requests.append(record)
        payload = json.loads(body)
        problem = problem_of(payload)
        number, script = self._next() if not problem else (0, _Script(status=400))
        if script.restore is not None:
            script = self._restoring(number, script, payload)
        if script.status != 200:
            record.handling_s = time.perf_counter() - start
            return JSONResponse(error_of(problem or "scripted failure", script.status), status_code=script.status)
        answer = answer_of(number, script, payload, len(body))
        if payload.get("stream"):
            return self._stream(record, start, events_of(number, script, answer, payload), number)
        record.sent = json.dumps(answer).encode()
        record.handling_s = time.perf_counter() - start
        return Response(record.sent, media_type="application/json", headers={"x-fake-upstream": str(number)})

    @staticmethod
    def _restoring(number: int, script: _Script, payload: dict) -> _Script:
        named = named_handles(payload)
        handle = script.restore or (named[0] if named else "")
        if "contextrender_restore" not in offered_tools(payload) or not handle:
            why = "the restore tool is not offered" if handle else "no restore hint names a handle"
            return _Script(f"[fake model: cannot restore: {why}]", thinking=script.thinking)
        call = {"id": f"call_restore_{number}", "type": "function",
                "function": {"name": "contextrender_restore", "arguments": json.dumps({"handle": handle})}}
        return _Script(script.content, [call], thinking=script.thinking)

    def _completion(self, number: int, script: _Script, payload: dict, size: int) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": script.content, "refusal": None}
        if script.tool_calls:
            message["tool_calls"] = script.tool_calls
        return {
            "id": f"chatcmpl-fake-{number}", "object": "chat.completion", "created": 0, "model": payload.get("model", "fake-model"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if script.tool_calls else "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    def _message(self, number: int, script: _Script, payload: dict, size: int) -> dict:
        usage = {"input_tokens": size // 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 7}
        return {"id": f"msg_fake_{number}", "type": "message", "role": "assistant", "model": payload.get("model", "fake-model"),
                "content": self._blocks(script), "stop_reason": "tool_use" if script.tool_calls else "end_turn",
                "stop_sequence": None, "usage": usage}

    def _response(self, number: int, script: _Script, payload: dict, size: int) -> dict:
        return {
            "id": f"resp_fake_{number}", "object": "response", "created_at": 0, "status": "completed",
            "model": payload.get("model", "fake-model"), "output": self._items(number, script),
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": size // 4, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": size // 4 + 7},
        }

    def _stream(self, record: Recorded, start: float, chunks: list[bytes], number: int) -> StreamingResponse:
        record.sent = b"".join(chunks)
        record.handling_s = time.perf_counter() - start

        async def emit():
            for chunk in chunks:
                yield chunk

        return StreamingResponse(emit(), media_type="text/event-stream", headers={"x-fake-upstream": str(number)})

    def _pieces(self, text: str) -> list[str]:
        return [text[i : i + self._chunk_chars] for i in range(0, len(text), self._chunk_chars)]

    def _blocks(self, script: _Script) -> list[dict]:
        blocks: list[dict] = []
        if script.thinking is not None:
            blocks.append({"type": "thinking", "thinking": script.thinking, "signature": signature(script.thinking)})
        if script.content:
            blocks.append({"type": "text", "text": script.content})
        for call in script.tool_calls:
            blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                           "input": json.loads(call["function"].get("arguments") or "{}")})
        return blocks

    def _message_events(self, message: dict) -> list[bytes]:
        start = dict(message, content=[], stop_reason=None, usage=dict(message["usage"], output_tokens=1))
        events = [_sse("message_start", {"type": "message_start", "message": start}), _sse("ping", {"type": "ping"})]
        for (index, block) in enumerate(message["content"]):
            kind = block["type"]
            empty = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "tool_use": dict(block, input={})}[kind]
            events.append(_sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": empty}))
            if kind == "text":
                deltas = [{"type": "text_delta", "text": piece} for piece in self._pieces(block["text"])]
            elif kind == "thinking":
                deltas = [{"type": "thinking_delta", "thinking": piece} for piece in self._pieces(block["thinking"])]
                deltas.append({"type": "signature_delta", "signature": block["signature"]})
            else:
                deltas = [{"type": "input_json_delta", "partial_json": piece} for piece in self._pieces(json.dumps(block["input"]))]
            for delta in deltas:
                events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        events.append(_sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                             "usage": {"output_tokens": message["usage"]["output_tokens"]}}))
        events.append(_sse("message_stop", {"type": "message_stop"}))
        return events

    def _items(self, number: int, script: _Script) -> list[dict]:
        items: list[dict] = []
        if script.thinking is not None:
            items.append({"id": f"rs_fake_{number}", "type": "reasoning", "summary": [{"type": "summary_text", "text": script.thinking}],
                          "encrypted_content": signature(script.thinking)})
        if script.content:
            items.append({"id": f"msg_fake_{number}", "type": "message", "role": "assistant", "status": "completed",
                          "content": [{"type": "output_text", "text": script.content, "annotations": []}]})
        for call in script.tool_calls:
            items.append({"id": f"fc_{call['id']}", "type": "function_call", "status": "completed", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"].get("arguments") or "{}"})
        return items

    def _response_events(self, response: dict) -> list[bytes]:
        sequence = iter(range(10_000))
        pending = dict(response, status="in_progress", output=[], usage=None)
        events = [_sse("response.created", {"type": "response.created", "sequence_number": next(sequence), "response": pending})]
        for (index, item) in enumerate(response["output"]):
            events.append(_sse("response.output_item.added", {"type": "response.output_item.added", "sequence_number": next(sequence),
                                                              "output_index": index, "item": item}))
            if item["type"] == "message":
                for piece in self._pieces(item["content"][0]["text"]):
                    events.append(_sse("response.output_text.delta", {
                        "type": "response.output_text.delta", "sequence_number": next(sequence), "item_id": item["id"],
                        "output_index": index, "content_index": 0, "delta": piece, "logprobs": []}))
            events.append(_sse("response.output_item.done", {"type": "response.output_item.done", "sequence_number": next(sequence),
                                                             "output_index": index, "item": item}))
        events.append(_sse("response.completed", {"type": "response.completed", "sequence_number": next(sequence), "response": response}))
        return events

    def _chunks(self, number: int, model: str, script: _Script, usage: bool = False) -> list[bytes]:
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
        if usage:  # stream_options.include_usage: one more chunk, no choices
            chunk = {"id": f"chatcmpl-fake-{number}", "object": "chat.completion.chunk", "created": 0, "model": model,
                     "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
            frames.append(f"data: {json.dumps(chunk)}\n\n".encode())
        frames.append(b"data: [DONE]\n\n")
        return frames


def main() -> None:
    """`python -m contextrender.testing.fake_upstream --port 9000`: the fake server on its own."""
    import argparse

    parser = argparse.ArgumentParser(description="A scripted OpenAI-compatible server on loopback (canned answers).")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--tool", default=None, help="answer every request with a call of this tool")
    args = parser.parse_args()
    uvicorn.run(FakeUpstream(default_tool=args.tool).app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
