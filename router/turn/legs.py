"""One request to one worker ("a leg"), relayed to the client, and what a turn carries along.

`LegRunner.relay` raises `WorkerUnreachable` only while nothing has reached the client yet, so
the caller can retry the turn elsewhere; every later failure ends the client's stream with an
error event and `data: [DONE]`.

Every wait on a worker has a deadline (`LegTimeouts`): connecting, a stream's response head,
its first body byte (from the turn's TTFT objective), a whole answer, the gap between body
reads. A stream's client response starts with the worker's first bytes, so a leg that misses
a deadline before them is retried once elsewhere; after that, a 504. Each leg's outcome goes
to the worker pool's outlier ejection: a 5xx, a missed deadline or a broken connection counts
as a failure, any other answer as a success.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from policies.types import ClusterView, Turn
from router.config import RouterConfig
from router.engines import leg_body
from router.errors import RouterError, error_response, stream_error_frames
from router.fleet.workers import ModelPool, WorkerPool
from router.http import (
    Response,
    StreamWriter,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
)
from router.obs.events import StageClock, StageEvents
from router.obs.tracing import TurnTrace
from router.state.shared import SessionRecord
from router.turn.fields import RoutingFields
from router.turn.relay import RelayResult, StreamRelay
from router.turn.usage import Usage, usage_of

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class InflightLedger(Protocol):
    """The fleet's shared in-flight counts, as far as a leg moves them (`SharedState`)."""

    def add_inflight(self, worker_id: str, delta: int) -> None: ...


class WorkerUnreachable(Exception):
    """A worker refused or dropped the connection before any byte reached the client."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id} unreachable: {reason}")
        self.worker_id = worker_id


class KvPullFailed(Exception):
    """A decode leg's engine failed it (a 5xx) before any byte reached the client: on vLLM,
    the KV it was to pull could not be loaded (expired, or the source is gone)."""

    def __init__(self, worker_id: str, status: int) -> None:
        super().__init__(f"worker {worker_id} failed the KV pull with {status}")
        self.worker_id = worker_id


@dataclass
class TurnContext:
    """Everything one turn carries from admission to commit."""

    writer: StreamWriter
    chat: bool
    raw: bytes
    fields: RoutingFields
    session_id: str
    request_id: str
    turn: Turn
    record: SessionRecord | None
    events: StageEvents
    headers: dict[str, str]
    prompt_chars: int = 0  # characters of prompt text, for calibrating token estimates
    _usage: Usage | None = None
    # a whole (non-streamed) reply whose usage is read only when someone asks: after the
    # client has its answer
    _reply: bytes | None = field(default=None, repr=False)
    failed_midstream: bool = False
    served_by: str | None = None
    view: ClusterView | None = field(default=None, repr=False)  # the last decision's
    # the workers serving the turn's model (set at admission): every leg goes to one of them
    pool: ModelPool | None = field(default=None, repr=False)
    # what its requests carry as `priority` to engines with priority scheduling: when its
    # first token is due (`policies.types.engine_priority`); None: they carry none
    engine_priority: int | None = None
    _body: dict[str, Any] | None = field(default=None, repr=False)
    # a sampled turn's OpenTelemetry trace (router.obs.tracing); None without --otel
    trace: TurnTrace | None = field(default=None, repr=False)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict[str, Any]:
        if self._body is None:
            self._body = leg_body.decode_body(self.raw)
        return self._body

    def client_payload(self) -> bytes:
        """The client's request as a worker should get it: with usage always requested."""
        if self.fields.stream and not self.fields.wants_usage:
            return leg_body.encode_body(leg_body.with_usage_requested(self.body()))
        return self.raw

    @property
    def usage(self) -> Usage | None:
        """The worker's exact token counts for this turn, when it reported them."""
        if self._reply is not None:
            self._usage, self._reply = usage_of(self._reply), None
        return self._usage

    @usage.setter
    def usage(self, usage: Usage | None) -> None:
        self._usage, self._reply = usage, None

    def keep_reply(self, body: bytes) -> None:
        """A whole reply from the worker that served the turn: its usage is read on demand."""
        self._usage, self._reply = None, body

    def echo(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id, "X-Session-Id": self.session_id}


class LegTimeouts:
    """How long a leg may keep its turn waiting, in seconds from its send (connecting is the
    upstream pool's `connect_timeout_s`): the `RouterConfig` options of the same meaning."""

    __slots__ = ("first_byte_floor_s", "first_byte_ttft_multiple", "gap_s", "head_s", "whole_s")

    def __init__(
        self, head_s: float = 15.0, first_byte_floor_s: float = 30.0,
        first_byte_ttft_multiple: float = 10.0, gap_s: float = 30.0, whole_s: float = 600.0,
    ) -> None:  # fmt: skip
        self.head_s = head_s  # a stream's response head
        self.first_byte_floor_s = first_byte_floor_s
        self.first_byte_ttft_multiple = first_byte_ttft_multiple
        self.gap_s = gap_s  # between body reads, once the body began
        self.whole_s = whole_s  # a whole (non-streamed) answer

    @classmethod
    def of(cls, config: RouterConfig) -> LegTimeouts:
        return cls(config.head_timeout_s, config.first_byte_timeout_s,
                   config.first_byte_ttft_multiple, config.chunk_gap_timeout_s,
                   config.request_timeout_s)  # fmt: skip

    def first_byte_s(self, ttft_ms: float) -> float:
        """When a leg's first body byte is due, for a turn with this TTFT objective: a multiple
        of it, at least the floor, at most a whole answer's deadline."""
        due = max(self.first_byte_floor_s, self.first_byte_ttft_multiple * ttft_ms / 1000.0)
        return min(due, self.whole_s)


class LegRunner:
    """Sends legs over the pooled upstream connections and relays their answers."""

    def __init__(
        self,
        pool: WorkerPool,
        state: InflightLedger,
        clock: StageClock,
        on_upstream_error: Callable[[str, str], None],
        timeouts: LegTimeouts | None = None,
    ) -> None:
        self.pool = pool
        self._state = state
        self._clock = clock
        self._report_error = on_upstream_error
        self.timeouts = timeouts if timeouts is not None else LegTimeouts()

    def on_upstream_error(self, worker_id: str, kind: str) -> None:
        """A leg the worker failed (`kind` says how): reported, and counted towards its
        ejection. Once per failed leg."""
        self.pool.record_failure(worker_id)
        self._report_error(worker_id, kind)

    def succeeded(self, worker_id: str) -> None:
        """A leg the worker answered (below 500): its run of failures ends."""
        self.pool.record_success(worker_id)

    def send(
        self, ctx: TurnContext, worker_id: str, payload: bytes, first_token_leg: bool = False
    ) -> Awaitable[UpstreamResponse]:
        """Send a leg; awaited, the worker's status line (connection errors and missed
        deadlines propagate). A stream's head is due within `head_s` and its first bytes by
        the turn's first-byte deadline; a whole answer by `whole_s`, unless the leg ends at its
        first token (`first_token_leg`: a prefill leg), which is due by the first-byte
        deadline; once its body began, a read waits at most `gap_s`."""
        if ctx.engine_priority is not None:
            spec = self.pool.workers[worker_id].spec
            if spec.priority_scheduling:
                payload = leg_body.with_priority(payload, ctx.engine_priority, spec.engine)
        timeouts = self.timeouts
        if first_token_leg or ctx.fields.stream:
            first = timeouts.first_byte_s(ctx.turn.objectives.ttft_ms)
            head = first if first_token_leg else min(timeouts.head_s, first)
        else:
            first = head = timeouts.whole_s
        headers = ctx.headers
        if ctx.trace is not None:  # the leg's own span id in its traceparent
            headers = ctx.trace.leg_headers(headers, worker_id, first_token_leg, self._clock.now())
        return self.pool.upstream.request(
            self.pool.url(worker_id), "POST", ctx.path, headers, payload,
            head_timeout_s=head, first_byte_timeout_s=first, gap_timeout_s=timeouts.gap_s,
        )  # fmt: skip

    def unanswered(self, ctx: TurnContext, worker_id: str, exc: UpstreamError) -> Exception:
        """What to raise for a leg that failed before any of its bytes reached the client:
        `WorkerUnreachable` (the pipeline decides once more, elsewhere) for a refused
        connection, and for a missed deadline on a turn not yet retried that has another
        worker to go to; else the client's error, 504 for a missed deadline, 502 otherwise."""
        timed_out = isinstance(exc, UpstreamTimeout)
        if not ctx.writer.started and (
            isinstance(exc, UpstreamConnectError)
            or (timed_out and not ctx.events.retried and self._elsewhere(worker_id, ctx.pool))
        ):
            return WorkerUnreachable(worker_id, str(exc))
        return RouterError(504 if timed_out else 502, f"worker {worker_id} failed: {exc}")

    def _elsewhere(self, worker_id: str, pool: ModelPool | None = None) -> bool:
        """Whether some worker besides this one (of the turn's pool) can take turns."""
        state = self.pool.workers.get(worker_id)
        own = 1 if state is not None and state.serving else 0
        serving = self.pool.healthy_count() if pool is None else pool.serving
        return serving > own

    async def relay(
        self,
        ctx: TurnContext,
        worker_id: str,
        payload: bytes,
        drop_first: bool = False,
        on_first_token: Callable[[], None] | None = None,
        brings_kv: bool = False,
        pull_may_fail: bool = False,
    ) -> Response | None:
        """The leg's answer to the client; a stream calls `on_first_token` at its first
        content frame (a whole reply is all there when this returns). `brings_kv`: a decode
        leg pulling its prompt's KV, which queues no prefill on the worker; with
        `pull_may_fail`, its 5xx before any byte reached the client raises `KvPullFailed`
        (the caller serves the turn another way) instead of reaching the client."""
        with self.inflight(worker_id) as inflight:
            if brings_kv:
                inflight.begin()
            try:
                upstream = await self.send(ctx, worker_id, payload)
            except UpstreamError as exc:
                self.on_upstream_error(worker_id, failure_kind(exc, "connect"))
                if ctx.writer.started:
                    await self.fail_stream(ctx, worker_id, str(exc), _status(exc))
                    return None
                raise self.unanswered(ctx, worker_id, exc) from exc
            try:
                if upstream.status != 200:
                    if pull_may_fail and upstream.status >= 500 and not ctx.writer.started:
                        await upstream.read()
                        self.on_upstream_error(worker_id, f"http_{upstream.status}")
                        raise KvPullFailed(worker_id, upstream.status)
                    return await self._forward_error(ctx, worker_id, upstream)
                if ctx.fields.stream:
                    first = b""
                    if not ctx.writer.started:
                        # the client's stream starts with the worker's first bytes: until then
                        # a failed leg can go elsewhere
                        first = await _first_read(upstream)
                    await self._relay_stream(ctx, worker_id, upstream, first, drop_first,
                                             _both(inflight.begin, on_first_token))  # fmt: skip
                    return None
                body = await upstream.read()
            except UpstreamError as exc:
                # the worker broke off or kept back its answer: none of it reached the client
                self.on_upstream_error(worker_id, failure_kind(exc, "body"))
                if ctx.writer.started:
                    await self.fail_stream(ctx, worker_id, str(exc), _status(exc))
                    return None
                raise self.unanswered(ctx, worker_id, exc) from exc
            except BaseException:
                upstream.close()  # a client that went away cancels the worker's request
                raise
        self.succeeded(worker_id)
        ctx.keep_reply(body)
        now = self._clock.now()
        ctx.events.first_token = ctx.events.first_token or now
        ctx.events.last_token = now
        return Response(200, body, ctx.echo())

    async def _relay_stream(
        self, ctx: TurnContext, worker_id: str, upstream: UpstreamResponse, first: bytes,
        drop_first: bool, on_first_token: Callable[[], None] | None,
    ) -> None:  # fmt: skip
        writer = await self.prepare(ctx)
        relay = StreamRelay(writer, forward_usage=ctx.fields.wants_usage,
                            drop_first_content=drop_first,
                            on_first_content=on_first_token)  # fmt: skip
        result = await relay.run(upstream, first)
        self._stamp(ctx, result)
        if result.error is not None:
            ctx.failed_midstream = True
            ctx.events.error = result.error
            stage = result.timed_out
            self.on_upstream_error(worker_id, "midstream" if stage is None else f"timeout_{stage}")
        else:
            self.succeeded(worker_id)
        await writer.end()

    def _stamp(self, ctx: TurnContext, result: RelayResult) -> None:
        ctx.usage = result.usage
        offset = self._clock.now() - time.monotonic()
        if result.first_token_at is not None and ctx.events.first_token is None:
            ctx.events.first_token = result.first_token_at + offset
        if result.last_token_at is not None:
            ctx.events.last_token = result.last_token_at + offset

    async def prepare(self, ctx: TurnContext) -> StreamWriter:
        """Start the client's event stream (once)."""
        if not ctx.writer.started:
            await ctx.writer.start(200, {**_SSE_HEADERS, **ctx.echo()})
        return ctx.writer

    async def _forward_error(
        self, ctx: TurnContext, worker_id: str, upstream: UpstreamResponse
    ) -> Response | None:
        body = await upstream.read()
        content_type = upstream.headers.get("content-type", "application/json")
        answer = self.error_answer(ctx, worker_id, upstream.status, body, content_type)
        ctx.events.error = f"worker answered {upstream.status}"
        if ctx.writer.started:
            await self.fail_stream(ctx, worker_id, f"worker answered {upstream.status}")
            return None
        return answer

    def error_answer(
        self, ctx: TurnContext, worker_id: str, status: int, body: bytes, content_type: str
    ) -> Response:
        """A worker's answer other than 200 as the client's, with the worker's status: a 5xx
        counts against the worker, a 4xx is the request's fault. An error body that is not
        OpenAI's shape (a plain-text or HTML page of the worker or its proxy) is wrapped in
        it."""
        if status >= 500:
            self.on_upstream_error(worker_id, f"http_{status}")
        else:
            self.succeeded(worker_id)  # the worker is fine: the request was refused
        if status >= 400 and not _is_openai_error(body):
            snippet = body[:200].decode("utf-8", "replace").strip()
            message = f"worker {worker_id} answered {status}: {snippet}"
            return error_response(status, message, headers=ctx.echo())
        return Response(status, body, ctx.echo(), content_type)

    async def fail_stream(
        self, ctx: TurnContext, worker_id: str, reason: str, status: int = 502
    ) -> None:
        """End the client's started stream with an error event (the failure was reported)."""
        ctx.failed_midstream = True
        ctx.events.error = reason
        await ctx.writer.write(stream_error_frames(status, f"worker {worker_id} failed: {reason}"))
        await ctx.writer.end()

    def inflight(self, worker_id: str) -> _Inflight:
        """Counts a request on the worker while it runs; `WorkerUnreachable` where the worker
        left the fleet and is forgotten already (the turn is placed again)."""
        if worker_id not in self.pool.workers:
            raise WorkerUnreachable(worker_id, "it left the fleet")
        return _Inflight(self.pool, self._state, worker_id)


def _is_openai_error(body: bytes) -> bool:
    """Whether a worker's error body is OpenAI's `{"error": {"message": ...}}` already."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return False
    error = parsed.get("error") if isinstance(parsed, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def failure_kind(exc: UpstreamError, otherwise: str) -> str:
    """The `session_router_upstream_errors_total` kind of a failed leg."""
    return f"timeout_{exc.stage}" if isinstance(exc, UpstreamTimeout) else otherwise


def _status(exc: UpstreamError) -> int:
    """The status a client's error event gives for a failed leg."""
    return 504 if isinstance(exc, UpstreamTimeout) else 502


async def _first_read(upstream: UpstreamResponse) -> bytes:
    """The body's first bytes (b"" for an empty body)."""
    try:
        return await upstream.__anext__()
    except StopAsyncIteration:
        return b""


def _both(first: Callable[[], None], then: Callable[[], None] | None) -> Callable[[], None]:
    if then is None:
        return first

    def both() -> None:
        first()
        then()

    return both


class _Inflight:
    """Counts a request on a worker, locally (session_router_inflight_requests reads it) and in
    the fleet's shared in-flight ledger; and, once it begins answering, among the worker's
    requests started since its last scrape (`WorkerState.started_since_scrape`)."""

    __slots__ = ("_began", "_state", "_worker", "_worker_id")

    def __init__(self, pool: WorkerPool, state: InflightLedger, worker_id: str) -> None:
        self._worker, self._state, self._worker_id = pool.workers[worker_id], state, worker_id
        self._began = -1  # the scrape epoch it began answering in

    def __enter__(self) -> _Inflight:
        self._worker.inflight += 1
        self._state.add_inflight(self._worker_id, 1)
        return self

    def begin(self) -> None:
        """It began answering (its first token; a decode leg bringing its KV, at once): it
        queues no prefill there any more, whatever the last scrape saw."""
        if self._began < 0:
            worker = self._worker
            self._began = worker.scrape_epoch
            worker.started_since_scrape += 1

    def __exit__(self, *exc: object) -> None:
        worker = self._worker
        worker.inflight -= 1
        if self._began == worker.scrape_epoch:  # no scrape since it began: counted still
            worker.started_since_scrape -= 1
        self._state.add_inflight(self._worker_id, -1)
