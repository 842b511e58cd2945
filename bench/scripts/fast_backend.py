"""A deliberately fast vLLM-shaped backend for measuring proxy overhead (not a simulator).

Answers /v1/completions and /v1/chat/completions at once with a canned body (with usage), or
streams `--chunks` frames, back to back or `pace_ms` apart when the body says so; serves
/health, /v1/models and vLLM load gauges.

    python -m bench.scripts.fast_backend --port 9100 --chunks 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvloop
from aiohttp import web

_USAGE = {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24,
          "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
_BODY = json.dumps({
    "id": "cmpl-fast", "object": "text_completion", "created": 0, "model": "fast",
    "choices": [{"index": 0, "text": " ok" * 16, "logprobs": None, "finish_reason": "length"}],
    "usage": _USAGE,
}).encode()  # fmt: skip
_CHUNK = (
    b'data: {"id":"cmpl-fast","object":"text_completion","created":0,"model":"fast",'
    b'"choices":[{"index":0,"text":" ok","logprobs":null,"finish_reason":null}]}\n\n'
)
_USAGE_CHUNK = (
    b'data: {"id":"cmpl-fast","object":"text_completion","created":0,'
    b'"model":"fast","choices":[],"usage":' + json.dumps(_USAGE).encode() + b"}\n\n"
)
_METRICS = (
    b'vllm:num_requests_running{model_name="fast",engine="0"} 0.0\n'
    b'vllm:num_requests_waiting{model_name="fast",engine="0"} 0.0\n'
    b'vllm:kv_cache_usage_perc{model_name="fast",engine="0"} 0.0\n'
)  # fmt: skip


def _busy(seconds: float) -> None:
    """Spend `seconds` of CPU, as a real API server does on each request (see --work-us)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def _pace_s(body: bytes) -> float:
    """A stream's gap between frames: the body's `pace_ms` (as a decoding engine's step would
    space its tokens), else none (frames back to back)."""
    if b'"pace_ms"' not in body:
        return 0.0
    return max(0.0, float(json.loads(body).get("pace_ms") or 0.0)) / 1000


def build_app(chunks: int, work_us: float = 0.0) -> web.Application:
    work_s = work_us / 1e6

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if work_s > 0:
            _busy(work_s)
        if b'"stream":true' not in body.replace(b" ", b""):
            return web.Response(body=_BODY, content_type="application/json")
        pace_s = _pace_s(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(chunks):
            if pace_s and index:
                await asyncio.sleep(pace_s)
            await response.write(_CHUNK)
        await response.write(_USAGE_CHUNK + b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fast", "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=_METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument(
        "--work-us", type=float, default=0.0,
        help="CPU spent per generation request: a real server tokenises, schedules and "
        "detokenises; 0 makes the backend unrealistically cheap beside any proxy",
    )  # fmt: skip
    args = parser.parse_args()
    uvloop.install()
    app = build_app(args.chunks, args.work_us)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
