"""What each placement of one turn would cost: the terms of I > H + dQ + dC (each a
`policies.adaptive_candidate.Candidate`, which holds the constants named here).

A turn counts toward goodput when its TTFT meets its objective and the p99 of its own gaps
meets its ITL objective, so the terms are weighed in expected objective misses; the ms that
cause them are kept too (they are what `Prediction` reports).

Notation, for a turn of P prompt tokens of which U are not cached on the resident worker
(C = P - U cached there; S = the shared prefix a fresh session finds cached anywhere, as
learned by policies.estimates), answering G tokens; B(g) = max(1, (g - 1) / 100), the gaps of
a g-token answer that may exceed the ITL objective while the p99 of its gaps meets it:

- queue(w) = max(estimates.queue_wait_ms(q), slot, A): q = waiting + max(0, inflight -
  running - waiting), the requests queued at w plus the in-flight ones its last scrape has not
  counted; slot = the wait for room there (`slot_wait_ms`): one of the engine's `max_seqs`
  sequence slots and the KV the turn adds, behind the decode legs of split turns this policy
  placed on w and not sent yet (`LegLedger`: no count of the view holds them); A = the
  prefill work this policy placed on w and not yet done (`WorkLedger`, settled by the
  scrapes; in the compute roof's ms: batched steps pay overhead and weights once).
- a local prefill of n new tokens after c cached on worker w with R decode streams (none on
  a "prefill" worker; R = the scrape's running, or the router's legs there less the scrape's
  queue where more, at most `max_seqs`: a scrape may be an interval old), in k chunks; step =
  a decode step of the R streams alone, fused = the prefill's k steps fused with theirs (see
  policies.estimates), J = the others' prefill work in each step it joins: max(A / k,
  u x step / (1 - u)), u = the share of w's time the prefills placed there recently take
  (`WorkLedger.utilisation`: those arriving while a step runs join the next one):
      compute = prefill(n, c) on w alone,  own wait = fused - compute,
      harm ms = R x k x max(0, fused / k + J - max(step, itl))   (stall past their slack),
      harm    = R x s / B(mean answer length observed), s = k when fused / k > itl, else
                fused / itl x P(N >= ceil((itl - fused / k) / T)), N Poisson with mean J / T,
                T = the typical prefill (`Estimates.typical_prefill_ms`): the others'
                prefills join the step at random, and it is slow when more of them come than
                fit beside this one within the objective:
  each slow step spends one gap of every stream's budget. This turn's objectives stand in
  for the streams' (the view has no other). C is the prefix the worker holds: the resident's
  cached tokens, the prompt of the session's last split turn on the worker that prefilled it,
  else S.
- exposure: the turn decodes on d for G - 1 gaps of a step at R' + 1 streams (R' = R and the
  decode legs on their way there, `LegLedger`), while d runs slow steps at the rate its
  recent placements set (`StallLedger`), and adds the KV it lacks there, after the KV those
  legs bring (`kv_crowding`: misses as the cache nears full):
      exposure = rate(d) x (G - 1) x step / B(G) + crowding(d);
  where the turn's own prefill on d is slow (a whole turn), d becomes a host of slow
  prefills: rate(d) is at least the mean rate of the workers hosting them lately.
- TTFT risk: 0 up to `RISK_FROM` x the objective, rising linearly to 1 at the objective.
- H(src, dst, bytes) = latency + bytes / available, available = max(1% of rate,
  rate - (bytes in flight + reserved bytes) / horizon); rate = the link's capacity (else its
  observed rate, else `default_link_bps`), capped by the rate this policy has measured on it.

Candidates, each with ttft = queue + compute + own wait + H (decode-side terms included):
- whole turn on w (colocate on the resident, else recompute there; colocate for a new
  session): n = U after C on the resident, P - S after S elsewhere; queue(w).
- handoff p -> d: prefill on p as above, move the tokens d lacks ((P - C) x kv bytes when d is
  resident, else (P - S) x kv), then one decode step on d with its R' + 1 streams;
  queue = queue(p) + max(slot(d), queue(d) - (the time until the KV arrives)): d's queue
  drains meanwhile, but a full worker stays full as turns keep coming (its slot wait stays).
- migrate r -> d: as the router runs it, a handoff from the resident r.

misses = harm + exposure + TTFT risk; cost = misses + `TTFT_WEIGHT` x ((ttft + `WORK_WEIGHT` x
compute) / objective + pace), pace = the answer's decode step at R' + 1 streams on d over the
ITL objective: where nothing is at risk, the faster and cheaper placement wins (GPU time spent
is time the turns queued behind it wait), and the calmer decode worker. Against the colocated
reference r, a candidate c wins exactly when I > H + dQ + dC, with I = (harm + exposure)(r) -
(the same)(c), the misses its separation avoids, and H + dQ + dC = (cost - harm -
exposure)(c) - (the same)(r), what its transfer, queue, compute and pace add.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from policies.adaptive_candidate import Candidate
from policies.adaptive_ledgers import LegLedger, WorkLedger, kv_crowding, poisson_tail, slot_wait_ms
from policies.adaptive_ledgers import StallLedger as StallLedger
from policies.adaptive_ledgers import slow_gap_budget as slow_gap_budget
from policies.calibration import queue_ahead
from policies.estimates import Estimates, PrefillLeg
from policies.types import Action, ClusterView, LinkView, Turn, WorkerView

LINK_FLOOR_FRACTION = 0.01
UTILISATION_MAX = 0.9


class Scorer:
    """Costs candidates for one turn against one view; caches per-worker queue waits.

    `links` indexes the view's links by (src, dst); `stalls` holds the workers' recent steps
    past the ITL objective.
    """

    __slots__ = (
        "_cached_resident",
        "_default_bps",
        "_estimates",
        "_horizon_s",
        "_itl_ms",
        "_kv_bytes",
        "_legs",
        "_legs_due",
        "_links",
        "_max_seqs",
        "_now_s",
        "_objective_ms",
        "_own_budget",
        "_own_gaps",
        "_prefix",
        "_prompt",
        "_queues",
        "_request_id",
        "_resident",
        "_shared",
        "_slots",
        "_stalls",
        "_stream_budget",
        "_uncached_resident",
        "_work",
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
    ) -> None:
        prompt = turn.prompt_tokens if turn.prompt_tokens > 0 else 0
        uncached = min(max(turn.uncached_tokens, 0), prompt)
        self._prompt = prompt
        self._uncached_resident = uncached
        self._cached_resident = prompt - uncached
        self._resident = view.residency.worker_id if view.residency is not None else None
        shared = int(estimates.shared_prefix_tokens)
        self._shared = max(0, min(shared, prompt - 1))
        # The worker that prefilled this session's last split turn keeps that prompt cached.
        self._prefix = (
            ("", 0) if prefix is None else (prefix[0], max(0, min(prefix[1], prompt - 1)))
        )
        self._itl_ms = turn.objectives.itl_ms
        self._objective_ms = turn.objectives.ttft_ms
        self._kv_bytes = view.kv_bytes_per_token
        self._estimates = estimates
        self._horizon_s = horizon_s
        self._default_bps = default_bps
        self._queues: dict[str, float] = {}
        self._slots: dict[str, float] = {}
        self._links = links
        self._stalls = stalls
        self._work = work
        self._max_seqs = max_seqs
        self._legs = legs
        self._legs_due: dict[str, tuple[int, int]] = {}
        self._now_s = view.now_s
        self._request_id = turn.request_id
        self._own_gaps = turn.max_tokens - 1 if turn.max_tokens > 1 else 0
        self._own_budget = slow_gap_budget(turn.max_tokens)
        self._stream_budget = slow_gap_budget(estimates.mean_completion_tokens)

    def whole(self, worker: WorkerView) -> Candidate:
        """Prefill and decode on `worker`: colocate where the state is (or none is), else
        recompute."""
        wid = worker.worker_id
        cached = self._cached_at(wid)
        compute, own, harm_ms, slow, share = self._local_prefill(
            worker, self._prompt - cached, cached
        )
        action: Action = "colocate"
        if self._resident is not None and wid != self._resident:
            action = "recompute"
        return Candidate(
            action,
            (wid,),
            self._objective_ms,
            queue_ms=self.queue_ms(worker),
            compute_ms=compute,
            own_wait_ms=own,
            harm_ms=harm_ms,
            harm=self._harm(worker, share),
            exposure=self.exposure(worker, hosting=slow > 0),
            slow_steps=slow,
            leg=self._leg(worker, cached),
            work_ms=self._estimates.prefill_work_ms(self._prompt - cached, cached, wid),
            pace=self.pace(worker),
        )

    def handoff(
        self, prefill: WorkerView, decode: WorkerView, action: Action = "handoff"
    ) -> Candidate:
        """Prefill on `prefill`, move the KV `decode` lacks, decode there (a migration from
        the resident runs exactly so)."""
        cached = self._cached_at(prefill.worker_id)
        compute, own, harm_ms, slow, share = self._local_prefill(
            prefill, self._prompt - cached, cached
        )
        lacking = self._prompt - self._cached_at(decode.worker_id)
        transfer = self.transfer_ms(prefill.worker_id, decode.worker_id, lacking * self._kv_bytes)
        queue = self.queue_ms(prefill)
        sent = queue + compute + own
        ready = sent + transfer
        decode_queue = self.queue_ms(decode) - ready
        slot = self._slots[decode.worker_id]
        decode_queue = slot if slot > decode_queue else decode_queue
        # The first decode step carries this turn's context beside the running streams'.
        batch = self.decode_streams(decode) + 1
        context = ((batch - 1) * self._estimates.mean_context_tokens + self._prompt) / batch
        first_step = self._estimates.decode_step_ms(batch, context, decode.worker_id)
        return Candidate(
            action,
            (prefill.worker_id, decode.worker_id),
            self._objective_ms,
            queue_ms=queue + (decode_queue if decode_queue > 0.0 else 0.0),
            compute_ms=compute + first_step,
            own_wait_ms=own,
            harm_ms=harm_ms,
            harm=self._harm(prefill, share),
            exposure=self.exposure(decode),
            slow_steps=slow,
            leg=self._leg(prefill, cached),
            work_ms=self._estimates.prefill_work_ms(
                self._prompt - cached, cached, prefill.worker_id
            ),
            pace=self.pace(decode),
            transfer_ms=transfer,
            sent_ms=sent,
            leg_tokens=lacking + self._own_gaps + 1,
        )

    def queue_ms(self, worker: WorkerView) -> float:
        wid = worker.worker_id
        wait = self._queues.get(wid)
        if wait is None:
            wait = self._estimates.queue_wait_ms(queue_ahead(worker))
            coming = self._coming(wid)[0]
            added = self._streams_of(wid)
            slot = slot_wait_ms(worker, self._max_seqs, self._estimates, added, coming)
            self._slots[wid] = slot
            wait = slot if slot > wait else wait
            if self._work is not None:
                placed = self._work.backlog_ms(wid, self._now_s, self._request_id)
                wait = placed if placed > wait else wait
            self._queues[wid] = wait
        return wait

    def pace(self, worker: WorkerView) -> float:
        """The answer's decode step on `worker` beside its streams, over the ITL objective: the
        calmer worker decodes faster (a tie would herd turns onto whichever looks faster)."""
        if self._own_gaps == 0 or not self._itl_ms > 0.0:
            return 0.0
        batch = self.decode_streams(worker) + 1
        estimates = self._estimates
        step = estimates.decode_step_ms(batch, estimates.mean_context_tokens, worker.worker_id)
        return step / self._itl_ms

    def exposure(self, worker: WorkerView, hosting: bool = False) -> float:
        """Expected misses of this turn's answer decoded on `worker`: from its slow steps,
        and from a KV cache about to fill (preemption). `hosting`: the turn's own prefill
        there is slow, which makes the worker one that hosts slow prefills: its answer meets
        them at least at the rate such workers see lately (each slow prefill placed where
        they already expose the streams costs the others nothing, so more follow)."""
        crowding = kv_crowding(worker, self._streams_of(worker.worker_id))
        if self._stalls is None or self._own_gaps == 0:
            return crowding
        rate = self._stalls.rate(worker.worker_id, self._now_s, self._request_id)
        if hosting:
            hosts = self._stalls.host_rate(self._now_s, self._request_id)
            rate = hosts if hosts > rate else rate
        if rate <= 0.0:
            return crowding
        batch = self.decode_streams(worker) + 1
        step = self._estimates.decode_step_ms(
            batch, self._estimates.mean_context_tokens, worker.worker_id
        )
        return crowding + rate * self._own_gaps * step / 1000.0 / self._own_budget

    def stall_rate(self, worker: WorkerView) -> float:
        """Slow steps per second recently placed on `worker`."""
        if self._stalls is None:
            return 0.0
        return self._stalls.rate(worker.worker_id, self._now_s, self._request_id)

    def transfer_ms(self, src: str, dst: str, nbytes: int) -> float:
        """Exposed time to move `nbytes` over src -> dst, given what the ledger holds."""
        if nbytes <= 0:
            return 0.0
        link = self._links.get((src, dst))
        measured = self._estimates.link_bps(src, dst)
        if link is None:
            return nbytes * 1000.0 / (measured if measured is not None else self._default_bps)
        rate = link.capacity_bps if link.capacity_bps > 0.0 else link.observed_bps
        rate = rate if rate > 0.0 else self._default_bps
        if measured is not None and measured < rate:
            rate = measured
        busy = (max(link.bytes_in_flight, 0) + max(link.reserved_bytes, 0)) / self._horizon_s
        available = max(rate * LINK_FLOOR_FRACTION, rate - busy)
        latency_s = link.latency_s if 0.0 < link.latency_s < math.inf else 0.0
        return (latency_s + nbytes / available) * 1000.0

    def _streams_of(self, worker_id: str) -> float:
        """The KV this turn (the context not cached there, the answer) and the decode legs
        placed on the worker but not sent yet add there, in mean-sized streams."""
        mean = self._estimates.mean_context_tokens
        added = self._prompt - self._cached_at(worker_id) + self._own_gaps + 1
        added += self._coming(worker_id)[1]
        return added / mean if mean > 1.0 else 1.0

    def _coming(self, worker_id: str) -> tuple[int, int]:
        """(legs, tokens) of the split turns' decode legs placed on the worker and not sent
        yet (`LegLedger`)."""
        coming = self._legs_due.get(worker_id)
        if coming is None:
            coming = (0, 0)
            if self._legs is not None:
                coming = self._legs.coming(worker_id, self._now_s, self._request_id)
            self._legs_due[worker_id] = coming
        return coming

    def decode_streams(self, worker: WorkerView) -> int:
        """The streams an answer decoded on `worker` joins: those there now and the decode
        legs on their way (placed by this policy, not sent yet), at most `max_seqs`."""
        streams = self.streams(worker) + self._coming(worker.worker_id)[0]
        return self._max_seqs if 0 < self._max_seqs < streams else streams

    def streams(self, worker: WorkerView) -> int:
        """The decode streams on `worker` now: the scrape's, or more where the router's legs
        there less the scrape's queue say so (a scrape may be an interval old, and turns
        placed within it would otherwise all see the same, least-loaded, worker)."""
        running = worker.running if worker.running > 0 else 0
        placed = worker.inflight - (worker.waiting if worker.waiting > 0 else 0)
        streams = placed if placed > running else running
        return self._max_seqs if 0 < self._max_seqs < streams else streams

    def _leg(self, worker: WorkerView, cached: int) -> PrefillLeg:
        return PrefillLeg(cached, self.streams(worker) if worker.role != "prefill" else 0)

    def _cached_at(self, worker_id: str) -> int:
        if worker_id == self._resident:
            return self._cached_resident
        if worker_id == self._prefix[0] and self._prefix[1] > self._shared:
            return self._prefix[1]
        return self._shared

    def _harm(self, worker: WorkerView, slow: float) -> float:
        if slow <= 0.0 or worker.role == "prefill":
            return 0.0
        return self.streams(worker) * slow / self._stream_budget

    def _local_prefill(
        self, worker: WorkerView, uncached: int, cached: int
    ) -> tuple[float, float, float, int, float]:
        """(compute, own wait, harm ms, its steps past the ITL objective, the slow steps it
        adds for the streams beside it) of prefilling on `worker` (a "prefill" worker runs
        no streams). Continuous batching runs it in the steps of the prefills placed there
        before it: behind that work it adds compute / ITL of a slow step when the steps it
        joins are slow, even if it alone would not make them so."""
        estimates = self._estimates
        wid = worker.worker_id
        compute = estimates.prefill_ms(uncached, cached, wid)
        if worker.role == "prefill":
            return compute, 0.0, 0.0, 0, 0.0
        chunks = estimates.prefill_chunks(uncached if uncached > 1 else 1)
        itl = self._itl_ms
        running = self.streams(worker)
        if running <= 0:
            slow = chunks if compute / chunks > itl else 0
            return compute, 0.0, 0.0, slow, float(slow)
        fused = estimates.prefill_ms(uncached, cached, wid, running)
        per_step = fused / chunks
        step = estimates.decode_step_ms(running, estimates.mean_context_tokens, wid)
        joined = 0.0
        if self._work is not None:
            joined = self._work.backlog_ms(wid, self._now_s, self._request_id) / chunks
            # The prefills arriving while a step runs join the next one: with a share u of
            # the time spent prefilling, a step of the streams lasts step / (1 - u) and
            # carries u of that in prefills.
            u = self._work.utilisation(wid, self._now_s, self._request_id)
            u = u if u < UTILISATION_MAX else UTILISATION_MAX
            coalesced = u * step / (1.0 - u)
            joined = coalesced if coalesced > joined else joined
        over = per_step + joined - (step if step > itl else itl)
        harm_ms = running * chunks * over if over > 0.0 else 0.0
        own = fused - compute
        slow = chunks if per_step > itl else 0
        if slow:
            return compute, own if own > 0.0 else 0.0, harm_ms, slow, float(slow)
        # The others' prefills joining the step arrive at random: a Poisson count of typical
        # prefills, J of work on average; the step is slow when more of them come than fit
        # in the objective beside this one. This prefill's share of it is its own time.
        typical = estimates.typical_prefill_ms
        room = math.ceil((itl - per_step) / typical) if typical > 0.0 else 1
        share = poisson_tail(joined / typical if typical > 0.0 else 0.0, room) * fused / itl
        return compute, own if own > 0.0 else 0.0, harm_ms, slow, share
