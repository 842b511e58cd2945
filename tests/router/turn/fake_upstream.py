"""An in-process fake vLLM worker, and an in-process router in front of such workers.

`FakeWorker` speaks the OpenAI-compatible API the way a vLLM server with the NixlConnector
does: /v1/completions and /v1/chat/completions (streamed or not, with `usage` and
`prompt_tokens_details.cached_tokens`), a prefill leg (`kv_transfer_params.do_remote_decode`)
answered with the `kv_transfer_params` a decode worker pulls with, /metrics with vLLM's metric
names, /health and /v1/models. It records every generation request it gets and can be scripted
to fail: answer a status, drop the connection, stall, cut a stream mid-way, or stream slowly
until the caller goes away (each one noted in `closed_early` when the caller hung up first).

`RouterUnderTest` is the router's app object (`router.app.Router`) behind its own HTTP server on
an ephemeral port, started in the test's event loop; `Stack` starts both for one test and stops
them afterwards. `RejectAll` is a scripted policy the router loads by its `module:attr` name.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import msgspec
from aiohttp import web

from policies.types import ClusterView, Decision, Outcome, Reject, Turn
from router.app import Router
from router.config import PolicyConfig, RouterConfig, WorkerSpec
from router.http import HttpServer

FaultKind = Literal["status", "drop", "stall", "cut", "slow", "linger"]
WAIT_S = 5.0  # the longest any test waits for something to happen


@dataclass
class Got:
    """One generation request a fake worker received."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def is_prefill_leg(self) -> bool:
        params = self.body.get("kv_transfer_params") or {}
        return params.get("do_remote_decode") is True


@dataclass
class Fault:
    kind: FaultKind
    status: int = 500
    after_frames: int = 2  # "cut": content frames sent before the connection is cut
    linger_s: float = 0.5  # "linger": how long the stream stays open after its [DONE]


@dataclass
class FakeWorker:
    """A fake vLLM worker; its answers' text names it (`" <name>0 <name>1 ..."`)."""

    name: str
    tokens: int = 3  # completion tokens per answer (at most max_tokens)
    prompt_tokens: int = 12
    cached: int = 0  # what its usage reports as cached prompt tokens
    model: str = "m"
    adapters: tuple[str, ...] = ()  # LoRA adapters it lists beside `model`
    delay_s: float = 0.0  # waits this long before answering a generation request
    spaced_json: bool = False  # stream frames as json.dumps writes them, not compact like vLLM
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    received: list[Got] = field(default_factory=list)
    scrapes: int = 0  # GET /metrics requests it answered
    closed_early: int = 0  # generation requests whose caller went away before the end
    sent_params: list[dict[str, Any]] = field(default_factory=list)  # prefill legs' answers
    port: int = 0
    _faults: deque[Fault] = field(default_factory=deque)
    _always: Fault | None = None
    _runner: web.AppRunner | None = None
    _closed: asyncio.Event = field(default_factory=asyncio.Event)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, kind: FaultKind, times: int = 1, **options: Any) -> None:
        """The next `times` generation requests fail as `kind` says."""
        self._faults.extend(Fault(kind, **options) for _ in range(times))

    def fail_always(self, kind: FaultKind, **options: Any) -> None:
        self._always = Fault(kind, **options)

    def bodies(self) -> list[dict[str, Any]]:
        return [got.body for got in self.received]

    async def wait_closed_early(self, within_s: float = WAIT_S) -> None:
        """Until a caller hung up on one of its answers (TimeoutError past `within_s`)."""
        async with asyncio.timeout(within_s):
            await self._closed.wait()

    async def wait_request(self, within_s: float = WAIT_S) -> None:
        """Until it has received a generation request."""
        async with asyncio.timeout(within_s):
            await self._arrived.wait()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        # a caller that hangs up cancels the handler: that is how `closed_early` is seen
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- endpoints
    async def _metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        labels = f'{{model_name="{self.model}",engine="0"}}'
        text = (
            f"# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {self.running}\n"
            f"# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {self.waiting}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} {self.kv_usage}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": 8192,
                 "root": self.model, "parent": None}  # fmt: skip
        adapters = [{"id": name, "object": "model", "owned_by": "vllm", "root": f"/lora/{name}",
                     "parent": self.model} for name in self.adapters]  # fmt: skip
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        got = Got(request.path, {k.lower(): v for k, v in request.headers.items()}, json.loads(raw))
        self.received.append(got)
        self._arrived.set()
        fault = self._faults.popleft() if self._faults else self._always
        finished = False
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        try:
            response = await self._answer(request, got, fault)
            finished = True
            return response
        finally:
            if not finished and (fault is None or fault.kind != "drop"):
                self.closed_early += 1
                self._closed.set()

    async def _answer(
        self, request: web.Request, got: Got, fault: Fault | None
    ) -> web.StreamResponse:
        if fault is not None and fault.kind == "status":
            error = {"error": {"message": "scripted failure", "type": "InternalServerError",
                               "param": None, "code": fault.status}}  # fmt: skip
            return web.json_response(error, status=fault.status)
        if fault is not None and fault.kind == "drop":
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(3600)  # cancelled as the connection goes
        if fault is not None and fault.kind == "stall":
            await asyncio.Event().wait()  # until the caller goes away
        body = got.body
        chat = got.path == "/v1/chat/completions"
        cap = body.get("max_completion_tokens") or body.get("max_tokens") or self.tokens
        count = min(self.tokens, int(cap))
        words = [f" {self.name}{i}" for i in range(count)]
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": count,
                 "total_tokens": self.prompt_tokens + count,
                 "prompt_tokens_details": {"cached_tokens": self.cached}}  # fmt: skip
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}"
        head = {"id": request_id, "created": 1700000000, "model": self.model}
        if not body.get("stream"):
            params = None
            if got.is_prefill_leg:
                params = self._transfer_params()
                self.sent_params.append(params)
            text = "".join(words)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "logprobs": None, "finish_reason": "length"}  # fmt: skip
                reply = {**head, "object": "chat.completion", "choices": [choice]}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                reply = {**head, "object": "text_completion", "choices": [choice]}
            return web.json_response({**reply, "usage": usage, "kv_transfer_params": params})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        frames: list[dict[str, Any]] = []
        if chat:
            frames.append({**head, "object": kind, "choices": [{
                "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}]})  # fmt: skip
        for i, word in enumerate(words):
            reason = "length" if i == count - 1 else None
            part = {"delta": {"content": word}} if chat else {"text": word}
            frames.append({**head, "object": kind, "choices": [
                {"index": 0, **part, "logprobs": None, "finish_reason": reason}]})  # fmt: skip
        if fault is not None and fault.kind == "cut":
            for frame in frames[: fault.after_frames + (1 if chat else 0)]:
                await response.write(self._sse(frame))
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(3600)  # cancelled as the connection goes
        if fault is not None and fault.kind == "slow":
            await response.write(self._sse(frames[0]))
            i = 0
            while True:  # until the caller goes away
                i += 1
                piece = {"delta": {"content": f" s{i}"}} if chat else {"text": f" s{i}"}
                await response.write(self._sse({**head, "object": kind, "choices": [
                    {"index": 0, **piece, "logprobs": None, "finish_reason": None}]}))  # fmt: skip
                await asyncio.sleep(0.01)
        if (body.get("stream_options") or {}).get("include_usage"):
            frames.append({**head, "object": kind, "choices": [], "usage": usage})
        for frame in frames:
            await response.write(self._sse(frame))
        await response.write(b"data: [DONE]\n\n")
        if fault is not None and fault.kind == "linger":
            await asyncio.sleep(fault.linger_s)
        await response.write_eof()
        return response

    def _sse(self, frame: dict[str, Any]) -> bytes:
        separators = (", ", ": ") if self.spaced_json else (",", ":")
        return b"data: " + json.dumps(frame, separators=separators).encode() + b"\n\n"

    def _transfer_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.name}",
            "remote_block_ids": [3, 4, 5],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_request_id": uuid.uuid4().hex,
            "tp_size": 1,
        }


@dataclass
class RouterUnderTest:
    """A router app on an ephemeral port in this event loop."""

    router: Router
    server: HttpServer
    admin_token: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    @classmethod
    async def start(
        cls,
        redis_url: str,
        workers: list[WorkerSpec],
        policy: str = "colocate",
        params: dict[str, Any] | None = None,
        **options: Any,
    ) -> RouterUnderTest:
        token = uuid.uuid4().hex
        options.setdefault("admin_token", token)
        options.setdefault("scrape_interval_ms", 100)
        options.setdefault("redis_prefix", f"turn-test-{uuid.uuid4().hex[:10]}")  # one each
        config = RouterConfig(
            workers=tuple(workers),
            policy=PolicyConfig(name=policy, params=params or {}),
            redis=redis_url,
            **options,
        )
        router = Router(config)
        await router.start()
        server = HttpServer(router.handle, max_body_bytes=config.max_body_bytes)
        try:
            await server.start("127.0.0.1", 0)
        except BaseException:
            await router.stop()
            raise
        return cls(router, server, options["admin_token"] or "")

    async def stop(self) -> None:
        await self.server.close(grace_s=2.0)
        await self.router.stop()

    async def metric(self, http: aiohttp.ClientSession, name: str, having: str = "") -> float:
        """The sum of a metric's samples on GET /metrics, over those whose line has `having`."""
        async with http.get(self.url + "/metrics") as response:
            assert response.status == 200
            text = await response.text()
        total = 0.0
        for line in text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and having in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    async def session(self, http: aiohttp.ClientSession, session_id: str) -> tuple[int, Any]:
        """GET /admin/sessions/{id}: (status, body)."""
        url = f"{self.url}/admin/sessions/{session_id}"
        async with http.get(url, headers=self.admin) as response:
            return response.status, await response.json()

    async def decisions(self, http: aiohttp.ClientSession, limit: int = 1) -> list[dict[str, Any]]:
        """The latest turns' stage events, newest first (GET /admin/decisions)."""
        url = f"{self.url}/admin/decisions?limit={limit}"
        async with http.get(url, headers=self.admin) as response:
            assert response.status == 200
            found: list[dict[str, Any]] = (await response.json())["decisions"]
        return found


class Stack:
    """Fake workers and routers for one test; stopped on exit, routers first."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.workers: list[FakeWorker] = []
        self.routers: list[RouterUnderTest] = []
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2 * WAIT_S))

    async def __aenter__(self) -> Stack:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            for router in self.routers:
                await router.stop()
            for worker in self.workers:
                await worker.stop()
        finally:
            await self.http.close()

    async def worker(self, name: str, **options: Any) -> FakeWorker:
        worker = FakeWorker(name, **options)
        self.workers.append(worker)
        await worker.start()
        return worker

    async def router(
        self, workers: list[WorkerSpec], policy: str = "colocate", **options: Any
    ) -> RouterUnderTest:
        router = await RouterUnderTest.start(self.redis_url, workers, policy, **options)
        self.routers.append(router)
        return router


def spec(worker: FakeWorker, role: str = "mixed", **options: Any) -> WorkerSpec:
    """The router's entry for `worker`: its name is its worker id."""
    return msgspec.convert({"url": worker.url, "role": role, "id": worker.name, **options},
                           WorkerSpec)  # fmt: skip


async def eventually(probe: Callable[[], Awaitable[bool]], within_s: float = WAIT_S) -> None:
    """Poll `probe` until it answers true; fails past `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        if await probe():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{probe.__name__} still false after {within_s} s")
        await asyncio.sleep(0.01)


# -- scripted policies, loaded by the router as `tests.router.turn.fake_upstream:NAME` -------


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class RejectAll:
    """Every turn is rejected, with a retry hint of 3 s."""

    Params = NoParams
    name = "reject-all"

    def __init__(self, params: NoParams | None = None) -> None:
        pass

    def decide(self, turn: Turn, view: ClusterView) -> Decision:
        return Reject(retry_after_s=3.0, reason="scripted overload")

    def observe(self, outcome: Outcome) -> None:
        return None
