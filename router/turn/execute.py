"""Carry out a placement decision: one leg, or a handoff's or migration's two legs."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable

from policies.plan import Plan, Transfer, kv_bytes, tokens_to_move
from policies.types import Decision, Reject, hold_of
from router.config import RouterConfig
from router.engines import leg_body, sglang, vllm
from router.errors import RouterError
from router.http import Response, UpstreamConnectError, UpstreamError, UpstreamTimeout
from router.obs.events import StageClock
from router.state.shared import Reservation, SharedState
from router.turn.legs import KvPullFailed, LegRunner, TurnContext, WorkerUnreachable, failure_kind
from router.turn.relay import answer_usage

log = logging.getLogger("router.turn.execute")


class Executor:
    def __init__(
        self, config: RouterConfig, legs: LegRunner, state: SharedState, clock: StageClock
    ) -> None:
        self._config = config
        self._legs = legs
        self._pool = legs.pool
        self._state = state
        self._clock = clock
        self._rng = random.Random()
        self._drains: set[asyncio.Future[Response | Exception | None]] = set()

    async def execute(self, ctx: TurnContext, decision: Decision, plan: Plan) -> Response | None:
        """Carry out `plan`, what `decision` became: its legs, and its transfer's reservation."""
        if plan.answering_worker is None:
            reason = decision.reason if isinstance(decision, Reject) else ""
            retry_after = decision.retry_after_s if isinstance(decision, Reject) else None
            raise RouterError(
                429, f"turn rejected: {reason or 'no placement meets its objectives'}",
                retry_after_s=retry_after,
            )  # fmt: skip
        hold = hold_of(decision, ctx.turn.objectives.ttft_ms)
        if hold > 0.0:
            # The prefill worker's streams end meanwhile; a client gone now cancels this.
            await asyncio.sleep(hold)
            ctx.events.released = self._clock.now()
        workers = self._pool.workers
        for worker_id in (plan.prefill_worker, plan.answering_worker, plan.refused_link_worker):
            if worker_id is not None and worker_id not in workers:
                # it left the fleet, drained and was forgotten while the turn was held
                raise WorkerUnreachable(worker_id, "it left the fleet")
        transfer = plan.transfer
        if transfer is None or plan.prefill_worker is None:
            return await self._single(ctx, plan.answering_worker)
        reservation = await self._reserve(transfer)
        if reservation is None and plan.refused_link_worker is not None:
            # The link is busy with latency-critical handoffs: defer the migration this turn.
            ctx.events.action = "colocate"
            ctx.events.decode_worker = plan.refused_link_worker
            return await self._single(ctx, plan.refused_link_worker)
        return await self._handoff(ctx, plan.prefill_worker, plan.answering_worker, reservation)

    async def _reserve(self, transfer: Transfer) -> Reservation | None:
        src, dst = transfer.source, transfer.destination
        try:
            return await self._state.reserve(src, dst, transfer.bytes, transfer.kind)
        except Exception:  # the ledger is advisory: never fail a turn on it
            log.warning("link reservation %s->%s failed", src, dst, exc_info=True)
            return None

    def _single(self, ctx: TurnContext, worker_id: str) -> Awaitable[Response | None]:
        ctx.served_by = worker_id
        ctx.events.prefill_start = self._clock.now()
        return self._legs.relay(ctx, worker_id, ctx.client_payload())

    # -- vLLM NIXL: prefill leg, then the decode leg pulls the KV ---------------------------
    async def _handoff(
        self, ctx: TurnContext, prefill: str, decode: str, reservation: Reservation | None
    ) -> Response | None:
        transfer = _Transfer(self, self._state, self._clock, ctx, reservation)
        try:
            if self._pool.workers[prefill].spec.engine == "sglang":
                return await self._handoff_sglang(ctx, prefill, decode, transfer)
            return await self._handoff_vllm(ctx, prefill, decode, transfer)
        finally:
            transfer.release()  # a turn that ended early, however: the reservation goes back

    async def _handoff_vllm(
        self, ctx: TurnContext, prefill: str, decode: str, transfer: _Transfer
    ) -> Response | None:
        events = ctx.events
        events.prefill_start = self._clock.now()
        status, raw = await self._prefill_leg(ctx, prefill)
        if 400 <= status < 500:  # the worker refused the request itself: the client's problem
            return Response(status, raw, ctx.echo())
        reply = vllm.parse_prefill_reply(raw) if status == 200 else None
        events.prefill_end = self._clock.now()
        if reply is not None:
            events.prefill_cached_tokens = reply.cached_tokens
        params = reply.kv_transfer_params if reply is not None else None
        if params is None:
            # No KV to pull (EOS as first token, or the prefill failed): the decode worker
            # prefills the whole prompt itself.
            events.recomputed_tokens = ctx.turn.prompt_tokens
        drop_first = False
        if self._config.first_token == "prefill" and ctx.fields.stream and reply and params:
            writer = await self._legs.prepare(ctx)
            await writer.write(vllm.first_token_frames(reply, ctx.chat))
            events.first_token = self._clock.now()
            drop_first = True
        decode_body = vllm.decode_leg(ctx.body(), params)
        if ctx.fields.stream and not ctx.fields.wants_usage:
            decode_body = leg_body.with_usage_requested(decode_body)
        events.transfer_start = self._clock.now()
        ctx.served_by = decode
        try:
            response = await self._legs.relay(
                ctx, decode, leg_body.encode_body(decode_body), drop_first, transfer.arrived,
                brings_kv=params is not None, pull_may_fail=params is not None,
            )  # fmt: skip
        except (WorkerUnreachable, KvPullFailed):
            transfer.release()
            return await self._decode_fallback(ctx, decode, drop_first)
        self._finish_transfer(ctx, transfer)
        return response

    async def _prefill_leg(self, ctx: TurnContext, prefill: str) -> tuple[int, bytes]:
        """(status, body) of the prefill leg; a 5xx or broken answer reads as (502, b""). A
        refused connection or a missed deadline (its answer is due by the turn's first-byte
        deadline) raises as `LegRunner.unanswered` says: the turn goes elsewhere, or fails."""
        legs = self._legs
        payload = leg_body.encode_body(vllm.prefill_leg(ctx.body()))
        with legs.inflight(prefill):
            try:
                upstream = await legs.send(ctx, prefill, payload, first_token_leg=True)
                try:
                    raw = await upstream.read()
                except BaseException:
                    upstream.close()
                    raise
            except UpstreamError as exc:
                connect = isinstance(exc, UpstreamConnectError)
                legs.on_upstream_error(prefill, failure_kind(exc, "connect" if connect
                                                             else "prefill_leg"))  # fmt: skip
                if connect or isinstance(exc, UpstreamTimeout):
                    raise legs.unanswered(ctx, prefill, exc) from exc
                return 502, b""
        if upstream.status >= 500:
            legs.on_upstream_error(prefill, f"http_{upstream.status}")
            return 502, b""
        legs.succeeded(prefill)
        return upstream.status, raw

    def _finish_transfer(self, ctx: TurnContext, transfer: _Transfer) -> None:
        """The transfer's stage fields once the decode leg is done (exact bytes where the usage
        says); the reservation goes back now unless the first token gave it back already."""
        events = ctx.events
        first = transfer.arrived_at or events.first_token or self._clock.now()
        nbytes, seconds = self.moved(ctx, first)
        events.transferred_bytes = nbytes
        events.transfer_end = (events.transfer_start or first) + seconds
        transfer.release(nbytes, seconds)

    def moved(self, ctx: TurnContext, first: float) -> tuple[int, float]:
        """(bytes, seconds) the decode leg's KV pull took, up to its first token at `first`.

        Engines do not say what one pull moved: the bytes are everything the decode worker did
        not already hold as this session's resident prefix, and the seconds what its engine's
        own pull counters measure per byte (`router.fleet.pulls`); before that worker's first
        measured pull, the decode leg's wait for its first token."""
        events = ctx.events
        start = events.transfer_start or first
        waited = first - start if first > start else 0.0
        if events.recomputed_tokens:
            return 0, waited
        prompt = ctx.usage.prompt_tokens if ctx.usage else ctx.turn.prompt_tokens
        residency = ctx.record.to_residency() if ctx.record is not None else None
        decode = ctx.served_by or ""
        moved = tokens_to_move(prompt, residency, decode)
        nbytes = kv_bytes(moved, self._config.kv_bytes_per_token)
        state = self._pool.workers.get(decode)
        measured = state.pulls.seconds_for(nbytes) if state is not None else None
        return nbytes, waited if measured is None else measured

    async def _decode_fallback(
        self, ctx: TurnContext, failed: str, drop_first: bool
    ) -> Response | None:
        """The decode leg failed after the prefill succeeded: prefill locally on another
        decode-capable worker (counted as recomputed). The relay reported the failure."""
        members = ctx.pool.members if ctx.pool is not None else self._pool.workers.values()
        candidates = [
            state.spec.worker_id for state in members
            if state.spec.worker_id != failed and state.serving and not state.draining
            and state.spec.role in ("decode", "mixed")
        ]  # fmt: skip
        if not candidates:
            raise RouterError(503, "no healthy decode worker left for this turn", retry_after_s=1)
        target = min(candidates, key=lambda w: (self._pool.workers[w].inflight, w))
        ctx.events.retried = True
        ctx.events.recomputed_tokens = ctx.turn.prompt_tokens
        ctx.events.decode_worker = target
        ctx.served_by = target
        return await self._legs.relay(ctx, target, ctx.client_payload(), drop_first)

    # -- SGLang bootstrap: both legs at once, the prefill answer drained for its usage -----
    async def _handoff_sglang(
        self, ctx: TurnContext, prefill: str, decode: str, transfer: _Transfer
    ) -> Response | None:
        spec = self._pool.workers[prefill].spec
        body = ctx.body()
        if ctx.fields.stream and not ctx.fields.wants_usage:
            body = leg_body.with_usage_requested(body)
        prefill_body, decode_body = sglang.legs(body, sglang.bootstrap_host(spec.base_url),
                                                spec.bootstrap_port, self._rng)  # fmt: skip
        ctx.events.prefill_start = ctx.events.transfer_start = self._clock.now()
        drain = asyncio.ensure_future(self._drain(prefill, ctx, leg_body.encode_body(prefill_body)))
        self._drains.add(drain)
        drain.add_done_callback(self._drains.discard)
        ctx.served_by = decode
        relay = asyncio.ensure_future(self._legs.relay(
            ctx, decode, leg_body.encode_body(decode_body), on_first_token=transfer.arrived,
            brings_kv=True,
        ))  # fmt: skip
        try:
            await asyncio.wait((drain, relay), return_when=asyncio.FIRST_COMPLETED)
            failure = drain.result() if drain.done() and not relay.done() else None
            if failure is not None and not ctx.writer.started and relay.cancel():
                # The decode server would wait for KV that never comes until its bootstrap
                # times out: the prefill server's failure is the client's answer at once, as
                # SGLang's own router gives it.
                await asyncio.wait((relay,))
                if relay.cancelled():
                    ctx.served_by = prefill
                    ctx.events.error = f"prefill worker {prefill} failed"
                    if isinstance(failure, Exception):
                        raise failure
                    return failure
            response = await relay
        except BaseException:
            drain.cancel()
            relay.cancel()
            raise
        ctx.events.prefill_end = self._clock.now()
        self._finish_transfer(ctx, transfer)
        return response

    async def _drain(
        self, worker_id: str, ctx: TurnContext, payload: bytes
    ) -> Response | Exception | None:
        """The prefill leg, read to its end for what its usage says was cached. Its failure
        for the client: the prefill server's error answer, or what a refused or timed-out leg
        raises (`LegRunner.unanswered`); None once it answered 200, even if its body broke off
        after (the KV may be on its way: the decode leg decides)."""
        legs = self._legs
        with legs.inflight(worker_id):
            try:
                upstream = await legs.send(ctx, worker_id, payload, first_token_leg=True)
            except UpstreamError as exc:
                connect = isinstance(exc, UpstreamConnectError)
                legs.on_upstream_error(worker_id, failure_kind(exc, "connect" if connect
                                                              else "prefill_leg"))  # fmt: skip
                return legs.unanswered(ctx, worker_id, exc)
            try:
                raw = await upstream.read()
            except UpstreamError as exc:
                legs.on_upstream_error(worker_id, failure_kind(exc, "prefill_leg"))
                return None
            except BaseException:
                upstream.close()
                raise
        if upstream.status != 200:
            content_type = upstream.headers.get("content-type", "application/json")
            return legs.error_answer(ctx, worker_id, upstream.status, raw, content_type)
        legs.succeeded(worker_id)
        usage = answer_usage(raw)
        if usage is not None:
            ctx.events.prefill_cached_tokens = usage.reported_cached_tokens
        return None


class _Transfer:
    """A handoff's link reservation, given back once: at the decode leg's first token, which
    shows the KV has arrived (from then on its bytes load the link no more, however long the
    answer decodes), else when the turn ends or fails."""

    __slots__ = ("_clock", "_ctx", "_executor", "_state", "arrived_at", "reservation")

    def __init__(
        self, executor: Executor, state: SharedState, clock: StageClock, ctx: TurnContext,
        reservation: Reservation | None,
    ) -> None:  # fmt: skip
        self._executor, self._state, self._clock, self._ctx = executor, state, clock, ctx
        self.reservation = reservation
        self.arrived_at: float | None = None

    def arrived(self) -> None:
        """The decode leg's first token: the reservation goes back with what the pull took."""
        if self.arrived_at is None:
            self.arrived_at = now = self._clock.now()
            self.release(*self._executor.moved(self._ctx, now))

    def release(self, nbytes: int = 0, seconds: float = 0.0) -> None:
        reservation, self.reservation = self.reservation, None
        if reservation is None:
            return
        try:
            self._state.release(reservation, nbytes, seconds)
        except Exception:  # the ledger is advisory: never fail a turn on it (the lease ends it)
            log.warning("releasing link reservation %s failed", reservation.id, exc_info=True)
