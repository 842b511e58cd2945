"""What each placement of one turn would cost: the terms of I > H + dQ + dC (each a
`policies.adaptive.candidates.Candidate`; each worker's terms are computed in
`policies.adaptive.terms`, the constants named here are in `policies.adaptive.tuning`).

A turn counts toward goodput when its TTFT meets its objective and the p99 of its own gaps
meets its ITL objective, so the terms are weighed in expected objective misses; the ms that
cause them are kept too (they are what `Prediction` reports).

Notation, for a turn of P prompt tokens of which U are not cached on the resident worker
(C = P - U cached there; S = the shared prefix a fresh session finds cached anywhere, as
learned by policies.costmodel.estimates), answering G tokens; B(g) = max(1, (g - 1) / 100), the
gaps of a g-token answer that may exceed the ITL objective while the p99 of its gaps meets it:

- queue(w) = max(estimates.queue_wait_ms(q), slot, A): q = waiting + max(0, inflight -
  running - waiting), the requests queued at w plus the in-flight ones its last scrape has not
  counted; slot = the wait for room there (`slot_wait_ms`): one of the engine's `max_seqs`
  sequence slots and the KV the turn adds, behind the decode legs of split turns this policy
  placed on w and not sent yet (`LegLedger`: no count of the view holds them); A = the
  prefill work this policy placed on w and not yet done (`WorkLedger`, settled by the
  scrapes; in the compute roof's ms: batched steps pay overhead and weights once).
- a local prefill of n new tokens after c cached on worker w with R decode streams (none on
  a "prefill" worker; R = the scrape's running, or the router's legs there less the scrape's
  queue where more, less the split turns' prefill legs running there (`StreamLedger`: the
  engine counts them running, yet none decodes there), at most `max_seqs`: a scrape may be
  an interval old), in k chunks; step =
  a decode step of the R streams alone, fused = the prefill's k steps fused with theirs (see
  policies.costmodel.estimates), J = the others' prefill work in each step it joins: max(A / k,
  u x step / (1 - u)), u = the share of w's time the prefills placed there recently take
  (`WorkLedger.utilisation`: those arriving while a step runs join the next one):
      compute = prefill(n, c) on w alone,  own wait = fused - compute,
      harm ms = R x k x max(0, fused / k + J - max(step, itl))   (stall past their slack),
      harm    = R x s / B(mean answer length observed), s = k when fused / k > itl, else
                fused / itl x P(N >= ceil((itl - fused / k) / T)), N Poisson with mean J / T,
                T = the typical prefill (`Estimates.typical_prefill_ms`): the others'
                prefills join the step at random, and it is slow when more of them come than
                fit beside this one within the objective:
  each slow step spends one gap of every stream's budget, where T is within the ITL
  objective: the streams' slow steps are then prefills joining one step, which no ledger
  counts. Where T is a slow step itself, the streams' slow steps are the prefills this policy
  placed (`StallLedger`), and a stream misses only once they pass the gaps it may have slow;
  what they spend of its budget is denied to the prefills to come (`stream_harm`):
      harm    = R x (W x P(N <= b < N + s) + (1 - W) x s / B), W = `CROSSING_WEIGHT`,
                N Poisson with mean = the slow steps placed on w per second x a mean
                answer's life there (its gaps x the step at R + 1 streams), b = floor((g -
                2) / 100) for g = the mean answer (more and the p99 of its gaps fails; a
                fractional s interpolates)
  (the share alone puts long prefills on a few workers, whose queues then run first tokens
  late; the crossings alone pile prefills beside calm streams until they all cross together).
  This turn's objectives stand in for the streams' (the view has no other). C is the prefix
  the worker holds: the resident's cached tokens, the prompt of the session's last split
  turn on the worker that prefilled it, else S.
- exposure: the turn decodes on d for G - 1 gaps of a step at R' + 1 streams (R' = R and the
  decode legs on their way there, `LegLedger`), while d runs slow steps at the rate its
  recent placements set (`StallLedger`), and adds the KV it lacks there, after the KV those
  legs bring at their peak past what d's streams free before they come (`kv_crowding`:
  misses as the cache nears full):
      exposure = rate(d) x ((G - 1) x step + wait) / B(G) + crowding(d),
  wait = a whole turn's TTFT on d (its queue and its prefill there; 0 for a handoff's decode
  leg): the prefills placed on d while it waits queue behind it and run as it decodes;
  where the turn's own prefill on d is slow (a whole turn), d becomes a host of slow
  prefills: rate(d) is at least the mean rate of the workers hosting them lately; where d's
  streams with the answer exceed the calmest other prefill-capable worker's (of at least
  two) by B(mean answer) > 1 and the typical prefill is slow, the harm bound keeps new
  sessions' prefills off d: of the answer's time past the prefill work placed on d (A),
  only the share c of turns continuing a session counts, (G - 1) x step -> A + c x rest.
- eviction: the KV a candidate fills on each worker w (a whole turn: P - C + G there; a
  handoff: P - C on p, the tokens d lacks + G on d) comes out of live contexts at the share
  L(w) = c x exp(-turnover / gap), turnover = (1 - kv_usage) x capacity / the rate this
  policy fills w, gap = the mean gap between a session's turns (`policies.adaptive.ledgers.cache`);
  each evicted token costs what this turn's whole prompt prefilled again would, per token,
  on the fleet's decode-capable workers on average (where the sessions it evicts live is not
  known): (harm + `TTFT_WEIGHT` x (1 + `WORK_WEIGHT`) x compute / objective) / P.
- TTFT risk: 0 up to `RISK_FROM` x the objective, rising linearly to 1 at the objective.
- H(src, dst, bytes, start) = latency + bytes / available (`TurnTerms.transfer_ms`),
  available = max(`LINK_FLOOR_FRACTION` x rate, rate - max(0, bytes in flight + reserved
  bytes - rate x start) / horizon): what the ledger holds drains at the link's rate until the
  transfer starts (when the prefill ends); rate = the link's capacity (else its observed
  rate, else `default_link_bps`), capped by the rate this policy has measured on it.

Candidates, each with ttft = queue + compute + own wait + H (decode-side terms included):
- whole turn on w (colocate on the resident, else recompute there; colocate for a new
  session): n = U after C on the resident, P - S after S elsewhere; queue(w).
- handoff p -> d: prefill on p as above, move the tokens d lacks ((P - C) x kv bytes when d is
  resident, else (P - S) x kv), then one decode step on d with its R' + 1 streams;
  queue = queue(p) + max(slot(d), queue(d) - (the time until the KV arrives), base): d's
  queue drains meanwhile, but a full worker stays full as turns keep coming (its slot wait
  stays), and the decode leg, a request of its own, waits at least the base
  (`Estimates.base_ms`) however idle d is.
- migrate r -> d: as the router runs it, a handoff from the resident r.
- held (a whole turn on w, or a handoff from w, whose prefill harms the R streams on w, each
  of them a request this policy placed there, `StreamLedger`): the router holds the turn
  until they are done, hold = (the last one's predicted end - now) + one decode step, at most
  `max_hold_s`; its queue is max(queue(w), hold); the answers this policy places on w
  meanwhile (at its recent rate a, `StreamLedger`) are beside it then: harm x min(1, a x hold
  / R), and no own wait. An answer placed on w while prefills are held for it meets their
  slow steps where its decode overlaps their run: exposure + those steps / B(G).

misses = harm + exposure + eviction + TTFT risk; cost = misses + `TTFT_WEIGHT` x ((ttft +
`WORK_WEIGHT` x compute) / objective + pace), pace = max(0, 1 - the answer's decode step at R'
+ 1 streams on d over the ITL objective): where nothing is at risk, the faster and cheaper
placement wins (GPU time spent is time the turns queued behind it wait), and the decode worker
the answer fills best (answers packed on a few workers keep the others free for prefills;
`TurnTerms.pace`). Where the typical prefill is a slow step, a new session's headroom weighs
`PACKING_MISSES` misses (pace x `PACKING_MISSES` / `TTFT_WEIGHT`; 1, none credited, past a
step of `PACK_UP_TO` x the ITL objective): a stream keeps the slow prefills off its worker for
its life, which a first step a few ms shorter does not pay for. Against
the colocated reference r, a candidate c wins exactly when I > H + dQ + dC, with I = (harm +
exposure + eviction)(r) - (the same)(c), the misses its separation avoids, and H + dQ + dC =
(cost - harm - exposure - eviction)(c) - (the same)(r), what its transfer, queue, compute and
pace add.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from policies.adaptive import tuning
from policies.adaptive.candidates import Candidate, PrefillTerms, costs
from policies.adaptive.ledgers.cache import CacheLedger, Fill
from policies.adaptive.ledgers.legs import LegLedger
from policies.adaptive.ledgers.legs import StallLedger as StallLedger
from policies.adaptive.ledgers.legs import slow_gap_budget as slow_gap_budget
from policies.adaptive.ledgers.streams import StreamLedger
from policies.adaptive.ledgers.work import WorkLedger
from policies.adaptive.terms import TurnTerms
from policies.costmodel.estimates import Estimates, PrefillLeg
from policies.eligibility import DECODE_ROLES, can_serve
from policies.types import Action, ClusterView, LinkView, Turn, WorkerView

Hold = tuple[float, PrefillTerms]  # a hold's ms, and the held prefill's terms
Floor = tuple[float, float, float, float]  # `Scorer.handoff_floor`: TTFT, harm, exposure, cost


class Scorer(TurnTerms):
    """Costs candidates for one turn against one view, from the terms they share
    (`TurnTerms`: each worker's, computed once). Without a ledger, what it would hold counts
    nothing; `max_seqs` 0: no sequence cap; `continuing`: the share of turns continuing a
    session (`policies.adaptive.admission.Admission`); `refill`: the workers whose mean
    prices an evicted context prefilled again (None: every decode-capable one)."""

    __slots__ = (
        "_cache",
        "_done",
        "_holds",
        "_max_hold_ms",
        "_refill",
        "_refilled",
        "_shares",
    )

    def __init__(
        self,
        turn: Turn,
        view: ClusterView,
        estimates: Estimates,
        *,
        links: Mapping[tuple[str, str], LinkView],
        horizon_s: float,
        default_bps: float,
        stalls: StallLedger | None = None,
        prefix: tuple[str, int] | None = None,
        work: WorkLedger | None = None,
        max_seqs: int = 0,
        legs: LegLedger | None = None,
        continuing: float = 1.0,
        done: StreamLedger | None = None,
        max_hold_s: float = 0.0,
        cache: CacheLedger | None = None,
        index: Mapping[str, WorkerView] | None = None,
        host_fresh_s: float = 0.0,
        refill: Sequence[WorkerView] | None = None,
        prefill_streams: list[tuple[int, str]] | None = None,
    ) -> None:
        super().__init__(
            turn,
            view,
            estimates,
            links=links,
            horizon_s=horizon_s,
            default_bps=default_bps,
            stalls=stalls,
            prefix=prefix,
            work=work,
            max_seqs=max_seqs,
            legs=legs,
            continuing=continuing,
            index=index,
            host_fresh_s=host_fresh_s,
            prefill_streams=prefill_streams,
        )
        self._cache = cache
        self._refilled = refill
        self._refill: float | None = None
        self._shares: dict[str, float] = {}  # per worker, once per turn
        self._done = done
        self._max_hold_ms = max_hold_s * 1000.0
        self._holds: dict[str, Hold | None] = {}

    def _prefill_legs(self, worker_id: str) -> int:
        """The split turns' prefill legs this policy placed on the worker that still run
        there (`StreamLedger.prefill_legs`; `streams` asks once per worker)."""
        done = self._done
        if done is None:
            return 0
        return done.prefill_legs(worker_id, self._now_s, self._request_id)

    def whole(self, worker: WorkerView, held: Hold | None = None) -> Candidate:
        """Prefill and decode on `worker`: colocate where the state is (or none is), else
        recompute; `held`: once the requests running there are done (`hold`)."""
        wid = worker.worker_id
        prefill = self._prefill_on(worker)
        queue = self.queue_ms(worker)
        hold = 0.0
        if held is not None:
            hold, prefill = held
            queue = hold if hold > queue else queue
        action: Action = "colocate"
        if self._resident is not None and wid != self._resident:
            action = "recompute"
        first = queue + prefill.compute_ms + prefill.own_wait_ms
        decode = self._own_gaps * self._answer_step(worker)
        exposure = self.exposure(worker, hosting=prefill.slow_steps > 0, waiting_ms=first)
        fills = ((wid, self.filled_whole(worker)),)
        return Candidate(
            action,
            (wid,),
            self._objective_ms,
            queue_ms=queue,
            compute_ms=prefill.compute_ms,
            own_wait_ms=prefill.own_wait_ms,
            harm_ms=prefill.harm_ms,
            harm=prefill.harm,
            exposure=exposure + self._held_exposure(wid, first, decode),
            slow_steps=prefill.slow_steps,
            leg=prefill.leg,
            work_ms=prefill.work_ms,
            pace=self.pace(worker),
            hold_ms=hold,
            decode_ms=decode,
            fills=fills,
            eviction=self.eviction(fills),
        )

    def handoff(
        self, prefill: WorkerView, decode: WorkerView, action: Action = "handoff",
        held: Hold | None = None,
    ) -> Candidate:  # fmt: skip
        """Prefill on `prefill`, move the KV `decode` lacks, decode there (a migration from
        the resident runs exactly so); `held`: the prefill once the requests running on
        `prefill` are done (`hold`)."""
        local = self._prefill_on(prefill)
        queue = self.queue_ms(prefill)
        hold = 0.0
        if held is not None:
            hold, local = held
            queue = hold if hold > queue else queue
        receiver = self._decode_on(decode)
        lacking = receiver.lacking
        sent = queue + local.compute_ms + local.own_wait_ms
        nbytes = lacking * self._kv_bytes
        transfer = self.transfer_ms(prefill.worker_id, decode.worker_id, nbytes, sent)
        ready = sent + transfer
        decode_queue = receiver.queue_ms - ready
        slot = receiver.slot_ms
        decode_queue = slot if slot > decode_queue else decode_queue
        # The decode leg is a request of its own, sent once the prefill leg answered: it
        # waits at least what any request waits besides its steps (the fit's base).
        base = self._estimates.base_ms
        decode_queue = base if base > decode_queue else decode_queue
        waited = decode_queue if decode_queue > 0.0 else 0.0
        decode_ms = self._own_gaps * self._answer_step(decode)
        held_exposure = self._held_exposure(decode.worker_id, ready + waited, decode_ms)
        fills = (
            (prefill.worker_id, self._prompt - local.leg.cached),
            (decode.worker_id, lacking + self._own_gaps + 1),
        )
        return Candidate(
            action,
            (prefill.worker_id, decode.worker_id),
            self._objective_ms,
            queue_ms=queue + waited,
            compute_ms=local.compute_ms + receiver.first_step_ms,
            own_wait_ms=local.own_wait_ms,
            harm_ms=local.harm_ms,
            harm=local.harm,
            exposure=receiver.exposure + held_exposure,
            slow_steps=local.slow_steps,
            leg=local.leg,
            work_ms=local.work_ms,
            pace=receiver.pace,
            transfer_ms=transfer,
            sent_ms=sent,
            leg_tokens=lacking + self._own_gaps + 1,
            prefill_ms=local.compute_ms,
            hold_ms=hold,
            decode_ms=decode_ms,
            fills=fills,
            eviction=self.eviction(fills),
        )

    def handoff_floor(
        self, prefill: WorkerView, decode: WorkerView, held: Hold | None = None
    ) -> Floor:
        """(TTFT, harm, exposure, cost) no larger than `handoff(prefill, decode, ..., held)`'s,
        from the terms each worker's candidates share: its transfer, the wait for the decode
        worker, the eviction and the held prefills' exposure at 0, the rest summed in the
        order `handoff` and `costs` sum them (so no larger to the last bit). The harm is the
        candidate's own. Ranked by this, a candidate whose floor already loses to one scored
        need not be built (`policies.adaptive.policy`)."""
        local = self._prefill_on(prefill)
        queue = self.queue_ms(prefill)
        if held is not None:
            hold, local = held
            queue = hold if hold > queue else queue
        receiver = self._decode_on(decode)
        compute = local.compute_ms + receiver.first_step_ms
        ttft = queue + compute + local.own_wait_ms
        exposure = receiver.exposure
        cost = costs(local.harm, exposure, 0.0, ttft, compute, receiver.pace, self._objective_ms)
        return ttft, local.harm, exposure, cost[2]

    def refill_from(self, workers: Sequence[WorkerView]) -> None:
        """Price an evicted context prefilled again on `workers` (before any candidate)."""
        self._refilled = workers
        self._refill = None

    def eviction(self, fills: tuple[Fill, ...]) -> float:
        """Expected misses of the KV `fills` puts on its workers: the live contexts it evicts
        there (`CacheLedger.live_share` of it), each prefilled again when its session returns,
        as this turn's whole prompt would be on the fleet's workers now (on average: where
        the sessions it evicts are resident is not known)."""
        cache = self._cache
        if cache is None:
            return 0.0
        lost = 0.0
        for wid, tokens in fills:
            share = self._shares.get(wid)
            if share is None:
                worker = self._index.get(wid)
                usage = worker.kv_usage if worker is not None else 0.0
                share = cache.live_share(wid, usage, self._now_s, self._continuing)
                self._shares[wid] = share
            if tokens > 0:
                lost += tokens * share
        return lost * self._refill_cost() if lost > 0.0 else 0.0

    def _refill_cost(self) -> float:
        """Expected misses per token of a context prefilled again: this turn's whole prompt
        on each worker that can decode (of `refill`, where given), on average."""
        per_token = self._refill
        if per_token is None:
            prompt = self._prompt if self._prompt > 1 else 1
            objective = self._objective_ms
            total, count = 0.0, 0
            weight = 1.0 + tuning.WORK_WEIGHT  # its TTFT (its compute) and its GPU time
            workers = self._refilled if self._refilled is not None else self._view.workers
            for worker in workers:
                if not can_serve(worker, DECODE_ROLES):
                    continue
                if prompt == self._prompt and self._cached_at(worker.worker_id) == 0:
                    # the turn's own prefill there: the same terms, shared with its candidates
                    terms = self._prefill_on(worker)
                    compute, harm = terms.compute_ms, terms.harm
                else:
                    compute, _, _, _, slow = self._local_prefill(worker, prompt, 0)
                    harm = self._harm(worker, slow)
                work = weight * compute / objective if objective > 0.0 else math.inf
                total += harm + tuning.TTFT_WEIGHT * work
                count += 1
            per_token = self._refill = total / count / prompt if count else 0.0
        return per_token

    def filled_whole(self, worker: WorkerView) -> int:
        """The KV a whole turn on `worker` fills there: its prompt not cached, its answer."""
        return self._prompt - self._cached_at(worker.worker_id) + self._own_gaps + 1

    def _held_exposure(self, worker_id: str, first_ms: float, decode_ms: float) -> float:
        """Expected misses of the answer decoding on the worker from `first_ms` for
        `decode_ms` from the prefills held for it: the slow steps it meets there, over its
        budget."""
        if self._done is None or decode_ms <= 0.0:
            return 0.0
        start = self._now_s + first_ms / 1000.0
        met = self._done.held_steps(worker_id, start, start + decode_ms / 1000.0,
                                    self._request_id)  # fmt: skip
        return met / self._own_budget

    def hold(self, worker: WorkerView) -> Hold | None:
        """(hold ms, the prefill then) of holding the turn's prefill on `worker` until the
        streams it would stall there are done, or None where holding spares none: it harms
        the streams there now, all of them placed by this policy (`StreamLedger`: a stream
        another router placed ends at a time nobody here knows), done within `max_hold_s`."""
        wid = worker.worker_id
        if wid not in self._holds:
            self._holds[wid] = self._held(worker)
        return self._holds[wid]

    def _held(self, worker: WorkerView) -> Hold | None:
        local = self._prefill_on(worker)
        ledger = self._done
        # Only a prefill whose own slow steps spend a stream's whole budget (each stream
        # beside it misses, and only a hold spares them): to spare streams a part of theirs,
        # a hold would leave the worker's compute idle and the turn waiting for a calm busy
        # workers never have.
        if ledger is None or not local.harm > 0.0 or local.slow_steps < self._stream_budget:
            return None
        wid = worker.worker_id
        count, done_s = ledger.done_at(wid, self._now_s, self._request_id)
        running = self.streams(worker)
        # Where its streams are prefill legs or answers predicted done (the scrape lags),
        # the hold is a step: the prefill harms no stream there.
        if count < running:
            return None
        # The last stream's final token is out a step after it is computed.
        estimates = self._estimates
        step = estimates.decode_step_ms(running, estimates.mean_context_tokens, wid)
        hold = (done_s - self._now_s) * 1000.0 + step
        if hold > self._max_hold_ms:
            return None
        hold = hold if hold > 0.0 else 0.0
        # The answers placed there meanwhile are beside it when it goes.
        meanwhile = ledger.answer_rate(wid, self._now_s, self._request_id)
        share = meanwhile * hold / 1000.0 / running
        return hold, self._alone(wid, local, share if share < 1.0 else 1.0)

    def _alone(self, worker_id: str, local: PrefillTerms, share: float) -> PrefillTerms:
        """`local`, the turn's prefill on the worker, once its streams are done: `share` of
        them there again (placed meanwhile), harmed as they would be now; no wait of its
        own; its steps still stall the answers decoding there later."""
        uncached = self._prompt - self._cached_at(worker_id)
        chunks = self._estimates.prefill_chunks(uncached if uncached > 1 else 1)
        slow = chunks if local.compute_ms / chunks > self._itl_ms else 0
        leg = local.leg
        alone = PrefillLeg(leg.cached, 0, leg.ahead_ms, leg.queued)
        harm_ms, harm = local.harm_ms * share, local.harm * share
        return PrefillTerms(local.compute_ms, 0.0, harm_ms, slow, harm, alone, local.work_ms)
