"""A turn's path: admission -> session -> snapshot -> decide -> execute -> commit.

Nothing here awaits Redis for a session this replica already knows; commits, releases and
in-flight counts go out in the state layer's pipelined batches after the client is answered.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
from collections.abc import Callable

from policies.base import Policy
from policies.plan import Plan, kv_bytes, plan_turn
from policies.types import (
    ClusterView,
    Decision,
    Objectives,
    Prediction,
    Residency,
    Turn,
    engine_priority_of,
)
from router.config import RouterConfig
from router.errors import RouterError, stream_error_frames
from router.fleet.workers import ModelPool, WorkerPool
from router.http import Request, Response, StreamWriter
from router.obs.events import EventLog, StageClock, StageEvents
from router.obs.metrics import RouterMetrics
from router.obs.tracing import Tracing, TurnTrace
from router.state.shared import UNKNOWN, SessionRecord, SharedState
from router.turn.execute import Executor
from router.turn.fields import (
    TokenEstimator,
    checked_header_id,
    decode_turn_body,
    session_identity,
    text_size,
    trace_headers,
)
from router.turn.legs import TurnContext, WorkerUnreachable
from router.turn.tokenizer_file import LocalTokenizer

log = logging.getLogger("router.turn.pipeline")

# Accounting for finished turns (metrics, the policy's observe, the event log) runs while a
# later turn waits on its worker, so it never sits between a client and its answer; with no
# later turn it runs this long after the last one finished.
SETTLE_AFTER_S = 0.002
# X-SLO-TTFT-Ms / X-SLO-ITL-Ms: a finite, positive number of milliseconds up to an hour
MAX_OBJECTIVE_MS = 3_600_000.0


class PolicyHolder:
    """The live policy; swapped atomically at run time (turns in flight keep theirs)."""

    def __init__(self, name: str, policy: Policy) -> None:
        self.name = name
        self.policy = policy


class TurnPipeline:
    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        state: SharedState,
        policy: PolicyHolder,
        metrics: RouterMetrics,
        events: EventLog,
        executor: Executor,
        clock: StageClock,
        mark_failed: Callable[[str], None],
    ) -> None:
        self._config = config
        self._pool = pool
        self._state = state
        self._policy = policy
        self._metrics = metrics
        self._events = events
        self._executor = executor
        self._clock = clock
        self._mark_failed = mark_failed
        self._session_header = config.session_header
        self._session_key = config.session_header.lower()
        self.tokens = TokenEstimator()
        self._tokenizer = LocalTokenizer(config.tokenizer) if config.tokenizer else None
        # ids unique across replicas and restarts without a system call per turn
        self._id_prefix = os.urandom(8).hex()
        self._id_counter = itertools.count(1)
        self._running_loop: asyncio.AbstractEventLoop | None = None
        self._unsettled: list[StageEvents] = []
        self._settle_timer: asyncio.TimerHandle | None = None
        # OpenTelemetry (--otel): traced turns' spans are made as they settle
        self.tracing: Tracing | None = None
        self._untraced: list[tuple[TurnTrace, StageEvents]] = []

    async def handle(self, request: Request, writer: StreamWriter, chat: bool) -> Response | None:
        """One turn; returns the reply, or None when it was streamed through `writer`."""
        admitted = self._clock.now()
        # The router's own id names the turn to workers (X-Request-Id on every leg, so the
        # id a handoff pairs its legs by) and to the policy; a client's X-Request-Id is only
        # echoed back to it and kept in the stage events.
        request_id = echo_id = self._new_request_id()
        events = StageEvents(request_id=request_id, session_id="", admitted=admitted,
                             first_token_convention=self._config.first_token)  # fmt: skip
        ctx: TurnContext | None = None
        try:
            client_id = request.headers.get("x-request-id")
            if client_id is not None:
                echo_id = checked_header_id(client_id, "X-Request-Id")
                events.client_request_id = echo_id
            ctx = await self._admit(request, writer, chat, request_id, echo_id, events)
            response = await self._place_and_run(ctx)
            status = 200 if response is None else response.status
            events.http_status = status
            events.outcome = "completed" if status == 200 and not ctx.failed_midstream else "error"
            return response
        except RouterError as exc:
            events.outcome = "rejected" if exc.status == 429 else "error"
            events.error = exc.message
            events.http_status = exc.status
            if exc.status == 429:
                self._metrics.rejected("policy")
            elif exc.status == 503:
                self._metrics.rejected("no_worker")
            if writer.started:  # the stream is committed: end it with an error event
                if not writer.ended:
                    await writer.write(stream_error_frames(exc.status, exc.message))
                    await writer.end()
                return None
            return exc.response({"X-Request-Id": echo_id})
        except (asyncio.CancelledError, ConnectionResetError):
            events.outcome = "cancelled"
            self._metrics.client_disconnect()
            raise
        finally:
            events.done = self._clock.now()
            # a plain reply is written when this returns: the bookkeeping waits for it
            writer.after_sent(lambda: self._finish(ctx, events))

    def _loop(self) -> asyncio.AbstractEventLoop:
        # asyncio.get_running_loop() costs a getpid() system call on Python 3.11
        loop = self._running_loop
        if loop is None:
            loop = self._running_loop = asyncio.get_running_loop()
        return loop

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter):016x}"

    async def _admit(
        self,
        request: Request,
        writer: StreamWriter,
        chat: bool,
        request_id: str,
        echo_id: str,
        events: StageEvents,
    ) -> TurnContext:
        """The turn, validated: `request_id` is the router's id for it, `echo_id` the one the
        client gets back (its own X-Request-Id where it sent one)."""
        raw = request.body  # the server already refused bodies over --max-body-bytes (413)
        fields, body = decode_turn_body(raw, chat)
        pool = self._pool.pool_for(fields.model)
        if pool is None:
            raise unknown_model(fields.model, self._pool.model_names())
        session_id = session_identity(
            request.headers.get(self._session_key), fields, self._session_header
        )
        events.session_id = session_id
        chars, id_count = text_size(fields)
        exact = self._tokenizer.count(fields) if self._tokenizer is not None else id_count
        messages = len(fields.messages or ())
        prompt_tokens = self.tokens.estimate(chars, exact, messages)
        events.estimated_prompt_tokens = prompt_tokens
        objectives = self._objectives(request, prompt_tokens)
        record = self._state.cached_session(session_id)
        if record is UNKNOWN:
            record = await self._state.load_session(session_id)
        uncached = prompt_tokens
        if record is not None and record.worker_id in pool.ids:
            # (a worker forgotten since, or serving another model, holds nothing of use)
            uncached = max(1, prompt_tokens - record.tokens)
        cap = fields.output_cap
        turn = Turn(
            session_id=session_id,
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            uncached_tokens=uncached,
            max_tokens=cap if cap is not None else 256,
            objectives=objectives,
            arrival_s=time.monotonic(),
        )
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        traceparent = request.headers.get("traceparent")
        if traceparent is not None:
            headers.update(trace_headers(traceparent, request.headers.get("tracestate")))
        authorization = request.headers.get("authorization")
        if self._config.forward_auth and authorization is not None:
            headers["Authorization"] = authorization
        ctx = TurnContext(writer=writer, chat=chat, raw=raw, fields=fields, _body=body,
                          session_id=session_id, request_id=echo_id, turn=turn,
                          record=record, events=events, headers=headers,
                          prompt_chars=chars if id_count is None else 0,
                          pool=pool)  # fmt: skip
        if self.tracing is not None:
            ctx.trace = self.tracing.begin(headers, ctx.path)
        return ctx

    def _objectives(self, request: Request, prompt_tokens: int) -> Objectives:
        ttft = self._config.slo_ttft_ms
        if ttft is None:
            ttft = 1000.0 + 0.2 * prompt_tokens
        headers = request.headers
        ttft = objective_ms(headers.get("x-slo-ttft-ms"), "X-SLO-TTFT-Ms", ttft)
        itl = objective_ms(headers.get("x-slo-itl-ms"), "X-SLO-ITL-Ms", self._config.slo_itl_ms)
        return Objectives(ttft_ms=ttft, itl_ms=itl)

    def view(self, record: SessionRecord | None, pool: ModelPool | None = None) -> ClusterView:
        """The policy's view: the workers of `pool` (those serving the turn's model; default:
        every worker), the links, the session's residency."""
        now = time.time()
        links = self._state.policy_links()
        residency: Residency | None = record.to_residency() if record is not None else None
        workers = self._pool.views(self._state.fleet_inflight(), now, pool)
        return ClusterView(
            now_s=now,
            workers=workers,
            links=links,
            residency=residency,
            kv_bytes_per_token=self._config.kv_bytes_per_token,
            changes=self._pool.changes(pool),
        )

    def _decide(self, ctx: TurnContext) -> tuple[Decision, Plan]:
        holder = self._policy
        # the pool as it is now: the fleet may have changed since admission (or the try
        # before this one)
        pool = self._pool.pool_for(ctx.fields.model)
        if pool is None:
            raise unknown_model(ctx.fields.model, self._pool.model_names())
        ctx.pool = pool
        view = self.view(ctx.record, pool)
        started = time.perf_counter()
        try:
            decision = holder.policy.decide(ctx.turn, view)
        except Exception as exc:
            log.exception("policy %s failed on request %s", holder.name, ctx.turn.request_id)
            raise RouterError(500, f"placement policy {holder.name!r} failed: {exc}") from exc
        elapsed = time.perf_counter() - started
        residency = ctx.record.to_residency() if ctx.record is not None else None
        plan = plan_turn(decision, ctx.turn.prompt_tokens, residency,
                         self._config.kv_bytes_per_token)  # fmt: skip
        self._metrics.decision(holder.name, plan.action, elapsed)
        ctx.events.record_decision(holder.name, decision, plan, self._clock.now())
        ctx.view = view  # what the workers looked like is written down after the answer
        # a client's own priority stays; a retried turn carries its latest decision's
        own = ctx.fields.priority is not None
        ctx.engine_priority = None if own else engine_priority_of(decision, view.now_s)
        return decision, plan

    async def _place_and_run(self, ctx: TurnContext) -> Response | None:
        if self._serving(ctx) == 0:
            raise RouterError(503, "no healthy worker is available" + _for_model(ctx.pool),
                              retry_after_s=1.0)  # fmt: skip
        if self._unsettled:  # runs once this turn waits on its worker
            self._loop().call_soon(self.settle)
        failed: WorkerUnreachable | None = None
        for attempt in range(2):
            decision, plan = self._decide(ctx)
            if failed is not None and plan.answering_worker is None:
                # a worker failed the turn and the policy has no other placement for it: the
                # fleet's failure, not a rate limit on the client (the policy's 429)
                raise RouterError(
                    503, f"{failed}; no other worker can take the turn", retry_after_s=1.0
                ) from failed
            try:
                return await self._executor.execute(ctx, decision, plan)
            except WorkerUnreachable as exc:
                self._mark_failed(exc.worker_id)
                self._metrics.retry("connect")
                ctx.events.retried = True
                failed = exc
                if attempt == 1 or self._serving(ctx) == 0:
                    raise RouterError(
                        503, f"no worker reachable: {exc}", retry_after_s=1.0
                    ) from exc
        raise AssertionError("unreachable")

    def _serving(self, ctx: TurnContext) -> int:
        """Workers that can take the turn now: of its model's pool (one read)."""
        if self._pool.healthy_count() == 0:
            return 0  # (also brings back workers whose ejection ended)
        return ctx.pool.serving if ctx.pool is not None else self._pool.healthy_count()

    def _finish(self, ctx: TurnContext | None, events: StageEvents) -> None:
        """Commit residency at once (the session's next turn reads it); count, learn and log
        later, while some turn waits on a worker or within `SETTLE_AFTER_S`."""
        if ctx is not None:
            self._commit(ctx, events)
            if ctx.view is not None:
                events.record_placement_load(ctx.view)
            if ctx.trace is not None:
                self._untraced.append((ctx.trace, events))
        self._unsettled.append(events)
        if self._settle_timer is None:  # left armed when a turn settles first: one per period
            self._settle_timer = self._loop().call_later(SETTLE_AFTER_S, self._settle_on_time)

    def close(self) -> None:
        """Settle what is left and stop the timer (the router is stopping)."""
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None
        self.settle()

    def _settle_on_time(self) -> None:
        self._settle_timer = None
        self.settle()

    def settle(self) -> None:
        """Count, learn from and log every finished turn not yet accounted for."""
        finished, self._unsettled = self._unsettled, []
        for events in finished:
            try:
                self._account(events)
            except Exception:
                log.exception("accounting for request %s failed", events.request_id)
        if self._untraced and self.tracing is not None:
            traced, self._untraced = self._untraced, []
            for trace, events in traced:
                try:
                    self.tracing.finish(trace, events)
                except Exception:
                    log.exception("tracing request %s failed", events.request_id)

    def _account(self, events: StageEvents) -> None:
        action = events.action or "none"
        outcome = events.outcome or "error"
        self._metrics.request_done(action, outcome)
        if events.recomputed_tokens:
            self._metrics.recomputed(events.recomputed_tokens)
        if events.transferred_bytes:
            self._metrics.transferred(events.transferred_bytes)
        if events.released is not None and events.decided is not None:
            self._metrics.held(events.released - events.decided)
        if (
            events.first_token is not None
            and events.admitted is not None
            and outcome == "completed"
        ):
            self._metrics.ttft(events.first_token - events.admitted)
            if events.transfer_start is not None and events.prefill_start is not None:
                self._metrics.handoff(events.first_token - events.prefill_start)
        if outcome == "completed" and events.predicted is not None:
            events.realised = self._realised(events)
            self._metrics.estimate_error(events.predicted, events.realised)
        if events.action is not None:
            try:
                self._policy.policy.observe(events.to_outcome())
            except Exception:
                log.exception("policy %s failed to observe", self._policy.name)
        self._events.record(events)

    @staticmethod
    def _realised(events: StageEvents) -> Prediction:
        """The measured counterparts of the predicted terms the router can observe itself."""

        def ms(start: float | None, end: float | None) -> float:
            return 0.0 if start is None or end is None else max(0.0, end - start) * 1000

        return Prediction(
            exposed_transfer_ms=ms(events.transfer_start, events.transfer_end),
            ttft_ms=ms(events.admitted, events.first_token),
        )

    def _commit(self, ctx: TurnContext, events: StageEvents) -> None:
        usage = ctx.usage
        if usage is not None:
            events.prompt_tokens = usage.prompt_tokens
            events.cached_tokens = usage.cached_tokens
            events.completion_tokens = usage.completion_tokens
            if ctx.prompt_chars:
                messages = len(ctx.fields.messages or ())
                self.tokens.observe(ctx.prompt_chars, messages, usage.prompt_tokens)
        # Nobody waits for a commit: a conflict (another replica won the CAS) or a dropped
        # write only corrects the view.
        expected = ctx.record.epoch if ctx.record is not None else 0
        if ctx.failed_midstream:
            if ctx.record is not None:
                self._state.clear_session_nowait(ctx.session_id, expected)
            return
        if events.outcome != "completed" or usage is None or ctx.served_by is None:
            return
        tokens = usage.prompt_tokens + usage.completion_tokens
        nbytes = kv_bytes(tokens, self._config.kv_bytes_per_token)
        self._state.commit_session_nowait(ctx.session_id, ctx.served_by, tokens, nbytes, expected)


def unknown_model(model: str | None, served: list[str]) -> RouterError:
    """The error for a turn no pool takes: a model no worker serves (404, as vLLM says it), or
    no model named where several are served (400)."""
    if model is None:
        names = ", ".join(served[:8]) + (", ..." if len(served) > 8 else "")
        return RouterError(400, f"model is required: this router serves several ({names})",
                           "model")  # fmt: skip
    return RouterError(404, f"The model `{model[:256]}` does not exist.", "model")


def _for_model(pool: ModelPool | None) -> str:
    return "" if pool is None or pool.model is None else f" for model `{pool.model[:256]}`"


def objective_ms(value: str | None, header: str, default: float) -> float:
    """A per-turn objective from its header: a finite number of milliseconds, above 0 and at
    most `MAX_OBJECTIVE_MS`; the default without the header; 400 naming the header else."""
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        parsed = math.nan
    if not 0.0 < parsed <= MAX_OBJECTIVE_MS:  # NaN and infinities too
        raise RouterError(
            400, f"{header} must be a number of milliseconds above 0 and at most "
            f"{MAX_OBJECTIVE_MS:.0f}, got {value[:32]!r}", header,
        )  # fmt: skip
    return parsed
