"""What each placement of one turn would cost: the terms of I > H + dQ + dC.

A turn counts toward goodput when its TTFT meets its objective and the p99 of its own gaps
meets its ITL objective, so the terms are weighed in expected objective misses; the ms that
cause them are kept too (they are what `Prediction` reports).

Notation, for a turn of P prompt tokens of which U are not cached on the resident worker
(C = P - U cached there; S = the shared prefix a fresh session finds cached anywhere, as
learned by policies.estimates), answering G tokens; B(g) = max(1, (g - 1) / 100), the gaps of
a g-token answer that may exceed the ITL objective while the p99 of its gaps meets it:

- queue(w) = estimates.queue_wait_ms(waiting + max(0, inflight - running - waiting)): the
  requests queued at w, plus fleet-wide in-flight ones its last scrape has not counted yet.
- a local prefill of n new tokens after c cached on worker w with R running decode streams
  (none on a "prefill" worker), in k chunks; step = a decode step of the R streams alone,
  fused = the prefill's k steps fused with theirs (see policies.estimates):
      compute = prefill(n, c) on w alone,  own wait = fused - compute,
      harm ms = R x k x max(0, fused / k - max(step, itl))   (stall past their slack),
      harm    = R x k_slow / B(mean answer length observed), k_slow = k when fused / k > itl:
  each slow step spends one gap of every stream's budget. This turn's objectives stand in
  for the streams' (the view has no other).
- exposure: the turn decodes on d for G - 1 gaps of a step at R + 1 streams, while d runs
  slow steps at the rate its recent placements set (`StallLedger`):
      exposure = rate(d) x (G - 1) x step / B(G).
- TTFT risk: 0 up to `RISK_FROM` x the objective, rising linearly to 1 at the objective.
- H(src, dst, bytes) = latency + bytes / available, available = max(1% of rate,
  rate - (bytes in flight + reserved bytes) / horizon); rate = the link's capacity (else its
  observed rate, else `default_link_bps`), capped by the rate this policy has measured on it.

Candidates, each with ttft = queue + compute + own wait + H (decode-side terms included):
- whole turn on w (colocate on the resident, else recompute there; colocate for a new
  session): n = U after C on the resident, P - S after S elsewhere; queue(w).
- handoff p -> d: prefill on p as above, move the tokens d lacks ((P - C) x kv bytes when d is
  resident, else (P - S) x kv), then one decode step on d with its R + 1 streams;
  queue = queue(p) + max(0, queue(d) - (the time until the KV arrives)).
- migrate r -> d: as the router runs it, a handoff from the resident r.

misses = harm + exposure + TTFT risk; cost = misses + `TTFT_WEIGHT` x (ttft + `WORK_WEIGHT` x
compute) / objective: where nothing is at risk, the faster and cheaper placement wins (GPU
time spent is time the turns queued behind it wait). Against the colocated reference r, a
candidate c wins exactly when I > H + dQ + dC, with I = (harm + exposure)(r) - (the same)(c),
the misses its separation avoids, and H + dQ + dC = (cost - harm - exposure)(c) - (the
same)(r), what its transfer, queue and compute add.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from policies.estimates import Estimates
from policies.types import Action, ClusterView, LinkView, Turn, WorkerView

LINK_FLOOR_FRACTION = 0.01
RISK_FROM = 0.5
TTFT_WEIGHT = 0.05
WORK_WEIGHT = 16.0
# The ITL objective is on the p99 of a stream's gaps: 1% of them may be slow.
SLOW_GAP_SHARE = 0.01
MAX_TRACKED_WORKERS = 4096
MAX_TRACKED_REQUESTS = 65536


def slow_gap_budget(tokens: float) -> float:
    """B(g): how many gaps of a `tokens`-token answer may exceed the ITL objective."""
    return max(1.0, (tokens - 1.0) * SLOW_GAP_SHARE)


class StallLedger:
    """The prefill steps longer than the ITL objective this policy has placed, per worker,
    as a count decaying with time constant `window_s` (their rate per second).

    Keyed by request: placing a request again replaces its entry, so a decision repeated for
    the same turn and view is the same decision; `rate` leaves the asking request out."""

    __slots__ = ("_counts", "_entries", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._counts: dict[str, tuple[float, float]] = {}  # worker -> (count, as of time)
        self._entries: dict[str, tuple[str, float, int]] = {}  # request -> (worker, at, steps)

    def place(self, request_id: str, worker: str | None, at_s: float, steps: int) -> None:
        """Record `request_id`'s prefill on `worker` (None or 0 steps: no slow step)."""
        old = self._entries.pop(request_id, None)
        if old is not None:
            self._add(old[0], old[1], -old[2])
        if worker is None or steps <= 0:
            return
        self._add(worker, at_s, steps)
        self._entries[request_id] = (worker, at_s, steps)
        if len(self._entries) > MAX_TRACKED_REQUESTS:
            # The oldest entries' contributions have decayed away; forget their keys.
            for key in list(self._entries)[: MAX_TRACKED_REQUESTS // 4]:
                del self._entries[key]

    def forget(self, request_id: str) -> None:
        """Stop tracking the request (its steps stay counted)."""
        self._entries.pop(request_id, None)

    def rate(self, worker: str, now_s: float, exclude: str = "") -> float:
        entry = self._counts.get(worker)
        if entry is None:
            return 0.0
        count, as_of = entry
        own = self._entries.get(exclude)
        if own is not None and own[0] == worker:
            count -= own[2] * math.exp((own[1] - as_of) / self.window_s)
        if count <= 0.0:
            return 0.0
        age = now_s - as_of if now_s > as_of else 0.0
        return count * math.exp(-age / self.window_s) / self.window_s

    def _add(self, worker: str, at_s: float, steps: int) -> None:
        count, as_of = self._counts.get(worker, (0.0, at_s))
        if at_s >= as_of:
            count = count * math.exp((as_of - at_s) / self.window_s) + steps
            as_of = at_s
        else:
            count += steps * math.exp((at_s - as_of) / self.window_s)
        if worker in self._counts or len(self._counts) < MAX_TRACKED_WORKERS:
            self._counts[worker] = (count if count > 0.0 else 0.0, as_of)


class Candidate:
    """One feasible placement: its predicted terms (ms) and expected objective misses."""

    __slots__ = (
        "action",
        "compute_ms",
        "cost",
        "exposure",
        "harm",
        "harm_ms",
        "interference_ms",
        "misses",
        "queue_ms",
        "risk",
        "slow_steps",
        "transfer_ms",
        "ttft_ms",
        "workers",
    )

    def __init__(
        self,
        action: Action,
        workers: tuple[str, ...],
        objective_ms: float,
        *,
        queue_ms: float,
        compute_ms: float,
        own_wait_ms: float,
        harm_ms: float,
        harm: float,
        exposure: float,
        slow_steps: int,
        transfer_ms: float = 0.0,
    ) -> None:
        self.action: Action = action
        self.workers = workers
        self.slow_steps = slow_steps
        self.queue_ms = queue_ms
        self.compute_ms = compute_ms
        self.transfer_ms = transfer_ms
        self.harm_ms = harm_ms
        self.interference_ms = harm_ms + own_wait_ms
        self.ttft_ms = ttft = queue_ms + compute_ms + own_wait_ms + transfer_ms
        self.harm = harm
        self.exposure = exposure
        share = ttft / objective_ms if objective_ms > 0.0 else math.inf
        self.risk = min(1.0, max(0.0, (share - RISK_FROM) / (1.0 - RISK_FROM)))
        self.misses = harm + exposure + self.risk
        work = compute_ms / objective_ms if objective_ms > 0.0 else math.inf
        self.cost = self.misses + TTFT_WEIGHT * min(share + WORK_WEIGHT * work, 1e9)

    @property
    def interference(self) -> float:
        """I of this placement, in expected misses: what its stalls cost."""
        return self.harm + self.exposure

    def describe(self) -> str:
        if len(self.workers) == 1:
            return f"{self.action} on {self.workers[0]}"
        return f"{self.action} {self.workers[0]}->{self.workers[1]}"


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
        "_links",
        "_now_s",
        "_objective_ms",
        "_own_budget",
        "_own_gaps",
        "_prompt",
        "_queues",
        "_request_id",
        "_resident",
        "_shared",
        "_stalls",
        "_stream_budget",
        "_uncached_resident",
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
    ) -> None:
        prompt = turn.prompt_tokens if turn.prompt_tokens > 0 else 0
        uncached = min(max(turn.uncached_tokens, 0), prompt)
        self._prompt = prompt
        self._uncached_resident = uncached
        self._cached_resident = prompt - uncached
        self._resident = view.residency.worker_id if view.residency is not None else None
        shared = int(estimates.shared_prefix_tokens)
        self._shared = max(0, min(shared, prompt - 1))
        self._itl_ms = turn.objectives.itl_ms
        self._objective_ms = turn.objectives.ttft_ms
        self._kv_bytes = view.kv_bytes_per_token
        self._estimates = estimates
        self._horizon_s = horizon_s
        self._default_bps = default_bps
        self._queues: dict[str, float] = {}
        self._links = links
        self._stalls = stalls
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
        compute, own, harm_ms, slow = self._local_prefill(worker, self._prompt - cached, cached)
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
            harm=self._harm(worker, slow),
            exposure=self.exposure(worker),
            slow_steps=slow,
        )

    def handoff(
        self, prefill: WorkerView, decode: WorkerView, action: Action = "handoff"
    ) -> Candidate:
        """Prefill on `prefill`, move the KV `decode` lacks, decode there (a migration from
        the resident runs exactly so)."""
        cached = self._cached_at(prefill.worker_id)
        compute, own, harm_ms, slow = self._local_prefill(prefill, self._prompt - cached, cached)
        nbytes = (self._prompt - self._cached_at(decode.worker_id)) * self._kv_bytes
        transfer = self.transfer_ms(prefill.worker_id, decode.worker_id, nbytes)
        queue = self.queue_ms(prefill)
        ready = queue + compute + own + transfer
        decode_queue = self.queue_ms(decode) - ready
        # The first decode step carries this turn's context beside the running streams'.
        batch = (decode.running if decode.running > 0 else 0) + 1
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
            harm=self._harm(prefill, slow),
            exposure=self.exposure(decode),
            slow_steps=slow,
            transfer_ms=transfer,
        )

    def queue_ms(self, worker: WorkerView) -> float:
        wid = worker.worker_id
        wait = self._queues.get(wid)
        if wait is None:
            unseen = worker.inflight - worker.running - worker.waiting
            depth = worker.waiting + (unseen if unseen > 0 else 0)
            wait = self._queues[wid] = self._estimates.queue_wait_ms(depth)
        return wait

    def exposure(self, worker: WorkerView) -> float:
        """Expected ITL misses of this turn's answer from the slow steps of `worker`."""
        if self._stalls is None or self._own_gaps == 0:
            return 0.0
        rate = self._stalls.rate(worker.worker_id, self._now_s, self._request_id)
        if rate <= 0.0:
            return 0.0
        batch = (worker.running if worker.running > 0 else 0) + 1
        step = self._estimates.decode_step_ms(
            batch, self._estimates.mean_context_tokens, worker.worker_id
        )
        return rate * self._own_gaps * step / 1000.0 / self._own_budget

    def transfer_ms(self, src: str, dst: str, nbytes: int) -> float:
        """Exposed time to move `nbytes` over src -> dst, given what the ledger holds."""
        if nbytes <= 0:
            return 0.0
        link = self._links.get((src, dst))
        measured = self._estimates.link_bps(src, dst)
        if link is None:
            return nbytes * 1000.0 / (measured if measured is not None else self._default_bps)
        if link.capacity_bps > 0.0:
            rate = link.capacity_bps
        elif link.observed_bps > 0.0:
            rate = link.observed_bps
        else:
            rate = self._default_bps
        if measured is not None and measured < rate:
            rate = measured
        busy = (max(link.bytes_in_flight, 0) + max(link.reserved_bytes, 0)) / self._horizon_s
        available = max(rate * LINK_FLOOR_FRACTION, rate - busy)
        latency_s = link.latency_s if 0.0 < link.latency_s < math.inf else 0.0
        return (latency_s + nbytes / available) * 1000.0

    def _cached_at(self, worker_id: str) -> int:
        return self._cached_resident if worker_id == self._resident else self._shared

    def _harm(self, worker: WorkerView, slow: int) -> float:
        if slow <= 0 or worker.running <= 0 or worker.role == "prefill":
            return 0.0
        return worker.running * slow / self._stream_budget

    def _local_prefill(
        self, worker: WorkerView, uncached: int, cached: int
    ) -> tuple[float, float, float, int]:
        """(compute, own wait, harm ms, steps past the ITL objective) of prefilling on
        `worker` beside its decode streams (a "prefill" worker runs none)."""
        estimates = self._estimates
        wid = worker.worker_id
        compute = estimates.prefill_ms(uncached, cached, wid)
        if worker.role == "prefill":
            return compute, 0.0, 0.0, 0
        chunks = estimates.prefill_chunks(uncached if uncached > 1 else 1)
        itl = self._itl_ms
        running = worker.running
        if running <= 0:
            return compute, 0.0, 0.0, chunks if compute / chunks > itl else 0
        fused = estimates.prefill_ms(uncached, cached, wid, running)
        per_step = fused / chunks
        step = estimates.decode_step_ms(running, estimates.mean_context_tokens, wid)
        over = per_step - (step if step > itl else itl)
        harm_ms = running * chunks * over if over > 0.0 else 0.0
        own = fused - compute
        return compute, own if own > 0.0 else 0.0, harm_ms, chunks if per_step > itl else 0
