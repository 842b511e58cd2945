"""The rest of the API in process: pass-through endpoints, /version, /v1/responses with session
affinity, trace headers on every leg, the configurable session header, DELETE /v1/sessions."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from router.api import PASS_THROUGH
from router.config import ConfigError, add_serve_options, load_config
from router.turn.fields import trace_headers
from tests.router.turn.fake_upstream import (
    FakeWorker,
    Got,
    RouterUnderTest,
    Stack,
    eventually,
    spec,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass
class ApiWorker(FakeWorker):
    """A fake worker that also serves the rest of vLLM's API."""

    responses_made: int = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_post("/v1/responses", self._responses)
        for path in PASS_THROUGH:
            app.router.add_post(path, self._other)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def _note(self, request: web.Request, body: dict[str, Any]) -> None:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.received.append(Got(request.path_qs, headers, body))

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"0.9-{self.name}"})

    async def _other(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self._note(request, body)
        return web.json_response({"worker": self.name, "path": request.path}, status=200)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self._note(request, body)
        self.responses_made += 1
        response_id = f"resp_{self.name}{self.responses_made}"
        usage = {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}
        done = {"id": response_id, "object": "response", "status": "completed", "usage": usage}
        if not body.get("stream"):
            return web.json_response(done)
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        created = {"type": "response.created", "response": {**done, "usage": None}}
        for event in (created, {"type": "response.completed", "response": done}):
            await stream.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        await stream.write_eof()
        return stream


@pytest.fixture
async def stack(redis_url: str) -> AsyncIterator[Stack]:
    async with Stack(redis_url) as stack:
        yield stack


async def api_worker(stack: Stack, name: str, **options: Any) -> ApiWorker:
    worker = ApiWorker(name, **options)
    stack.workers.append(worker)
    await worker.start()
    return worker


async def sees_load(router: RouterUnderTest, worker_id: str, running: int) -> None:
    async def probe() -> bool:
        load = router.router.pool.workers[worker_id].load
        return load is not None and load.running == running

    await eventually(probe)


async def call(
    stack: Stack, router: RouterUnderTest, path: str, body: Any = None, method: str = "POST",
    headers: dict[str, str] | None = None, raw: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    sent = {"Content-Type": "application/json", **(headers or {})}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    async with stack.http.request(method, router.url + path, data=data, headers=sent) as response:
        got = {key.lower(): value for key, value in response.headers.items()}
        return response.status, got, await response.read()


async def test_pass_through_goes_to_the_least_loaded_worker_with_trace_headers(
    stack: Stack,
) -> None:
    busy = await api_worker(stack, "busy", running=9)
    idle = await api_worker(stack, "idle")
    router = await stack.router([spec(busy), spec(idle)])
    await sees_load(router, "busy", 9)
    trace = {"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"}
    for path in PASS_THROUGH:
        status, _, body = await call(stack, router, path, {"model": "m", "input": "x"},
                                     headers=trace)  # fmt: skip
        assert status == 200, body
        assert json.loads(body) == {"worker": "idle", "path": path}
    assert not busy.received
    assert [got.path for got in idle.received] == list(PASS_THROUGH)
    for got in idle.received:
        assert got.headers["traceparent"] == TRACEPARENT
        assert got.headers["tracestate"] == "congo=t61rcWkgMzE"


async def test_pass_through_validates_like_the_completions_endpoints(stack: Stack) -> None:
    worker = await api_worker(stack, "a")
    router = await stack.router([spec(worker)], api_key="sekret")
    key = {"Authorization": "Bearer sekret"}
    status, _, _ = await call(stack, router, "/v1/embeddings", {"model": "m", "input": "x"})
    assert status == 401
    status, _, body = await call(stack, router, "/v1/embeddings", {"input": "x"}, headers=key)
    assert status == 400 and json.loads(body)["error"]["param"] == "model"
    status, _, body = await call(stack, router, "/tokenize", {"model": 3}, headers=key)
    assert status == 400 and json.loads(body)["error"]["param"] == "model"
    status, _, _ = await call(stack, router, "/rerank", [1, 2], headers=key)
    assert status == 400
    status, _, _ = await call(stack, router, "/score", raw=b"{nope", headers=key)
    assert status == 400
    status, _, _ = await call(stack, router, "/v1/embeddings", {"model": "m"},
                              headers={**key, "Content-Type": "text/plain"})  # fmt: skip
    assert status == 415
    status, _, body = await call(stack, router, "/v1/embeddings", {"model": "nope", "input": "x"},
                                 headers=key)  # fmt: skip
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    status, _, _ = await call(stack, router, "/v1/embeddings", method="GET", headers=key)
    assert status == 405
    status, _, body = await call(stack, router, "/v1/nothing", {"model": "m"}, headers=key)
    assert status == 404 and "error" in json.loads(body)
    status, _, body = await call(stack, router, "/tokenize", {"prompt": "x"}, headers=key)
    assert status == 200 and json.loads(body)["worker"] == "a"
    assert not any(got.path == "/v1/embeddings" for got in worker.received)


async def test_version_answers_the_router_and_each_worker(stack: Stack) -> None:
    a = await api_worker(stack, "a")
    plain = await stack.worker("plain")  # serves no /version
    router = await stack.router([spec(a), spec(plain)])
    status, _, body = await call(stack, router, "/version", method="GET")
    assert status == 200
    answer = json.loads(body)
    assert isinstance(answer["version"], str) and answer["version"] == answer["router"]
    assert answer["workers"] == {"a": "0.9-a", "plain": None}


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_follow_their_previous_response(stack: Stack, stream: bool) -> None:
    a = await api_worker(stack, "a")
    b = await api_worker(stack, "b", running=5)
    router = await stack.router([spec(a), spec(b)])
    await sees_load(router, "b", 5)
    request = {"model": "m", "input": "hello", "stream": stream}
    status, headers, body = await call(stack, router, "/v1/responses", request)
    assert status == 200 and len(a.received) == 1
    if stream:
        assert headers["content-type"].startswith("text/event-stream")
        assert b"event: response.completed" in body
    first_id = "resp_a1"
    assert first_id.encode() in body

    async def committed() -> bool:
        status, record = await router.session(stack.http, first_id)
        return status == 200 and record["worker_id"] == "a"

    await eventually(committed)
    a.running, b.running = 9, 0  # now `a` is the busier one: affinity still keeps the chain
    await sees_load(router, "a", 9)
    await sees_load(router, "b", 0)
    follow = {**request, "previous_response_id": first_id}
    status, headers, _ = await call(stack, router, "/v1/responses", follow)
    assert status == 200 and headers["x-session-id"] == first_id
    assert [got.body.get("previous_response_id") for got in a.received] == [None, first_id]
    assert not b.received
    # a new conversation goes to the least loaded worker
    status, _, _ = await call(stack, router, "/v1/responses", {"model": "m", "input": "other"})
    assert status == 200 and len(b.received) == 1


async def test_trace_headers_reach_every_turn_leg_and_malformed_ones_do_not(
    stack: Stack,
) -> None:
    worker = await stack.worker("a")
    router = await stack.router([spec(worker)])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    state = "rojo=00f067aa0ba902b7"
    trace = {"traceparent": TRACEPARENT, "tracestate": state}
    status, _, _ = await call(stack, router, "/v1/chat/completions", chat, headers=trace)
    assert status == 200
    bad = "00-00000000000000000000000000000000-00f067aa0ba902b7-01"
    status, _, _ = await call(stack, router, "/v1/chat/completions", chat,
                              headers={"traceparent": bad, "tracestate": state})  # fmt: skip
    assert status == 200
    first, second = worker.received
    assert first.headers["traceparent"] == TRACEPARENT and first.headers["tracestate"] == state
    assert "traceparent" not in second.headers and "tracestate" not in second.headers


def test_trace_header_validation() -> None:
    assert trace_headers(TRACEPARENT, None) == {"traceparent": TRACEPARENT}
    for bad in (
        TRACEPARENT.upper(),
        "ff" + TRACEPARENT[2:],
        TRACEPARENT[:-1],
        TRACEPARENT + "-extra",  # version 00 has exactly four fields
        f"{TRACEPARENT}, {TRACEPARENT}",  # sent twice
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    ):
        assert trace_headers(bad, "a=b") == {}, bad
    future = "01" + TRACEPARENT[2:] + "-later"
    assert trace_headers(future, "a=b") == {"traceparent": future, "tracestate": "a=b"}
    assert trace_headers(TRACEPARENT, "x" * 600) == {"traceparent": TRACEPARENT}


async def test_configured_session_header_names_the_session(stack: Stack) -> None:
    worker = await stack.worker("a")
    router = await stack.router([spec(worker)], session_header="X-Conversation")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, headers, _ = await call(stack, router, "/v1/chat/completions", chat,
                                    headers={"X-Conversation": "conv-1"})  # fmt: skip
    assert status == 200 and headers["x-session-id"] == "conv-1"
    status, headers, _ = await call(stack, router, "/v1/chat/completions", chat,
                                    headers={"X-Session-Id": "ignored"})  # fmt: skip
    assert status == 200 and headers["x-session-id"].startswith("fp:")
    status, _, body = await call(stack, router, "/v1/chat/completions", chat,
                                 headers={"X-Conversation": "bad\tid"})  # fmt: skip
    assert status == 400 and json.loads(body)["error"]["param"] == "X-Conversation"


def test_session_header_option() -> None:
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    args = parser.parse_args(["--mixed", "http://w:1", "--session-header", "X-Conv"])
    assert load_config(args, {}).session_header == "X-Conv"
    assert load_config(parser.parse_args(["--mixed", "http://w:1"]), {}).session_header == (
        "X-Session-Id"
    )
    with pytest.raises(ConfigError):
        load_config(parser.parse_args(["--mixed", "http://w:1", "--session-header", "a b"]), {})


async def test_delete_session_ends_its_residency(stack: Stack) -> None:
    worker = await stack.worker("a")
    router = await stack.router([spec(worker)], api_key="sekret")
    key = {"Authorization": "Bearer sekret"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, _ = await call(stack, router, "/v1/chat/completions", chat,
                              headers={**key, "X-Session-Id": "s-del"})  # fmt: skip
    assert status == 200

    async def resident() -> bool:
        return (await router.session(stack.http, "s-del"))[0] == 200

    await eventually(resident)
    status, _, _ = await call(stack, router, "/v1/sessions/s-del", method="DELETE")
    assert status == 401
    status, _, body = await call(stack, router, "/v1/sessions/s-del", method="DELETE",
                                 headers=key)  # fmt: skip
    assert status == 204 and body == b""
    assert (await router.session(stack.http, "s-del"))[0] == 404
    assert router.router.state is not None
    assert await router.router.state.load_session("s-del") is None  # Redis too
    status, _, body = await call(stack, router, "/v1/sessions/s-del", method="DELETE",
                                 headers=key)  # fmt: skip
    assert status == 404 and "error" in json.loads(body)
    status, _, _ = await call(stack, router, "/v1/sessions/never", method="DELETE", headers=key)
    assert status == 404
    status, _, _ = await call(stack, router, "/v1/sessions/s-del", method="GET", headers=key)
    assert status == 405
