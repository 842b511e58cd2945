"""Carry out a placement decision: one leg, or a handoff's two legs, relayed to the client.

Raises `WorkerUnreachable` only while nothing has been sent to the client yet, so the caller
can retry the turn elsewhere; every later failure ends the client's stream with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from policies.types import Colocate, Decision, Handoff, Migrate, Recompute, Reject, Turn
from router import adapters
from router.config import RouterConfig
from router.errors import RouterError, stream_error_frames
from router.events import StageClock, StageEvents
from router.metrics import RouterMetrics
from router.relay import RelayResult, StreamRelay, Usage, usage_of
from router.state import Reservation, SessionRecord, SharedState
from router.turn_fields import RoutingFields
from router.workers import WorkerPool

log = logging.getLogger("router.execute")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)


class WorkerUnreachable(Exception):
    """A worker refused or dropped the connection before any byte reached the client."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id} unreachable: {reason}")
        self.worker_id = worker_id


@dataclass
class TurnContext:
    """Everything one turn carries from admission to commit."""

    request: web.Request
    chat: bool
    raw: bytes
    fields: RoutingFields
    session_id: str
    request_id: str
    turn: Turn
    record: SessionRecord | None
    events: StageEvents
    headers: dict[str, str]
    response: web.StreamResponse | None = None
    usage: Usage | None = None
    failed_midstream: bool = False
    served_by: str | None = None
    # what the decode worker reported moving (simulated workers say so in headers)
    reported_transfer: tuple[int, float] | None = None
    _body: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict[str, Any]:
        if self._body is None:
            self._body = adapters.decode_body(self.raw)
        return self._body

    def client_payload(self) -> bytes:
        """The client's request as a worker should get it: with usage always requested."""
        if self.fields.stream and not self.fields.wants_usage:
            return adapters.encode_body(adapters.with_usage_requested(self.body()))
        return self.raw


class Executor:
    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        state: SharedState,
        clock: StageClock,
        on_upstream_error: Callable[[str, str], None],
        metrics: RouterMetrics,
    ) -> None:
        self._metrics = metrics
        self._config = config
        self._pool = pool
        self._state = state
        self._clock = clock
        self._on_upstream_error = on_upstream_error
        self._rng = random.Random()

    async def execute(self, ctx: TurnContext, decision: Decision) -> web.StreamResponse:
        if isinstance(decision, Reject):
            raise RouterError(
                429, f"turn rejected: {decision.reason or 'no placement meets its objectives'}",
                retry_after_s=decision.retry_after_s,
            )  # fmt: skip
        if isinstance(decision, Colocate | Recompute):
            return await self._single(ctx, decision.worker)
        if isinstance(decision, Handoff):
            nbytes = ctx.turn.prompt_tokens * self._config.kv_bytes_per_token
            reservation = await self._reserve(decision.prefill_worker, decision.decode_worker,
                                              nbytes, "handoff")  # fmt: skip
            return await self._handoff(ctx, decision.prefill_worker, decision.decode_worker,
                                       reservation)  # fmt: skip
        assert isinstance(decision, Migrate)
        nbytes = ctx.record.bytes if ctx.record else 0
        reservation = await self._reserve(decision.source, decision.destination, nbytes,
                                          "migration")  # fmt: skip
        if reservation is None:
            # The link is busy with latency-critical handoffs: defer the migration this turn.
            ctx.events.action = "colocate"
            ctx.events.decode_worker = decision.source
            return await self._single(ctx, decision.source)
        return await self._handoff(ctx, decision.source, decision.destination, reservation)

    async def _reserve(self, src: str, dst: str, nbytes: int, priority: str) -> Reservation | None:
        try:
            return await self._state.reserve(src, dst, nbytes, priority)  # type: ignore[arg-type]
        except Exception:  # the ledger is advisory: never fail a turn on it
            log.warning("link reservation %s->%s failed", src, dst, exc_info=True)
            return None

    # -- one leg ---------------------------------------------------------------------------
    async def _single(self, ctx: TurnContext, worker_id: str) -> web.StreamResponse:
        ctx.served_by = worker_id
        ctx.events.prefill_start = self._clock.now()
        return await self._relay_leg(ctx, worker_id, ctx.client_payload(), drop_first=False)

    async def _relay_leg(
        self, ctx: TurnContext, worker_id: str, payload: bytes, drop_first: bool
    ) -> web.StreamResponse:
        url = self._pool.url(worker_id) + ctx.path
        with self._inflight(worker_id):
            try:
                upstream = await self._pool.session.post(url, data=payload, headers=ctx.headers)
            except _CONNECT_ERRORS as exc:
                if ctx.response is not None and ctx.response.prepared:
                    return await self._fail_stream(ctx, worker_id, f"{type(exc).__name__}")
                raise WorkerUnreachable(worker_id, type(exc).__name__) from exc
            try:
                if upstream.status != 200:
                    return await self._forward_error(ctx, worker_id, upstream)
                moved = upstream.headers.get("x-kv-transfer-bytes")
                if moved is not None:
                    seconds = float(upstream.headers.get("x-kv-transfer-ms", "0")) / 1000
                    ctx.reported_transfer = (int(moved), seconds)
                if ctx.fields.stream:
                    return await self._relay_stream(ctx, worker_id, upstream, drop_first)
                body = await upstream.read()
                ctx.usage = usage_of(body)
                now = self._clock.now()
                ctx.events.first_token = ctx.events.first_token or now
                ctx.events.last_token = now
                headers = {"Content-Type": "application/json", **self._echo(ctx)}
                return web.Response(body=body, headers=headers)
            except BaseException:
                upstream.close()  # a client that went away cancels the worker's request
                raise
            finally:
                upstream.release()

    async def _relay_stream(
        self, ctx: TurnContext, worker_id: str, upstream: aiohttp.ClientResponse, drop_first: bool
    ) -> web.StreamResponse:
        response = await self._prepare(ctx)
        relay = StreamRelay(response, forward_usage=ctx.fields.wants_usage,
                            drop_first_content=drop_first)  # fmt: skip
        result = await relay.run(upstream)
        self._stamp(ctx, result)
        if result.error is not None:
            ctx.failed_midstream = True
            ctx.events.error = result.error
            self._on_upstream_error(worker_id, "midstream")
        await response.write_eof()
        return response

    def _stamp(self, ctx: TurnContext, result: RelayResult) -> None:
        ctx.usage = result.usage
        offset = self._clock.now() - time.monotonic()
        if result.first_token_at is not None and ctx.events.first_token is None:
            ctx.events.first_token = result.first_token_at + offset
        if result.last_token_at is not None:
            ctx.events.last_token = result.last_token_at + offset

    async def _prepare(self, ctx: TurnContext) -> web.StreamResponse:
        if ctx.response is None:
            ctx.response = web.StreamResponse(headers={**_SSE_HEADERS, **self._echo(ctx)})
            await ctx.response.prepare(ctx.request)
        return ctx.response

    def _echo(self, ctx: TurnContext) -> dict[str, str]:
        return {"X-Request-Id": ctx.request_id, "X-Session-Id": ctx.session_id}

    async def _forward_error(
        self, ctx: TurnContext, worker_id: str, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        body = await upstream.read()
        if upstream.status >= 500:
            self._on_upstream_error(worker_id, f"http_{upstream.status}")
        ctx.events.error = f"worker answered {upstream.status}"
        if ctx.response is not None and ctx.response.prepared:
            return await self._fail_stream(ctx, worker_id, f"worker answered {upstream.status}")
        content_type = upstream.headers.get("Content-Type", "application/json")
        return web.Response(status=upstream.status, body=body,
                            headers={"Content-Type": content_type, **self._echo(ctx)})  # fmt: skip

    async def _fail_stream(
        self, ctx: TurnContext, worker_id: str, reason: str
    ) -> web.StreamResponse:
        assert ctx.response is not None
        ctx.failed_midstream = True
        ctx.events.error = reason
        self._on_upstream_error(worker_id, "midstream")
        await ctx.response.write(stream_error_frames(502, f"worker {worker_id} failed: {reason}"))
        await ctx.response.write_eof()
        return ctx.response

    # -- handoff and migration ------------------------------------------------------------
    async def _handoff(
        self, ctx: TurnContext, prefill: str, decode: str, reservation: Reservation | None
    ) -> web.StreamResponse:
        spec = self._pool.workers[prefill].spec
        if spec.engine == "sglang":
            return await self._handoff_sglang(ctx, prefill, decode, reservation)
        events = ctx.events
        events.prefill_start = self._clock.now()
        payload = adapters.encode_body(adapters.vllm_prefill_leg(ctx.body()))
        reply: adapters.PrefillReply | None = None
        with self._inflight(prefill):
            try:
                async with self._pool.session.post(
                    self._pool.url(prefill) + ctx.path, data=payload, headers=ctx.headers
                ) as upstream:
                    raw = await upstream.read()
                    if upstream.status == 200:
                        reply = adapters.parse_prefill_reply(raw)
                    elif upstream.status < 500:
                        self._release(reservation, 0, 0.0)
                        return web.Response(status=upstream.status, body=raw,
                                            content_type="application/json",
                                            headers=self._echo(ctx))  # fmt: skip
                    else:
                        self._on_upstream_error(prefill, f"http_{upstream.status}")
            except _CONNECT_ERRORS as exc:
                self._release(reservation, 0, 0.0)
                raise WorkerUnreachable(prefill, type(exc).__name__) from exc
        events.prefill_end = self._clock.now()
        params = reply.kv_transfer_params if reply is not None else None
        if params is None:
            # No KV to pull (EOS as first token, or the prefill failed): the decode worker
            # prefills the whole prompt itself.
            events.recomputed_tokens = ctx.turn.prompt_tokens
        drop_first = False
        if (self._config.first_token == "prefill" and ctx.fields.stream and reply is not None
                and params is not None):  # fmt: skip
            response = await self._prepare(ctx)
            await response.write(adapters.first_token_frames(reply, ctx.chat))
            events.first_token = self._clock.now()
            drop_first = True
        decode_body = adapters.vllm_decode_leg(ctx.body(), params)
        if ctx.fields.stream and not ctx.fields.wants_usage:
            decode_body = adapters.with_usage_requested(decode_body)
        events.transfer_start = self._clock.now()
        ctx.served_by = decode
        try:
            response = await self._relay_leg(ctx, decode, adapters.encode_body(decode_body),
                                             drop_first)  # fmt: skip
        except WorkerUnreachable:
            self._release(reservation, 0, 0.0)
            return await self._decode_fallback(ctx, decode, drop_first)
        self._finish_transfer(ctx, reservation)
        return response

    def _finish_transfer(self, ctx: TurnContext, reservation: Reservation | None) -> None:
        events = ctx.events
        first = events.first_token or self._clock.now()
        start = events.transfer_start or first
        events.transfer_end = first
        seconds = max(0.0, first - start)
        if ctx.reported_transfer is not None:
            events.transferred_bytes, seconds = ctx.reported_transfer
            events.transfer_end = start + seconds
        elif not events.recomputed_tokens:
            # Engines do not report what the pull moved: everything the decode worker did not
            # already hold as this session's resident prefix.
            prompt = ctx.usage.prompt_tokens if ctx.usage else ctx.turn.prompt_tokens
            resident = (
                ctx.record.tokens if ctx.record and ctx.record.worker_id == ctx.served_by else 0
            )
            events.transferred_bytes = max(0, prompt - resident) * self._config.kv_bytes_per_token
        self._release(reservation, events.transferred_bytes, seconds)

    async def _decode_fallback(
        self, ctx: TurnContext, failed: str, drop_first: bool
    ) -> web.StreamResponse:
        """The decode leg failed after the prefill succeeded: prefill locally on another
        decode-capable worker (counted as recomputed)."""
        self._on_upstream_error(failed, "connect")
        candidates = [
            worker_id for worker_id, state in self._pool.workers.items()
            if worker_id != failed and state.healthy and not state.draining
            and state.spec.role in ("decode", "mixed")
        ]  # fmt: skip
        if not candidates:
            raise RouterError(503, "no healthy decode worker left for this turn", retry_after_s=1)
        target = min(candidates, key=lambda w: (self._pool.workers[w].inflight, w))
        ctx.events.retried = True
        ctx.events.recomputed_tokens = ctx.turn.prompt_tokens
        ctx.events.decode_worker = target
        ctx.served_by = target
        return await self._relay_leg(ctx, target, ctx.client_payload(), drop_first)

    async def _handoff_sglang(
        self, ctx: TurnContext, prefill: str, decode: str, reservation: Reservation | None
    ) -> web.StreamResponse:
        spec = self._pool.workers[prefill].spec
        host = spec.base_url.split("://", 1)[1].rsplit(":", 1)[0]
        body = ctx.body()
        if ctx.fields.stream and not ctx.fields.wants_usage:
            body = adapters.with_usage_requested(body)
        prefill_body, decode_body = adapters.sglang_legs(body, host, spec.bootstrap_port,
                                                         self._rng)  # fmt: skip
        ctx.events.prefill_start = ctx.events.transfer_start = self._clock.now()
        drain = asyncio.ensure_future(self._drain(prefill, ctx, adapters.encode_body(prefill_body)))
        ctx.served_by = decode
        try:
            response = await self._relay_leg(ctx, decode, adapters.encode_body(decode_body), False)
        except BaseException:
            drain.cancel()
            self._release(reservation, 0, 0.0)
            raise
        ctx.events.prefill_end = self._clock.now()
        self._finish_transfer(ctx, reservation)
        return response

    async def _drain(self, worker_id: str, ctx: TurnContext, payload: bytes) -> None:
        with self._inflight(worker_id):
            try:
                async with self._pool.session.post(
                    self._pool.url(worker_id) + ctx.path, data=payload, headers=ctx.headers
                ) as upstream:
                    await upstream.read()
            except aiohttp.ClientError:
                self._on_upstream_error(worker_id, "prefill_leg")

    def _release(self, reservation: Reservation | None, nbytes: int, seconds: float) -> None:
        if reservation is not None:
            self._state.release(reservation, nbytes, seconds)

    def _inflight(self, worker_id: str) -> _Inflight:
        return _Inflight(self._pool, self._state, self._metrics, worker_id)


class _Inflight:
    """Counts a request on a worker, locally and in the fleet's shared in-flight ledger."""

    __slots__ = ("_metrics", "_pool", "_state", "_worker_id")

    def __init__(
        self, pool: WorkerPool, state: SharedState, metrics: RouterMetrics, worker_id: str
    ) -> None:
        self._pool, self._state, self._metrics, self._worker_id = pool, state, metrics, worker_id

    def __enter__(self) -> None:
        self._pool.workers[self._worker_id].inflight += 1
        self._state.add_inflight(self._worker_id, 1)
        self._metrics.inflight_add(self._worker_id, 1)

    def __exit__(self, *exc: object) -> None:
        self._pool.workers[self._worker_id].inflight -= 1
        self._state.add_inflight(self._worker_id, -1)
        self._metrics.inflight_add(self._worker_id, -1)
