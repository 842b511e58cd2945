"""What each placement of one turn would cost: the terms of I > H + dQ + dC, in ms.

Notation, for a turn of P prompt tokens of which U are not cached on the resident worker
(C = P - U cached there; nothing is cached anywhere else):

- queue(w)   = estimates.queue_wait_ms(waiting + max(0, inflight - running - waiting)): the
  requests queued at w, plus fleet-wide in-flight ones its last scrape has not counted yet.
- local prefill of n new tokens after c cached on worker w with R running decode streams (none
  on a "prefill" worker), in k chunks; step = a decode step of the R streams alone, fused =
  the prefill's k steps fused with theirs (see policies.estimates):
      compute  = prefill(n, c) on w alone
      own wait = fused - compute                     (the turn waits behind the streams)
      harm     = R x k x max(0, fused / k - max(step, itl))
  each of the k steps the streams share with the prefill stalls them by fused / k - step; a
  stream is harmed by what that stall exceeds of its slack max(0, itl - step) under the ITL
  objective (this turn's objective stands in for theirs: the view has no other).
  I = harm + own wait.
- H(src, dst, bytes) = latency + bytes / available, available = max(1% of rate,
  rate - (bytes in flight + reserved bytes) / horizon); rate = the link's capacity (else its
  observed rate, else `default_link_bps`), capped by the rate this policy has measured on it.
  The ledger sums every router replica's reservations, so peers' transfers make H large.

Candidates, each with ttft = queue + compute + own wait + H (decode-side terms included):
- whole turn on w (colocate on the resident, else recompute there; colocate for a new
  session): n = U on the resident, P elsewhere; queue(w).
- handoff p -> d: prefill P tokens on p (U if p is resident), move the tokens d lacks (U x kv
  bytes when d is resident, else P x kv bytes), then one decode step on d with its R + 1
  streams (theirs at the mean observed context, this one at P);
  queue = queue(p) + max(0, queue(d) - (the time until the KV arrives)).
- migrate r -> d: move the resident state (residency.bytes), then prefill U after C on d;
  queue = max(0, queue(d) - H).

cost = harm + ttft: a candidate c beats the colocated reference r exactly when
I(r) - I(c) > H(c) + dQ + dC, with dQ = queue(c) - queue(r) and dC = compute(c) - compute(r).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from policies.estimates import Estimates
from policies.types import Action, ClusterView, LinkView, Turn, WorkerView

LINK_FLOOR_FRACTION = 0.01


class Candidate:
    """One feasible placement and its predicted terms (ms)."""

    __slots__ = (
        "action",
        "compute_ms",
        "cost",
        "harm_ms",
        "interference_ms",
        "queue_ms",
        "transfer_ms",
        "ttft_ms",
        "workers",
    )

    def __init__(
        self,
        action: Action,
        workers: tuple[str, ...],
        *,
        queue_ms: float,
        compute_ms: float,
        own_wait_ms: float,
        harm_ms: float,
        transfer_ms: float = 0.0,
    ) -> None:
        self.action: Action = action
        self.workers = workers
        self.queue_ms = queue_ms
        self.compute_ms = compute_ms
        self.transfer_ms = transfer_ms
        self.harm_ms = harm_ms
        self.interference_ms = harm_ms + own_wait_ms
        self.ttft_ms = queue_ms + compute_ms + own_wait_ms + transfer_ms
        self.cost = harm_ms + self.ttft_ms

    def describe(self) -> str:
        if len(self.workers) == 1:
            return f"{self.action} on {self.workers[0]}"
        return f"{self.action} {self.workers[0]}->{self.workers[1]}"


class Scorer:
    """Costs candidates for one turn against one view; caches per-worker queue waits.

    `links` indexes the view's links by (src, dst).
    """

    __slots__ = (
        "_cached_resident",
        "_default_bps",
        "_estimates",
        "_horizon_s",
        "_itl_ms",
        "_kv_bytes",
        "_links",
        "_prompt",
        "_queues",
        "_resident",
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
    ) -> None:
        prompt = turn.prompt_tokens if turn.prompt_tokens > 0 else 0
        uncached = min(max(turn.uncached_tokens, 0), prompt)
        self._prompt = prompt
        self._uncached_resident = uncached
        self._cached_resident = prompt - uncached
        self._resident = view.residency.worker_id if view.residency is not None else None
        self._itl_ms = turn.objectives.itl_ms
        self._kv_bytes = view.kv_bytes_per_token
        self._estimates = estimates
        self._horizon_s = horizon_s
        self._default_bps = default_bps
        self._queues: dict[str, float] = {}
        self._links = links

    def whole(self, worker: WorkerView) -> Candidate:
        """Prefill and decode on `worker`: colocate where the state is (or none is), else
        recompute."""
        wid = worker.worker_id
        cached = self._cached_at(wid)
        compute, own, harm = self._local_prefill(worker, self._prompt - cached, cached)
        action: Action = "colocate"
        if self._resident is not None and wid != self._resident:
            action = "recompute"
        return Candidate(
            action,
            (wid,),
            queue_ms=self.queue_ms(worker),
            compute_ms=compute,
            own_wait_ms=own,
            harm_ms=harm,
        )

    def handoff(self, prefill: WorkerView, decode: WorkerView) -> Candidate:
        cached = self._cached_at(prefill.worker_id)
        compute, own, harm = self._local_prefill(prefill, self._prompt - cached, cached)
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
            "handoff",
            (prefill.worker_id, decode.worker_id),
            queue_ms=queue + (decode_queue if decode_queue > 0.0 else 0.0),
            compute_ms=compute + first_step,
            own_wait_ms=own,
            harm_ms=harm,
            transfer_ms=transfer,
        )

    def migrate(self, source: str, destination: WorkerView, nbytes: int) -> Candidate:
        transfer = self.transfer_ms(source, destination.worker_id, nbytes)
        compute, own, harm = self._local_prefill(
            destination, self._uncached_resident, self._cached_resident
        )
        queue = self.queue_ms(destination) - transfer
        return Candidate(
            "migrate",
            (source, destination.worker_id),
            queue_ms=queue if queue > 0.0 else 0.0,
            compute_ms=compute,
            own_wait_ms=own,
            harm_ms=harm,
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
        return self._cached_resident if worker_id == self._resident else 0

    def _local_prefill(
        self, worker: WorkerView, uncached: int, cached: int
    ) -> tuple[float, float, float]:
        """(compute, own wait, harm) of prefilling on `worker` beside its decode streams."""
        estimates = self._estimates
        wid = worker.worker_id
        compute = estimates.prefill_ms(uncached, cached, wid)
        running = worker.running
        if running <= 0 or worker.role == "prefill":
            return compute, 0.0, 0.0
        fused = estimates.prefill_ms(uncached, cached, wid, running)
        chunks = estimates.prefill_chunks(uncached if uncached > 1 else 1)
        step = estimates.decode_step_ms(running, estimates.mean_context_tokens, wid)
        over = fused / chunks - (step if step > self._itl_ms else self._itl_ms)
        harm = running * chunks * over if over > 0.0 else 0.0
        own = fused - compute
        return compute, own if own > 0.0 else 0.0, harm
