"""The terms of `policies.adaptive.scoring`'s formulas for one turn on each worker of one
view: its queue there, its prefill there (compute, own wait, harm), its answer's exposure and
pace, a link's transfer time (H).

The view, the estimates and the ledgers stay as they are while a turn is scored, so each
worker's terms are computed once per turn and shared by every candidate placing there.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

from policies.adaptive import tuning
from policies.adaptive.candidates import DecodeTerms, PrefillTerms
from policies.adaptive.ledgers.legs import (
    LegLedger,
    StallLedger,
    kv_crowding,
    poisson_tail,
    slot_wait_ms,
    slow_gap_budget,
    slow_gaps_allowed,
    stream_harm,
)
from policies.adaptive.ledgers.work import WorkLedger
from policies.costmodel.calibration import queue_ahead
from policies.costmodel.estimates import Estimates, PrefillLeg
from policies.eligibility import PREFILL_ROLES, can_serve
from policies.types import ClusterView, LinkView, Turn, WorkerView, idle_link_bps


class TurnTerms:
    """The terms of one turn on the workers of one view, each worker's computed once.

    `links` indexes the view's links by (src, dst); `stalls` holds the workers' recent steps
    past the ITL objective; `index` the view's workers by id (None: built here);
    `host_fresh_s`: how old the rate of the workers hosting slow prefills may be (0: exact,
    `StallLedger.host_rate`); `prefill_streams`: (`streams`, id) of every prefill-capable
    worker, where the caller counted them in its own pass over the view (None: here).
    `policies.adaptive.scoring.Scorer` builds it, with the defaults.
    """

    __slots__ = (
        "_aheads",
        "_answer_steps",
        "_backlogs",
        "_cached_resident",
        "_calmest",
        "_continuing",
        "_crowding",
        "_decodes",
        "_default_bps",
        "_estimates",
        "_horizon_s",
        "_host_fresh_s",
        "_host_rate",
        "_index",
        "_itl_ms",
        "_kv_bytes",
        "_legs",
        "_legs_due",
        "_legs_kvs",
        "_links",
        "_max_seqs",
        "_now_s",
        "_objective_ms",
        "_own_budget",
        "_own_gaps",
        "_prefill_streams",
        "_prefills",
        "_prefix",
        "_prompt",
        "_queues",
        "_request_id",
        "_resident",
        "_shared",
        "_slots",
        "_stall_rates",
        "_stalls",
        "_stream_budget",
        "_streams",
        "_uncached_resident",
        "_view",
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
        stalls: StallLedger | None,
        prefix: tuple[str, int] | None,
        work: WorkLedger | None,
        max_seqs: int,
        legs: LegLedger | None,
        continuing: float,
        index: Mapping[str, WorkerView] | None = None,
        host_fresh_s: float = 0.0,
        prefill_streams: list[tuple[int, str]] | None = None,
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
        self._view = view
        self._index = index if index is not None else {w.worker_id: w for w in view.workers}
        self._host_fresh_s = host_fresh_s
        self._continuing = continuing
        # The three prefill-capable workers with the fewest streams (`_avoided`), once, of
        # `prefill_streams` where given.
        self._calmest: list[tuple[int, str]] | None = None
        self._prefill_streams = prefill_streams
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
        self._legs_kvs: dict[str, float] = {}
        self._now_s = view.now_s
        self._request_id = turn.request_id
        self._own_gaps = turn.max_tokens - 1 if turn.max_tokens > 1 else 0
        self._own_budget = slow_gap_budget(turn.max_tokens)
        self._stream_budget = slow_gap_budget(estimates.mean_completion_tokens)
        # Per worker, the terms every candidate placing there shares (the view, estimates
        # and ledgers stay as they are while one turn is scored).
        self._prefills: dict[str, PrefillTerms] = {}
        self._decodes: dict[str, DecodeTerms] = {}
        self._crowding: dict[str, float] = {}
        self._backlogs: dict[str, float] = {}
        self._aheads: dict[str, float] = {}
        self._stall_rates: dict[str, float] = {}
        self._answer_steps: dict[str, float] = {}
        self._streams: dict[str, int] = {}
        self._host_rate: float | None = None

    def _prefill_on(self, worker: WorkerView) -> PrefillTerms:
        """The turn's prefill on `worker` (after what it holds cached), as every candidate
        prefilling there shares it."""
        wid = worker.worker_id
        known = self._prefills.get(wid)
        if known is None:
            cached = self._cached_at(wid)
            uncached = self._prompt - cached
            compute, own, harm_ms, slow, share = self._local_prefill(worker, uncached, cached)
            known = self._prefills[wid] = PrefillTerms(
                compute,
                own,
                harm_ms,
                slow,
                self._harm(worker, share),
                self._leg(worker, cached),
                self._estimates.prefill_work_ms(uncached, cached, wid),
            )
        return known

    def slow_prefill(self, worker: WorkerView) -> bool:
        """Whether the turn's prefill on `worker` runs a step past the ITL objective."""
        return self._prefill_on(worker).slow_steps > 0

    def _decode_on(self, worker: WorkerView) -> DecodeTerms:
        """The turn's decode leg sent to `worker`, as every handoff there shares it."""
        wid = worker.worker_id
        known = self._decodes.get(wid)
        if known is None:
            queue = self.queue_ms(worker)
            # The first decode step carries this turn's context beside the running streams'.
            batch = self.decode_streams(worker) + 1
            estimates = self._estimates
            context = ((batch - 1) * estimates.mean_context_tokens + self._prompt) / batch
            known = self._decodes[wid] = DecodeTerms(
                self._prompt - self._cached_at(wid),
                queue,
                self._slots[wid],
                estimates.decode_step_ms(batch, context, wid),
                self.exposure(worker),
                self.pace(worker),
            )
        return known

    def transfer_ms(self, src: str, dst: str, nbytes: int, start_ms: float = 0.0) -> float:
        """H: the time to move `nbytes` over src -> dst starting `start_ms` from now, given
        what the link's ledger holds: the bytes in flight and reserved drain at the link's
        rate meanwhile (a handoff queued behind long prefills reserves its bytes long before
        it sends them). The rate is the link's capacity (else its observed rate, else
        `default_bps`), capped by the rate this policy measured on it (on a link it has not
        used, on the others), and a transfer gets at least `LINK_FLOOR_FRACTION` of it;
        without the link in the view, the measured or default rate alone, or where its NICs
        give it one, that rate as of an idle link (`policies.types.ClusterView`)."""
        if nbytes <= 0:
            return 0.0
        measured = self._estimates.expected_link_bps(src, dst)
        link = self._links.get((src, dst))
        if link is None:
            # Left out of the view's links: idle at its NICs' rate, where both are known.
            rate = idle_link_bps(self._index.get(src), self._index.get(dst))
            if rate > 0.0:
                if measured is not None and measured < rate:
                    rate = measured
                return (0.0 + nbytes / rate) * 1000.0
            return nbytes * 1000.0 / (measured if measured is not None else self._default_bps)
        rate = link.capacity_bps if link.capacity_bps > 0.0 else link.observed_bps
        rate = rate if rate > 0.0 else self._default_bps
        if measured is not None and measured < rate:
            rate = measured
        sending = link.bytes_in_flight if link.bytes_in_flight > 0 else 0
        reserved = link.reserved_bytes if link.reserved_bytes > 0 else 0
        pending = sending + reserved - rate * start_ms / 1000.0
        available = rate - pending / self._horizon_s if pending > 0.0 else rate
        floor = rate * tuning.LINK_FLOOR_FRACTION
        available = available if available > floor else floor
        latency_s = link.latency_s if 0.0 < link.latency_s < math.inf else 0.0
        return (latency_s + nbytes / available) * 1000.0

    def queue_ms(self, worker: WorkerView) -> float:
        wid = worker.worker_id
        wait = self._queues.get(wid)
        if wait is None:
            wait = self._estimates.queue_wait_ms(self._ahead(worker))
            coming = self._coming(wid)[0]
            added = self._streams_of(wid)
            slot = slot_wait_ms(worker, self._max_seqs, self._estimates, added, coming)
            self._slots[wid] = slot
            wait = slot if slot > wait else wait
            placed = self._backlog_ms(wid)
            wait = placed if placed > wait else wait
            self._queues[wid] = wait
        return wait

    def _ahead(self, worker: WorkerView) -> float:
        """The requests queued at `worker`, as the queue wait counts them."""
        ahead = self._aheads.get(worker.worker_id)
        if ahead is None:
            work, now, asking = self._work, self._now_s, self._request_id
            ahead = float(queue_ahead(worker)) if work is None else work.ahead(worker, now, asking)
            self._aheads[worker.worker_id] = ahead
        return ahead

    def pace(self, worker: WorkerView) -> float:
        """The headroom the answer's decode step on `worker`, beside its streams, leaves under
        the ITL objective, as a share of it (0 once the step reaches it): the fullest worker
        whose step still meets the objective wins a tie (best fit). Answers packed onto a few
        workers leave the others' steps free of streams, so the slow prefills placed there
        stall no one: prefill and decode workers form from the load, and re-form as its mix
        shifts. Spreading answers to the calmest worker left a stream beside every prefill.
        Where prefills are slow steps, for a new session, scaled to weigh `PACKING_MISSES`
        in the cost (below)."""
        if self._own_gaps == 0 or not self._itl_ms > 0.0:
            return 0.0
        share = self._answer_step(worker) / self._itl_ms
        if self._resident is not None or not self._estimates.typical_prefill_ms > self._itl_ms:
            return 1.0 - share if share < 1.0 else 0.0
        # Where prefills are slow steps, a stream keeps them off its worker for its life
        # (each would stall it): a new session's answer on a worker free of streams takes a
        # prefill worker away, which TTFT alone, its scale, would trade for a first step a
        # few ms shorter. The headroom then weighs `PACKING_MISSES` a whole share, and none
        # is left past `PACK_UP_TO` of the objective: there a fuller worker risks every
        # stream's gaps. A returning session's answer stays where its context is cached: a
        # move to pack it spends cache and transfers the terms do not all price.
        headroom = 1.0 if share > tuning.PACK_UP_TO else 1.0 - share
        return headroom * tuning.PACKING_MISSES / tuning.TTFT_WEIGHT

    def exposure(self, worker: WorkerView, hosting: bool = False, waiting_ms: float = 0.0) -> float:
        """Expected misses of this turn's answer decoded on `worker`: from its slow steps,
        and from a KV cache about to fill (preemption). `hosting`: the turn's own prefill
        there is slow, which makes the worker one that hosts slow prefills: its answer meets
        them at least at the rate such workers see lately (each slow prefill placed where
        they already expose the streams costs the others nothing, so more follow).
        `waiting_ms`: the turn waits that long on `worker` for its first token (a whole
        turn: its queue and prefill there); the prefills placed there meanwhile queue behind
        it and run while its answer decodes, so they count as if placed during its decode
        (a short answer on a busy host meets the next prefill, however brief its own life)."""
        wid = worker.worker_id
        crowding = self._crowding.get(wid)
        if crowding is None:
            crowding = self._crowding[wid] = kv_crowding(worker, self._streams_of(wid))
        if self._stalls is None or self._own_gaps == 0:
            return crowding
        rate = self.stall_rate(worker)
        if hosting:
            if self._host_rate is None:
                self._host_rate = self._stalls.host_rate(
                    self._now_s, self._request_id, self._host_fresh_s
                )
            hosts = self._host_rate
            rate = hosts if hosts > rate else rate
        if rate <= 0.0:
            return crowding
        step = self._answer_step(worker)
        life_ms = self._own_gaps * step + (waiting_ms if waiting_ms > 0.0 else 0.0)
        if not hosting and self._continuing < 1.0 and self._avoided(worker):
            # New sessions' prefills go elsewhere from now on: past the work placed there
            # already, only the returning sessions' (their cache is there) stall it.
            backlog = self._backlog_ms(wid)
            if backlog < life_ms:
                life_ms = backlog + self._continuing * (life_ms - backlog)
        return crowding + rate * life_ms / 1000.0 / self._own_budget

    def _avoided(self, worker: WorkerView) -> bool:
        """Whether the harm bound keeps new sessions' prefills off `worker` once this answer
        decodes there: one there, beside its streams and the answer, would spend a stream
        budget more than one on the calmest other prefill-capable worker. Never where the
        workload's prefills are no slow steps (they harm nothing), where one slow gap fails
        an answer (a budget of 1: nearly every worker would pass the test), or with fewer
        than two other prefill-capable workers (on two, it would send every new session's
        prefill to the one other worker)."""
        if self._stream_budget <= 1.0 or not self._estimates.typical_prefill_ms > self._itl_ms:
            return False
        calmest = self._calmest
        if calmest is None:
            counted = self._prefill_streams
            if counted is None:
                counted = [(self.streams(w), w.worker_id) for w in self._view.workers
                           if can_serve(w, PREFILL_ROLES)]  # fmt: skip
            calmest = self._calmest = heapq.nsmallest(3, counted)
        others = [streams for streams, wid in calmest if wid != worker.worker_id]
        if len(others) < 2:
            return False
        return self.decode_streams(worker) + 1 - others[0] >= self._stream_budget

    def _answer_step(self, worker: WorkerView) -> float:
        """A decode step on `worker` once the answer joins its streams, at the mean context."""
        wid = worker.worker_id
        step = self._answer_steps.get(wid)
        if step is None:
            batch = self.decode_streams(worker) + 1
            estimates = self._estimates
            step = estimates.decode_step_ms(batch, estimates.mean_context_tokens, wid)
            self._answer_steps[wid] = step
        return step

    def stall_rate(self, worker: WorkerView) -> float:
        """Slow steps per second recently placed on `worker`."""
        if self._stalls is None:
            return 0.0
        wid = worker.worker_id
        rate = self._stall_rates.get(wid)
        if rate is None:
            rate = self._stall_rates[wid] = self._stalls.rate(wid, self._now_s, self._request_id)
        return rate

    def _streams_of(self, worker_id: str) -> float:
        """The KV this turn (the context not cached there, the answer) and the decode legs
        placed on the worker but not sent yet add there (`_legs_kv`), in mean-sized
        streams."""
        mean = self._estimates.mean_context_tokens
        added = float(self._prompt - self._cached_at(worker_id) + self._own_gaps + 1)
        added += self._legs_kv(worker_id)
        return added / mean if mean > 1.0 else 1.0

    def _legs_kv(self, worker_id: str) -> float:
        """The KV the decode legs placed on the worker and not sent yet add there at their
        peak (`LegLedger.surplus`): each comes when its prefill ends, seconds away behind a
        long prefill queue, by when the streams there now have freed part of theirs (they
        end at running / (mean answer x step) a second, as in `slot_wait_ms`). Counted all
        at once, a burst of long prompts placed to one worker would fill its cache on paper
        alone, and spread their answers over workers that then host no slow prefills."""
        kv = self._legs_kvs.get(worker_id)
        if kv is None:
            coming = self._coming(worker_id)
            kv = float(coming[1])
            worker = self._index.get(worker_id)
            streams = self.streams(worker) if worker is not None else 0
            if coming[0] > 0 and streams > 0 and self._legs is not None:
                estimates = self._estimates
                mean = estimates.mean_context_tokens
                step = estimates.decode_step_ms(streams, mean, worker_id)
                life_s = estimates.mean_completion_tokens * step / 1000.0
                held = streams * mean
                freed = held / life_s if life_s > 0.0 else 0.0
                kv = self._legs.surplus(worker_id, self._now_s, self._request_id, freed, held)
            self._legs_kvs[worker_id] = kv
        return kv

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
        placed within it would otherwise all see the same, least-loaded, worker); less the
        split turns' prefill legs running there (`_prefill_legs`: the engine counts a
        request running from its prefill on, so a worker hosting prefill legs alone would
        seem to hold a stream that each slow prefill placed there harms, like a worker
        with an answer decoding; a whole turn's prefill stays: it decodes there next)."""
        wid = worker.worker_id
        known = self._streams.get(wid)
        if known is not None:
            return known
        running = worker.running if worker.running > 0 else 0
        placed = worker.inflight - (worker.waiting if worker.waiting > 0 else 0)
        streams = placed if placed > running else running
        if streams > 0:
            legs = self._prefill_legs(wid)
            streams = streams - legs if streams > legs else 0
        streams = self._max_seqs if 0 < self._max_seqs < streams else streams
        self._streams[wid] = streams
        return streams

    def _prefill_legs(self, worker_id: str) -> int:
        """The split turns' prefill legs running on the worker (none known here: the
        `policies.adaptive.scoring.Scorer` reads its `StreamLedger`)."""
        return 0

    def _leg(self, worker: WorkerView, cached: int) -> PrefillLeg:
        beside = self.streams(worker) if worker.role != "prefill" else 0
        return PrefillLeg(cached, beside, self._backlog_ms(worker.worker_id), self._ahead(worker))

    def _backlog_ms(self, worker_id: str) -> float:
        """The prefill work placed on the worker ahead of this turn and not yet done (0 without
        a `WorkLedger`; its queue, its prefill's steps and its leg all wait behind it)."""
        backlog = self._backlogs.get(worker_id)
        if backlog is None:
            work = self._work
            backlog = work.backlog_ms(worker_id, self._now_s, self._request_id) if work else 0.0
            self._backlogs[worker_id] = backlog
        return backlog

    def _cached_at(self, worker_id: str) -> int:
        if worker_id == self._resident:
            return self._cached_resident
        if worker_id == self._prefix[0] and self._prefix[1] > self._shared:
            return self._prefix[1]
        return self._shared

    def _harm(self, worker: WorkerView, slow: float) -> float:
        if slow <= 0.0 or worker.role == "prefill":
            return 0.0
        estimates = self._estimates
        if not estimates.typical_prefill_ms > self._itl_ms:
            return self.streams(worker) * slow / self._stream_budget
        life_s = estimates.mean_completion_tokens * self._answer_step(worker) / 1000.0
        allowed = slow_gaps_allowed(estimates.mean_completion_tokens)
        own = self.stall_rate(worker) * life_s
        return self.streams(worker) * stream_harm(own, allowed, slow, self._stream_budget)

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
            joined = self._backlog_ms(wid) / chunks
            # The prefills arriving while a step runs join the next one: with a share u of
            # the time spent prefilling, a step of the streams lasts step / (1 - u) and
            # carries u of that in prefills.
            u = self._work.utilisation(wid, self._now_s, self._request_id)
            most = tuning.UTILISATION_MAX
            u = u if u < most else most
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
