"""The simulated router: the live proxy's turn path (`router.turn.pipeline`, `router.turn.execute`)
in virtual time, in front of the simulated cluster.

Per turn: build the `Turn` and the `ClusterView` as the proxy does (worker load from the last
scrape, fleet in-flight counts now, the link ledger, the session's residency), ask the policy,
execute the action with the live semantics, then commit the residency and feed the outcome
back (`StageEvents.to_outcome`, the proxy's own helper). Each leg the router sends reaches its
worker `router_overhead_s` later and asks for `ignore_eos`, as the replay's requests do. The
router knows a prompt's exact token count (the live one estimates chat text until usage
calibrates it). Execution:
- colocate / recompute: one request on the worker (recompute counts the resident tokens);
- handoff: a handoff reservation of prompt x KV bytes; the prefill leg (max_tokens 1, blocks
  held); then the decode leg, whose worker pulls what its prefix cache lacks over the fabric,
  frees the held blocks and decodes; `first_token` "prefill" streams the prefill leg's token
  at once and drops the decode leg's first one; the reservation is released when the pull
  ends, or when the decode leg goes out with nothing to pull (as the live router releases it
  at the decode leg's first token: from then on the bytes load the link no more, however
  long the answer decodes), with the pull's bytes and seconds (the link's observed rate
  learns from them);
- migrate: a migration reservation of the resident bytes; admitted, it runs as a handoff from
  the source; deferred, as a colocate on the source;
- reject: 429 at once.
"""

from __future__ import annotations

import traceback

from bench.des.cluster import Cluster, Leg
from bench.des.config import SimConfig
from bench.des.ledger import LinkLedger, router_links
from bench.des.loop import EventLoop
from bench.des.results import PolicyError, PolicyFailure, PolicyStage
from bench.des.turns import DoneCallback, Flight, TurnRequest, engine_priority_sent
from bench.des.views import ViewBuilder
from bench.results.summary import RequestResult, Status, predicted_ttft
from policies.base import Policy
from policies.plan import kv_bytes, plan_turn
from policies.types import (
    Decision,
    Objectives,
    Residency,
    Turn,
    WorkerView,
    hold_of,
    idle_link_bps,
)
from router.obs.events import StageEvents
from sim.engine.engine import EngineRequest, RequestStats
from sim.engine.kvcache import extend_block_hashes


class SimRouter:
    def __init__(
        self, config: SimConfig, policy_name: str, policy: Policy, cluster: Cluster,
        loop: EventLoop, on_done: DoneCallback,
    ) -> None:  # fmt: skip
        self._config = config
        self._policy_name = policy_name
        self._policy = policy
        self._cluster = cluster
        self._loop = loop
        self._clock = loop.clock
        self._on_done = on_done
        self._ids = config.worker_ids
        self._index = {worker_id: i for i, worker_id in enumerate(self._ids)}
        self._overhead = config.router_overhead_s
        self._kv_bytes = cluster.kv_bytes_per_token
        self._block_size = cluster.deployment.block_size
        self._prefill_first = config.first_token == "prefill"
        self._objectives = config.objectives
        rate = config.nic_gbps * 1e9 / 8  # every NIC is alike
        nics = {
            wid: WorkerView(worker_id=wid, role=role, healthy=True, nic_bps=rate)
            for wid, role in zip(config.worker_ids, config.roles, strict=True)
        }
        self._ledger = LinkLedger(
            router_links(config.worker_ids, config.roles, rate),
            config.reservation_lease_s,
            config.ewma_alpha,
            implied=lambda src, dst: idle_link_bps(nics.get(src), nics.get(dst)),
        )
        self.views = ViewBuilder(config, cluster, self._ledger)
        # session -> (residency or None, epoch, last commit time)
        self._sessions: dict[str, tuple[Residency | None, int, float]] = {}

    def start(self) -> None:
        self.views.start(self._loop)

    # -- admission and decision -----------------------------------------------------------
    def handle(self, req: TurnRequest) -> None:
        now = self._clock.now()
        req.sent_at = now
        events = StageEvents(request_id=req.request_id, session_id=req.session_id, admitted=now,
                             first_token_convention=self._config.first_token)  # fmt: skip
        residency = self._residency(req.session_id, now)
        prompt_tokens = len(req.prompt)
        uncached = prompt_tokens if residency is None else max(1, prompt_tokens - residency.tokens)
        objectives = self._objectives
        ttft = req.ttft_slo_ms
        if ttft is None:
            ttft = objectives.ttft_base_ms + objectives.ttft_per_prompt_token_ms * prompt_tokens
        itl = objectives.itl_ms if req.itl_slo_ms is None else req.itl_slo_ms
        turn = Turn(session_id=req.session_id, request_id=req.request_id,
                    prompt_tokens=prompt_tokens, uncached_tokens=uncached,
                    max_tokens=req.max_tokens, objectives=Objectives(ttft_ms=ttft, itl_ms=itl),
                    arrival_s=now)  # fmt: skip
        view = self.views.view(residency, now)
        try:
            decision = self._policy.decide(turn, view)
        except Exception as exc:
            raise self._failure("decide", req, exc) from exc
        plan = plan_turn(decision, prompt_tokens, residency, self._kv_bytes)
        events.record_decision(self._policy_name, decision, plan, now)
        # As the live router, though at the decision: it records them once the turn ends.
        events.record_placement_load(view)
        priority = engine_priority_sent(decision, now, self._config.scheduling_policy)
        flight = Flight(req, turn, residency, events, priority, plan)
        hold = hold_of(decision, turn.objectives.ttft_ms)
        if hold > 0.0:
            # As the live router: the turn waits in the router, then goes out as decided.
            events.released = now + hold
            self._loop.at(now + hold, self._release_held, (flight, decision))
        else:
            self._execute(flight, decision)

    def _release_held(self, held: tuple[Flight, Decision]) -> None:
        self._execute(*held)

    def _execute(self, flight: Flight, decision: Decision) -> None:
        now = self._clock.now()
        plan = flight.plan
        if plan.answering_worker is None:
            reason = decision.reason or "no placement meets its objectives"
            self._end(flight, "rejected", 429, f"turn rejected: {reason}", now)
            return
        answering = self._worker(flight, plan.answering_worker)
        transfer = plan.transfer
        if transfer is None or plan.prefill_worker is None:
            self._single(flight, answering, now)
            return
        prefill = self._worker(flight, plan.prefill_worker)
        flight.reservation = self._ledger.reserve(
            transfer.source, transfer.destination, transfer.bytes, transfer.kind, now
        )
        if flight.reservation is None and plan.refused_link_worker is not None:
            # The link is busy with latency-critical handoffs: defer the migration.
            flight.events.action = "colocate"
            flight.events.decode_worker = plan.refused_link_worker
            self._single(flight, prefill, now)
        else:
            self._handoff(flight, prefill, answering, now)

    def _worker(self, flight: Flight, worker_id: str) -> int:
        index = self._index.get(worker_id)
        if index is None:
            known = ", ".join(self._ids)
            error = ValueError(f"the decision names worker {worker_id!r}, not in the cluster "
                               f"({known})")  # fmt: skip
            raise self._failure("decision", flight.req, error)
        return index

    # -- one leg ----------------------------------------------------------------------------
    def _single(self, flight: Flight, worker: int, now: float) -> None:
        flight.served_by = worker
        flight.events.prefill_start = now
        self.views.sent(worker)
        leg = Leg(flight, worker, self._single_done, flight.req.keep_answer)
        self._loop.at(now + self._overhead, self._send_single, leg)

    def _send_single(self, leg: Leg) -> None:
        self._submit(leg, leg.owner.req.max_tokens, 0, hold=False)

    def _single_done(self, leg: Leg, reason: str, stats: RequestStats, now: float) -> None:
        self.views.ended(leg)
        self._complete(leg.owner, leg.chunks, leg.tokens, stats, now)

    def _submit(self, leg: Leg, max_tokens: int, preload: int, hold: bool) -> bool:
        """Send the leg's request to its worker now; on a 400 the turn ends as an error."""
        flight: Flight = leg.owner
        req = flight.req
        request = EngineRequest(
            request_id=self._cluster.new_engine_id(req.request_id),
            prompt_token_ids=req.prompt, max_tokens=max_tokens,
            arrival_time=self._clock.now(), ignore_eos=True, hold_blocks_on_finish=hold,
            preloaded_tokens=preload, block_hashes=self._block_hashes(req),
            priority=flight.priority,
        )  # fmt: skip
        problem = self._cluster.submit(leg, request)
        if problem is None:
            return True
        self.views.ended(leg)
        self._release(flight, 0, 0.0)
        self._end(flight, "error", 400, problem, self._clock.now())
        return False

    def _block_hashes(self, req: TurnRequest) -> list[int]:
        """The prompt's KV block hashes, computed at its first leg and shared by the rest."""
        size = self._block_size
        extend_block_hashes(req.prompt, req.block_hashes, size, len(req.prompt) // size)
        return req.block_hashes

    # -- handoff and migration ----------------------------------------------------------------
    def _handoff(self, flight: Flight, prefill: int, decode: int, now: float) -> None:
        flight.decode = decode
        flight.events.prefill_start = now
        self.views.sent(prefill)
        keep = self._prefill_first and flight.req.keep_answer
        leg = Leg(flight, prefill, self._prefill_done, keep)
        self._loop.at(now + self._overhead, self._send_prefill, leg)

    def _send_prefill(self, leg: Leg) -> None:
        self._submit(leg, 1, 0, hold=True)

    def _prefill_done(self, leg: Leg, reason: str, stats: RequestStats, now: float) -> None:
        flight: Flight = leg.owner
        self.views.ended(leg)
        events = flight.events
        events.prefill_end = now
        events.prefill_cached_tokens = stats.cached_tokens
        if stats.held_blocks:
            flight.held = (leg.worker, leg.engine_id)
            if self._prefill_first:
                flight.first_at = events.first_token = now
                flight.first_token = leg.tokens
        else:  # EOS as the first token: no KV to pull, the decode worker prefills it all
            events.recomputed_tokens = flight.turn.prompt_tokens
        events.transfer_start = now
        decode = flight.decode
        flight.served_by = decode
        self.views.sent(decode)
        decode_leg = Leg(flight, decode, self._decode_done, flight.req.keep_answer)
        if stats.held_blocks:
            self.views.begin(decode_leg)  # it brings its KV: it queues no prefill there
        self._loop.at(now + self._overhead, self._send_decode, decode_leg)

    def _send_decode(self, leg: Leg) -> None:
        flight: Flight = leg.owner
        req = flight.req
        engine = self._cluster.engine(leg.worker)
        held = flight.held
        if held is None or engine.validate(len(req.prompt), req.max_tokens) is not None:
            # nothing to pull: the link is not needed (a 400 ends the turn there)
            start = flight.events.transfer_start
            self._release(flight, 0, self._clock.now() - start if start is not None else 0.0)
            self.views.unbegin(leg)  # it prefills after all: it answers at its first token
            self._submit(leg, req.max_tokens, 0, hold=False)
            return
        held_tokens = self._cluster.held_tokens(*held)
        if held_tokens is None:  # expired before the pull: the worker prefills locally
            flight.reported = (0, 0.0)
            self._release(flight, *flight.reported)
            self.views.unbegin(leg)
            self._submit(leg, req.max_tokens, 0, hold=False)
            return
        hit = engine.cached_prefix_tokens(req.prompt, self._block_hashes(req))
        flight.preload = min(held_tokens, len(req.prompt))
        flight.pull_bytes = kv_bytes(max(0, flight.preload - hit), self._kv_bytes)
        flight.pull_started = self._clock.now()
        self._cluster.transfer(held[0], leg.worker, flight.pull_bytes, self._pulled, leg)

    def _pulled(self, leg: Leg) -> None:
        flight: Flight = leg.owner
        assert flight.held is not None
        flight.reported = (flight.pull_bytes, self._clock.now() - flight.pull_started)
        self._release(flight, *flight.reported)
        self._cluster.release_held(*flight.held)
        self._submit(leg, flight.req.max_tokens, flight.preload, hold=False)

    def _decode_done(self, leg: Leg, reason: str, stats: RequestStats, now: float) -> None:
        flight: Flight = leg.owner
        self.views.ended(leg)
        chunks, answer = leg.chunks, leg.tokens
        if flight.first_at is not None:  # the decode leg's first token is the one already sent
            chunks = [flight.first_at, *chunks[1:]]
            if answer is not None and flight.first_token is not None:
                answer = flight.first_token + answer[1:]
        self._complete(flight, chunks, answer, stats, now)

    def _release(self, flight: Flight, nbytes: int, seconds: float) -> None:
        if flight.reservation is not None:
            self._ledger.release(flight.reservation, nbytes, seconds)
            flight.reservation = None

    # -- the end of a turn --------------------------------------------------------------------
    def _complete(
        self, flight: Flight, chunks: list[float], answer: list[int] | None,
        stats: RequestStats, now: float,
    ) -> None:  # fmt: skip
        events = flight.events
        if chunks:
            if events.first_token is None:
                events.first_token = chunks[0]
            events.last_token = chunks[-1]
        if events.transfer_start is not None:  # a handoff's decode leg: what the pull took
            first = events.first_token if events.first_token is not None else now
            start = events.transfer_start
            events.transfer_end = first
            if flight.reported is not None:
                events.transferred_bytes, seconds = flight.reported
                events.transfer_end = start + seconds
        events.prompt_tokens = stats.prompt_tokens
        events.cached_tokens = stats.cached_tokens
        events.completion_tokens = stats.completion_tokens
        self._commit(flight, stats.prompt_tokens + stats.completion_tokens, now)
        self._end(flight, "completed", 200, "", now, chunks, answer)

    def _commit(self, flight: Flight, tokens: int | None, now: float) -> None:
        """Residency on the worker that served the turn (None: the session lost its state)."""
        session_id = flight.req.session_id
        entry = self._sessions.get(session_id)
        epoch = entry[1] + 1 if entry is not None else 1
        turns = entry[0].turns if entry is not None and entry[0] is not None else 0
        residency = None
        if tokens is not None:
            residency = Residency(worker_id=self._ids[flight.served_by], tokens=tokens,
                                  bytes=tokens * self._kv_bytes, epoch=epoch,
                                  turns=turns + 1)  # fmt: skip
        self._sessions[session_id] = (residency, epoch, now)

    def _residency(self, session_id: str, now: float) -> Residency | None:
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        if now - entry[2] > self._config.session_ttl_s:
            del self._sessions[session_id]
            return None
        return entry[0]

    def _end(
        self, flight: Flight, status: Status, http_status: int, error: str, now: float,
        chunks: list[float] | None = None, answer: list[int] | None = None,
    ) -> None:  # fmt: skip
        events = flight.events
        events.outcome = status
        events.http_status = http_status
        events.error = error or None
        events.done = now
        if status == "error" and flight.first_at is not None and flight.residency is not None:
            self._commit(flight, None, now)  # failed after the first token was streamed
        self._observe(flight)
        req = flight.req
        chunks = chunks or []
        exposed = None
        if events.transfer_start is not None and events.transfer_end is not None:
            exposed = (events.transfer_end - events.transfer_start) * 1000.0
        result = RequestResult(
            request_id=req.request_id, session_id=req.session_id, turn_index=req.turn_index,
            klass=req.klass, policy=self._policy_name, sent_at=req.sent_at,
            first_chunk_at=chunks[0] if chunks else None, chunk_times=chunks, done_at=now,
            status=status, http_status=http_status, error=error,
            prompt_tokens=events.prompt_tokens or len(req.prompt),
            cached_tokens=events.cached_tokens,
            completion_tokens=events.completion_tokens if status == "completed" else len(chunks),
            ttft_slo_ms=req.ttft_slo_ms, itl_slo_ms=req.itl_slo_ms, action=events.action,
            recomputed_tokens=events.recomputed_tokens,
            transferred_bytes=events.transferred_bytes,
            exposed_transfer_ms=exposed,
            predicted_ttft_ms=predicted_ttft(events.predicted),
        )  # fmt: skip
        self._on_done(req, result, answer)

    def _observe(self, flight: Flight) -> None:
        try:
            self._policy.observe(flight.events.to_outcome())
        except Exception as exc:
            raise self._failure("observe", flight.req, exc) from exc

    def _failure(self, stage: PolicyStage, req: TurnRequest, exc: Exception) -> PolicyError:
        return PolicyError(
            PolicyFailure(
                policy=self._policy_name, stage=stage, request_id=req.request_id,
                session_id=req.session_id, time_s=self._clock.now(),
                error=f"{type(exc).__name__}: {exc}",
                traceback="".join(traceback.format_exception(exc)) if exc.__traceback__ else "",
            )
        )  # fmt: skip
