"""The `ClusterView` a simulated decision sees, built as the live router builds it.

Worker load (running, waiting, KV usage) is what the last scrape saw: every worker is sampled
every `scrape_interval_s` from time 0, and `scraped_at_s` says when. In-flight counts are
current (the router counts its own legs). Links come from the reservation ledger.

Each worker's `WorkerView` is built at a scrape and again only when its in-flight counts
change, and the workers' tuple is shared by the turns decided between two changes (the view's
`changes` names the workers rebuilt since the tuple before): a turn costs no pass over the
fleet here.
"""

from __future__ import annotations

import msgspec

from bench.des.cluster import Cluster, Leg
from bench.des.config import SimConfig
from bench.des.ledger import LinkLedger
from bench.des.loop import EventLoop
from policies.types import ClusterView, Residency, WorkerChanges, WorkerView


class ViewBuilder:
    def __init__(self, config: SimConfig, cluster: Cluster, ledger: LinkLedger) -> None:
        self._ids = config.worker_ids
        self._roles = config.roles
        self._interval = config.scrape_interval_s
        self._by_priority = config.scheduling_policy == "priority"
        self._nic_bps = config.nic_gbps * 1e9 / 8  # the idle links' rate (`LinkLedger`)
        self._cluster = cluster
        cluster.on_first_token = self.begin
        self._ledger = ledger
        self._kv_bytes = cluster.kv_bytes_per_token
        self._loop: EventLoop | None = None
        count = len(self._ids)
        self.inflight = [0] * count  # legs in flight per worker (the proxy's _Inflight)
        # Of those, the legs that began answering since the last scrape (`epoch`).
        self.started_since_scrape = [0] * count
        self.epoch = 0
        self._scraped_at: float | None = None
        self._workers = [self._built(i, (0, 0, 0.0), None) for i in range(count)]
        self._changed: dict[int, None] = {}  # workers whose in-flight counts changed
        self._shared: tuple[WorkerView, ...] | None = None  # the views' tuple, until a change
        self._changes: WorkerChanges | None = None  # where it differs from the one before

    def start(self, loop: EventLoop) -> None:
        """Scrape at the current time, then every interval, until the loop stops."""
        self._loop = loop
        loop.at(loop.now(), self._scrape)

    def _scrape(self, _: object) -> None:
        assert self._loop is not None
        if not self._loop.heap:
            # Scrapes are the only events that reschedule themselves: with nothing else
            # pending, no turn can ever finish (the client stops the loop when all have).
            raise RuntimeError(
                f"the simulation stalled at t={self._loop.now():.3f}s: turns are unanswered "
                "but no step, transfer or arrival is pending"
            )
        load = self._cluster.load
        now = self._loop.now()
        self._scraped_at = now
        self.epoch += 1
        self.started_since_scrape = [0] * len(self._ids)
        self._workers = [self._built(i, load(i), now) for i in range(len(self._ids))]
        self._changed.clear()
        self._shared = None
        self._loop.at(now + self._interval, self._scrape)

    def _built(self, i: int, load: tuple[int, int, float], scraped_at: float | None) -> WorkerView:
        running, waiting, kv_usage = load
        return WorkerView(
            worker_id=self._ids[i],
            role=self._roles[i],
            healthy=True,
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            inflight=self.inflight[i],
            started_since_scrape=self.started_since_scrape[i],
            scraped_at_s=scraped_at,
            priority_scheduling=self._by_priority,
            nic_bps=self._nic_bps,
        )

    def sent(self, worker: int) -> None:
        """A leg went to `worker`: one more in flight there."""
        self.inflight[worker] += 1
        self._changed[worker] = None

    def begin(self, leg: Leg) -> None:
        """`leg` began answering (its first token, or a decode leg's pull): it queues no
        prefill where it is."""
        if leg.started < 0:
            leg.started = self.epoch
            self.started_since_scrape[leg.worker] += 1
            self._changed[leg.worker] = None

    def unbegin(self, leg: Leg) -> None:
        """`leg` is no longer counted as begun (a decode leg that prefills after all begins
        again at its first token)."""
        if leg.started == self.epoch:
            self.started_since_scrape[leg.worker] -= 1
            self._changed[leg.worker] = None
        leg.started = -1

    def ended(self, leg: Leg) -> None:
        """`leg` is no longer in flight."""
        self.inflight[leg.worker] -= 1
        self._changed[leg.worker] = None
        self.unbegin(leg)

    def view(self, residency: Residency | None, now: float) -> ClusterView:
        workers = self._shared
        if workers is None or self._changed:
            views = self._workers
            inflight, started = self.inflight, self.started_since_scrape
            for i in self._changed:
                views[i] = msgspec.structs.replace(
                    views[i], inflight=inflight[i], started_since_scrape=started[i]
                )
            # after a scrape every view is new: the policy compares them all
            self._changes = (
                None if workers is None else WorkerChanges(workers, tuple(self._changed))
            )
            self._changed.clear()
            workers = self._shared = tuple(views)
        return ClusterView(
            now_s=now,
            workers=workers,
            links=self._ledger.views(now),
            residency=residency,
            kv_bytes_per_token=self._kv_bytes,
            changes=self._changes,
        )
