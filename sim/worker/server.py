"""A simulated vLLM worker behind HTTP: vLLM's OpenAI surface, NIXL-style P/D fields, metrics."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web

from sim.engine.engine import Engine, EngineConfig, EngineRequest, RequestStats, StepOutput
from sim.fabric.kv_pull import KvPuller, PullResult, remote_block_ids
from sim.worker.ingest import ingest
from sim.worker.protocol import (
    DONE,
    Kind,
    OpenAIError,
    ParsedRequest,
    ResponseFramer,
    error_body,
    usage_dict,
)
from sim.worker.realtime import EngineRunner, FabricRunner, ScheduleClock
from sim.worker.tokenizer import WordGenerator
from sim.worker.vllm_metrics import CONTENT_TYPE, WorkerMetrics

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# The vLLM whose wire the worker speaks: "0.32" as observed (the default); "legacy" as this
# simulator spoke before: a priority without priority scheduling refused (400), the prefill
# reply's `remote_block_ids` one flat list and no more than the handoff needs, and a decode
# answer's `cached_tokens` counting the pulled KV.
VLLM_VERSIONS = ("0.32", "legacy")
VllmVersion = Literal["0.32", "legacy"]


@dataclass(frozen=True)
class WorkerOptions:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8101
    served_model_name: str | None = None
    nic_gbps: float = 400.0
    nic_latency_s: float = 5e-6
    held_timeout_s: float = 480.0
    vllm_version: VllmVersion = "0.32"

    def __post_init__(self) -> None:
        if self.vllm_version not in VLLM_VERSIONS:
            raise ValueError(f"vllm_version must be one of {VLLM_VERSIONS}, got "
                             f"{self.vllm_version!r}")  # fmt: skip

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.deployment.model.name


class _RequestStream:
    __slots__ = ("event", "finished", "last_token_at", "outputs")

    def __init__(self) -> None:
        self.outputs: list[StepOutput] = []
        self.event = asyncio.Event()
        self.last_token_at: float | None = None
        self.finished = False


class SimWorker:
    """One simulated GPU worker: engine, real-time driver, HTTP server, side channel."""

    def __init__(self, options: WorkerOptions, fabric: FabricRunner) -> None:
        self.options = options
        self.engine_id = f"sim-{options.port}-{uuid.uuid4().hex[:8]}"
        self.clock = ScheduleClock()
        self.engine = Engine(options.engine, self.clock, engine_id=self.engine_id)
        self.engine.held_timeout_s = options.held_timeout_s
        self.metrics = WorkerMetrics(self.engine, options.model_name)
        self.runner = EngineRunner(self.engine, self.clock, self._on_outputs)
        self.fabric = fabric
        rate = options.nic_gbps * 1e9 / 8
        if not fabric.fabric.has_nic(self.engine_id):
            fabric.fabric.add_nic(self.engine_id, rate, rate, options.nic_latency_s)
        self._words = WordGenerator(options.engine.seed)
        self._streams: dict[str, _RequestStream] = {}
        self._ids = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._puller: KvPuller | None = None
        self._site_runner: web.AppRunner | None = None
        self.app = self._build_app()

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.options.port}"

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kv/held/{request_id}", self._held)
        app.router.add_post("/kv/release/{request_id}", self._release)
        app.router.add_get("/sim/schedule-lag", self._schedule_lag)
        return app

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(connector=connector)
        deployment = self.options.engine.deployment
        self._puller = KvPuller(
            self._session, self.fabric, self.engine_id, deployment.kv_bytes_per_token,
            self.engine.blocks.block_size, deployment.model.layers,
        )  # fmt: skip
        self.runner.start()
        self._site_runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._site_runner.setup()
        site = web.TCPSite(self._site_runner, self.options.host, self.options.port)
        await site.start()

    async def stop(self) -> None:
        if self._site_runner is not None:
            await self._site_runner.cleanup()
            self._site_runner = None
        await self.runner.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- engine outputs -------------------------------------------------------------------
    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        now = self.clock.now()
        itl = self.metrics.itl
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.stats is not None and output.finish_reason is not None:
                self.metrics.observe_finished(output.stats, output.finish_reason)
            if stream is None:
                continue
            if stream.last_token_at is not None:
                itl.observe(now - stream.last_token_at)
            stream.last_token_at = now
            if output.finish_reason is not None:
                stream.finished = True
            stream.outputs.append(output)
            stream.event.set()

    async def _outputs_of(self, stream: _RequestStream) -> AsyncIterator[StepOutput]:
        while True:
            await stream.event.wait()
            stream.event.clear()
            pending, stream.outputs = stream.outputs, []
            for output in pending:
                yield output
                if output.finish_reason is not None:
                    return

    # -- OpenAI surface ---------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        try:
            block_size = self.engine.blocks.block_size
            ingested = await ingest(await request.read(), kind, self.options.model_name, block_size)
            parsed = ingested.request
            max_tokens = parsed.max_tokens
            prompt_len = len(parsed.prompt_token_ids)
            if max_tokens is None:
                max_tokens = max(1, self.engine.max_model_len - prompt_len)
            problem = self.engine.validate(prompt_len, max_tokens)
            if problem is not None:
                raise OpenAIError(400, problem, "messages" if kind == "chat" else "prompt")
            legacy = self.options.vllm_version == "legacy"
            priority = parsed.priority
            if priority != 0 and self.engine.config.scheduling_policy != "priority":
                if legacy:
                    raise OpenAIError(
                        400, f"Got priority {priority} but Priority scheduling is not enabled.",
                        "priority",
                    )  # fmt: skip
                priority = 0  # vLLM 0.32 accepts it and schedules in arrival order
            if parsed.kv_transfer_params and parsed.kv_transfer_params.get("do_remote_prefill"):
                try:
                    remote_block_ids(parsed.kv_transfer_params)
                except ValueError as exc:
                    raise OpenAIError(400, str(exc), "kv_transfer_params") from exc
        except OpenAIError as exc:
            return _error_response(exc.status, exc.body())
        client_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        engine_id = f"{client_id}-{next(self._ids)}"
        pull = await self._maybe_pull(parsed, prompt_len, ingested.block_hashes)
        if pull is not None:
            self.metrics.observe_pull(pull)
        hold = bool(parsed.kv_transfer_params and parsed.kv_transfer_params.get("do_remote_decode"))
        stream = _RequestStream()
        self._streams[engine_id] = stream
        self.engine.add_request(
            EngineRequest(
                request_id=engine_id,
                prompt_token_ids=parsed.prompt_token_ids,
                max_tokens=max_tokens,
                arrival_time=time.monotonic(),
                min_tokens=parsed.min_tokens,
                ignore_eos=parsed.ignore_eos,
                hold_blocks_on_finish=hold,
                preloaded_tokens=pull.preloaded_tokens if pull else 0,
                block_hashes=ingested.block_hashes,
                priority=priority,
            )
        )
        self.runner.wake()
        framer = ResponseFramer(kind, client_id, self.options.model_name)
        headers = {"X-Request-Id": client_id}
        try:
            if parsed.stream:
                return await self._stream(request, parsed, engine_id, stream, framer, headers)
            return await self._complete(engine_id, stream, framer, headers)
        finally:
            self._streams.pop(engine_id, None)
            if not stream.finished and self.engine.abort_request(engine_id):
                self.metrics.observe_abort()
                self.runner.wake()

    async def _maybe_pull(
        self, parsed: ParsedRequest, prompt_len: int, block_hashes: list[int]
    ) -> PullResult | None:
        params = parsed.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        assert self._puller is not None
        hit = self.engine.cached_prefix_tokens(parsed.prompt_token_ids, list(block_hashes))
        # in vLLM the request waits in the engine's queue for its KV meanwhile
        self.metrics.kv_fetches += 1
        try:
            return await self._puller.pull(params, prompt_len, hit)
        finally:
            self.metrics.kv_fetches -= 1

    def _text(self, engine_id: str, output: StepOutput, index: int) -> str:
        words = self._words.words(engine_id, index, len(output.token_ids))
        text = " ".join(words)
        return text if index == 0 else " " + text

    def _finish_extra(self, engine_id: str, output: StepOutput) -> dict[str, Any]:
        """A prefill leg's `kv_transfer_params`, shaped as vLLM's NixlConnector writes them."""
        stats = output.stats
        if stats is None or not stats.held_blocks:
            return {"kv_transfer_params": None}
        held = self.engine.held_request(engine_id)
        block_ids = list(held.block_ids) if held is not None else []
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": engine_id,
            "remote_host": self.options.host,
            "remote_port": self.options.port,  # the side channel: the HTTP port here
            "tp_size": self.options.engine.deployment.tp,
        }
        if self.options.vllm_version == "0.32":
            params["remote_block_ids"] = [block_ids]  # one KV group
            params.update(
                dcp_size=1,
                pp_size=1,
                remote_num_tokens=stats.prompt_tokens,
                # vLLM 0.32 left it null in the capture; the source's hold timeout still applies
                remote_blocks_expiry_time=None,
                transfer_mode="pull",
                remote_prefill_cached_tokens=stats.local_hit_tokens,
            )
        return {"kv_transfer_params": params}

    def _usage(self, stats: RequestStats) -> dict[str, Any]:
        """vLLM 0.32 counts only the local prefix-cache hit as cached, not pulled KV."""
        cached = stats.cached_tokens if self.options.vllm_version == "legacy" else (
            stats.local_hit_tokens)  # fmt: skip
        return usage_dict(stats.prompt_tokens, stats.completion_tokens, cached)

    async def _complete(
        self, engine_id: str, stream: _RequestStream, framer: ResponseFramer,
        headers: dict[str, str],
    ) -> web.Response:  # fmt: skip
        parts: list[str] = []
        index = 0
        last: StepOutput | None = None
        async for output in self._outputs_of(stream):
            parts.append(self._text(engine_id, output, index))
            index += len(output.token_ids)
            last = output
        assert last is not None and last.stats is not None and last.finish_reason is not None
        stats = last.stats
        usage = self._usage(stats)
        body = framer.full_response(
            "".join(parts), last.finish_reason, usage, self._finish_extra(engine_id, last)
        )
        return web.Response(body=body, content_type="application/json", headers=headers)

    async def _stream(
        self, request: web.Request, parsed: ParsedRequest, engine_id: str,
        stream: _RequestStream, framer: ResponseFramer, headers: dict[str, str],
    ) -> web.StreamResponse:  # fmt: skip
        response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        await response.prepare(request)
        try:
            if framer.kind == "chat":
                await response.write(framer.role_chunk())
            index = 0
            async for output in self._outputs_of(stream):
                chunk = framer.text_chunk(
                    self._text(engine_id, output, index), output.finish_reason
                )
                index += len(output.token_ids)
                if output.finish_reason is not None and output.stats is not None:
                    stats = output.stats
                    extra = self._finish_extra(engine_id, output)
                    if parsed.include_usage:
                        chunk += framer.usage_chunk(self._usage(stats), extra)
                await response.write(chunk)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # the stream is committed: report in-band, then end it
            await response.write(b"data: " + error_body(500, f"internal error: {exc}") + b"\n\n")
        await response.write(DONE)
        await response.write_eof()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        name = self.options.model_name
        created = int(time.time())
        model = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": name,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{self.engine_id}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _schedule_lag(self, request: web.Request) -> web.Response:
        """How late steps were applied behind the engine's schedule (for the lag benchmark)."""
        samples = sorted(self.runner.lag.samples)
        if request.query.get("reset") == "1":
            self.runner.lag.samples.clear()

        def quantile(q: float) -> float | None:
            return samples[min(len(samples) - 1, int(q * len(samples)))] if samples else None

        return web.json_response(
            {"count": len(samples), "p50_s": quantile(0.5), "p99_s": quantile(0.99),
             "max_s": samples[-1] if samples else None}
        )  # fmt: skip

    # -- side channel (metadata only; the link model charges the time) -----------------------
    async def _held(self, request: web.Request) -> web.Response:
        held = self.engine.held_request(request.match_info["request_id"])
        if held is None:
            return _error_response(404, error_body(404, "no held KV blocks for that request"))
        return web.json_response(
            {
                "engine_id": self.engine_id,
                "num_tokens": len(held.token_ids),
                "num_blocks": len(held.block_ids),
                "nic_gbps": self.options.nic_gbps,
            }
        )

    async def _release(self, request: web.Request) -> web.Response:
        released = self.engine.release_held(request.match_info["request_id"])
        if released:
            self.runner.wake()
        return web.json_response({"released": released})


def _error_response(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json")
