"""An in-test fake worker that records what the router sends it (headers and bodies)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.conftest import free_port

_METRICS = (
    b'vllm:num_requests_running{model_name="m",engine="0"} 0\n'
    b'vllm:num_requests_waiting{model_name="m",engine="0"} 0\n'
    b'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0\n'
    b'sglang:num_running_reqs{model_name="m"} 0\n'
    b'sglang:num_queue_reqs{model_name="m"} 0\n'
    b'sglang:token_usage{model_name="m"} 0\n'
)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float  # unix seconds


@dataclass
class RecordingWorker:
    """Answers like an engine: streams `tokens` chunks with usage, or one JSON body."""

    tokens: int = 3
    model: str = "m"  # what its /v1/models lists
    cached: int = 0  # the prompt tokens its usage reports cached
    received: list[Received] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=_METRICS, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [{"id": self.model, "object": "model"}]})  # fmt: skip

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        headers = {key.lower(): value for key, value in request.headers.items()}
        self.received.append(Received(request.path, headers, body, time.time()))
        n = self.tokens
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n,
                 "prompt_tokens_details": {"cached_tokens": self.cached}}  # fmt: skip
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-x", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "first"},
                             "finish_reason": "length"}],
                "usage": usage, "kv_transfer_params": None,
            })  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        frames = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]}]  # fmt: skip
        for i in range(self.tokens):
            reason = "length" if i == self.tokens - 1 else None
            frames.append({**head, "choices": [{"index": 0, "delta": {"content": f" t{i}"},
                                                "finish_reason": reason}]})  # fmt: skip
        if (body.get("stream_options") or {}).get("include_usage"):
            frames.append({**head, "choices": [], "usage": usage})
        for frame in frames:
            await response.write(b"data: " + json.dumps(frame).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response
