"""The fleet's workers: who they are, how loaded and healthy, and one pooled HTTP client.

The router only ever connects to these workers, whatever a request says. Workers join and
leave while the router runs (`add`, `leave`: router.fleet.membership applies discovery's
changes). A worker that leaves drains: it stays, draining, in the policy's view and in
`workers` (turns in flight there finish; no new turn is placed there) until its last request
ended and `departure_grace_s` passed, when `reap` forgets it.

Several models: each worker's models come from its /v1/models. `ModelPool`s, one per model,
are rebuilt whenever a worker joins, leaves or lists other models, so a turn looks its pool up
once and the policy sees only the workers serving its model. While no worker has listed its
models every turn may go anywhere (the router cannot tell them apart), and a worker whose
models are not known yet is in no model's pool.

Outlier ejection, as Envoy's consecutive-5xx detector: `eject_consecutive_failures` failed
legs in a row (a 5xx answer, a timeout, a refused or broken connection; a success resets the
count) eject a worker for `eject_base_s` x the times it was ejected (at most `eject_max_s`);
the multiplier drops by one per `eject_base_s` the worker then serves uneventfully. No more
than `eject_max_percent` of the fleet is ejected at once, though the first ejection is always
allowed when another worker is left. An ejected worker reads as unhealthy in the policy's view
and in `healthy_count`. Ejections change only when a leg fails and when the earliest one is
due to end (one timer, and a check on reads): a turn pays one comparison (and a clock read
while any worker is ejected).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import aiohttp

from policies.types import WorkerChanges, WorkerView
from router.config import RouterConfig, WorkerSpec
from router.fleet.pulls import PullMeter
from router.fleet.telemetry import WorkerLoad
from router.http import UpstreamPool

log = logging.getLogger("router.fleet.workers")
_NEVER = float("inf")

# on_ejection(worker_id, ejected: True as it is ejected, False as it returns; workers ejected)
OnEjection = Callable[[str, bool, int], None]


@dataclass(slots=True)
class EjectionConfig:
    """When failing workers are ejected (see the module's docstring); the router's options
    `eject_consecutive_failures`, `eject_base_s`, `eject_max_s`, `eject_max_percent`."""

    consecutive_failures: int = 5  # 0: never eject
    base_s: float = 30.0
    max_s: float = 300.0
    max_percent: float = 50.0

    @classmethod
    def of(cls, config: RouterConfig) -> EjectionConfig:
        return cls(config.eject_consecutive_failures, config.eject_base_s, config.eject_max_s,
                   config.eject_max_percent)  # fmt: skip


class WorkerState:
    """One worker's state. What its view shows (`WorkerPool.views`: its spec, load, health,
    in-flight counts, draining, ejection, leaving) is set through properties that mark it
    changed in each `ModelPool` holding it, so a view is built again only where one did."""

    __slots__ = (
        "_draining",
        "_ejected",
        "_healthy",
        "_inflight",
        "_leaving",
        "_load",
        "_marks",
        "_spec",
        "_started_since_scrape",
        "consecutive_failures",
        "ejected_until",
        "ejections",
        "left_at",
        "models",
        "pulls",
        "returned_at",
        "scrape_epoch",
        "times_ejected",
        "view",
        "view_of",
    )

    def __init__(self, spec: WorkerSpec) -> None:
        # (a pool's marks, its position there) per `ModelPool` holding it (`watch`)
        self._marks: list[tuple[dict[int, None], int]] = []
        self._spec = spec
        self._healthy = True  # from the scraper (which also hears of refused connections)
        self._load: WorkerLoad | None = None
        self._draining = False
        self._inflight = 0  # this replica's own requests on the worker now
        self.models: tuple[str, ...] = ()
        # Of `inflight`, those that began answering since the last scrape (`scrape_epoch`
        # counts the scrapes): `WorkerView.started_since_scrape`.
        self._started_since_scrape = 0
        self.scrape_epoch = 0
        # outlier ejection: failed legs in a row; ejected until `ejected_until` (monotonic);
        # `times_ejected` is the ejection time's multiplier, `ejections` all ejections so far
        self.consecutive_failures = 0
        self._ejected = False
        self.ejected_until = 0.0
        self.times_ejected = 0
        self.ejections = 0
        self.returned_at = 0.0  # when it last came back from an ejection
        self._leaving = False  # it left the fleet and drains until `WorkerPool.reap` forgets it
        self.left_at = 0.0
        self.pulls = PullMeter()  # its engine's KV pulls, measured
        # Its latest view for the policy and what it was built from (`WorkerPool.views`): the
        # same object while nothing in it changed, so the policy re-ranks only the workers
        # whose views did (`policies.adaptive.fleet`).
        self.view: WorkerView | None = None
        self.view_of: tuple[object, ...] = ()

    def watch(self, marks: dict[int, None], position: int) -> None:
        """Mark `position` in `marks` (a `ModelPool`'s) whenever what the view shows changes."""
        self._marks.append((marks, position))

    def unwatch(self) -> None:
        self._marks.clear()

    def _changed(self) -> None:
        for marks, position in self._marks:
            marks[position] = None

    @property
    def spec(self) -> WorkerSpec:
        return self._spec

    @spec.setter
    def spec(self, spec: WorkerSpec) -> None:
        self._spec = spec
        self._changed()

    @property
    def healthy(self) -> bool:
        return self._healthy

    @healthy.setter
    def healthy(self, healthy: bool) -> None:
        if healthy != self._healthy:
            self._healthy = healthy
            self._changed()

    @property
    def load(self) -> WorkerLoad | None:
        return self._load

    @load.setter
    def load(self, load: WorkerLoad | None) -> None:
        self._load = load
        self._changed()

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, draining: bool) -> None:
        if draining != self._draining:
            self._draining = draining
            self._changed()

    @property
    def inflight(self) -> int:
        return self._inflight

    @inflight.setter
    def inflight(self, count: int) -> None:
        self._inflight = count
        self._changed()

    @property
    def started_since_scrape(self) -> int:
        return self._started_since_scrape

    @started_since_scrape.setter
    def started_since_scrape(self, count: int) -> None:
        if count != self._started_since_scrape:
            self._started_since_scrape = count
            self._changed()

    @property
    def ejected(self) -> bool:
        return self._ejected

    @ejected.setter
    def ejected(self, ejected: bool) -> None:
        if ejected != self._ejected:
            self._ejected = ejected
            self._changed()

    @property
    def leaving(self) -> bool:
        return self._leaving

    @leaving.setter
    def leaving(self, leaving: bool) -> None:
        if leaving != self._leaving:
            self._leaving = leaving
            self._changed()

    @property
    def available(self) -> bool:
        """Healthy by its scrapes and not ejected: offered to the policy as healthy."""
        return self._healthy and not self._ejected

    @property
    def serving(self) -> bool:
        """Counted among the workers that can take turns: available and not leaving."""
        return self._healthy and not self._ejected and not self._leaving


class ModelPool:
    """The workers serving one model (`model` None: every worker), and how many of them can
    take turns now (`serving`). Rebuilt, never edited, when the fleet or its models change
    (the one it replaces is `retired`); `serving` is recounted when a worker's health
    changes."""

    __slots__ = ("changes", "ids", "inflight_read", "marks", "members", "model", "retired",
                 "serving", "views")  # fmt: skip

    def __init__(self, model: str | None, members: tuple[WorkerState, ...]) -> None:
        self.model = model
        self.members = members
        self.ids = frozenset(state.spec.worker_id for state in members)
        self.serving = sum(1 for state in members if state.serving)
        # the members' views as the policy last saw them: shared while none changed
        self.views: tuple[WorkerView, ...] = ()
        # where `views` differs from the tuple before it (`ClusterView.changes`)
        self.changes: WorkerChanges | None = None
        # the positions of the members whose views may have changed since `views`
        self.marks: dict[int, None] = {}
        for position, state in enumerate(members):
            state.watch(self.marks, position)
        self.inflight_read: object = None  # the fleet's in-flight counts `views` last read
        self.retired = False


def nic_bps(nic_gbps: float) -> float:
    """A NIC's rate in bytes per second, from Gb/s (a link's capacity is its ends' lower)."""
    return nic_gbps * 1e9 / 8


class WorkerPool:
    """Every configured worker's state, plus the pooled client session used to reach them."""

    def __init__(
        self,
        specs: Iterable[WorkerSpec],
        ejection: EjectionConfig | None = None,
        on_ejection: OnEjection | None = None,
        clock: Callable[[], float] = time.monotonic,
        tls: ssl.SSLContext | None = None,
        departure_grace_s: float = 10.0,
    ) -> None:
        self.tls = tls  # for https:// workers (router.fleet.tls); None: the system's defaults
        self.workers: dict[str, WorkerState] = {spec.worker_id: WorkerState(spec) for spec in specs}
        self.departure_grace_s = departure_grace_s
        self._session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamPool | None = None
        # read on every turn: kept current where they change, not recounted per request
        self._healthy_count = len(self.workers)
        self._model_names: list[str] = []
        self._everyone = ModelPool(None, ())
        self._pools: dict[str, ModelPool] = {}
        self.ejection = ejection if ejection is not None else EjectionConfig()
        self._on_ejection = on_ejection
        self._clock = clock
        self._ejected: dict[str, float] = {}  # worker -> ejected until (monotonic)
        self._next_return = _NEVER  # the earliest of those
        self._return_timer: asyncio.TimerHandle | None = None
        self._rebuild()

    def open_session(self, connect_timeout_s: float) -> aiohttp.ClientSession:
        """Open the pooled clients: `upstream` carries turns (lean, keep-alive, TCP_NODELAY),
        the returned aiohttp session scrapes metrics and lists models, off the turn's path."""
        self._upstream = UpstreamPool(connect_timeout_s=connect_timeout_s, ssl_context=self.tls)
        # No per-host limit (the workers' own queues are the admission control) and no
        # environment proxies.
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            keepalive_timeout=60,
            enable_cleanup_closed=True,
            family=socket.AF_UNSPEC,
            ssl=self.tls if self.tls is not None else True,  # used for https:// workers only
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
            auto_decompress=False,
            trust_env=False,
            skip_auto_headers=("User-Agent",),
        )
        return self._session

    @property
    def upstream(self) -> UpstreamPool:
        if self._upstream is None:
            raise RuntimeError("worker pool not open")
        return self._upstream

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("worker pool session not open")
        return self._session

    async def close(self) -> None:
        if self._return_timer is not None:
            self._return_timer.cancel()
            self._return_timer = None
        if self._upstream is not None:
            await self._upstream.close()
            self._upstream = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def get(self, worker_id: str) -> WorkerState | None:
        return self.workers.get(worker_id)

    def url(self, worker_id: str) -> str:
        return self.workers[worker_id].spec.base_url

    def on_scrape(self, worker_id: str, load: WorkerLoad | None, healthy: bool) -> None:
        state = self.workers.get(worker_id)
        if state is None:
            return
        if state.healthy != healthy:
            state.healthy = healthy
            self._recount()
        if load is not None:
            state.load = load
            state.scrape_epoch += 1
            state.started_since_scrape = 0
            state.pulls.update(load)

    def healthy_count(self) -> int:
        """Workers healthy by their scrapes and not ejected."""
        if self._ejected:
            self._return_due()
        return self._healthy_count

    def _recount(self) -> None:
        self._healthy_count = sum(1 for s in self.workers.values() if s.serving)
        everyone = self._everyone
        everyone.serving = self._healthy_count if everyone.members else 0
        for pool in self._pools.values():
            pool.serving = sum(1 for s in pool.members if s.serving)

    # -- membership -----------------------------------------------------------------------
    def add(self, spec: WorkerSpec) -> WorkerState:
        """A worker joins (or one that is leaving comes back, or changes its spec). A new
        address is a new process: its models are listed again before it serves a model."""
        state = self.workers.get(spec.worker_id)
        if state is None:
            state = self.workers[spec.worker_id] = WorkerState(spec)
        else:
            if state.spec.url != spec.url:
                state.models, state.load, state.healthy = (), None, True
            state.spec, state.leaving = spec, False
        self._rebuild()
        return state

    def leave(self, worker_id: str) -> bool:
        """The worker left the fleet: it drains (see the module's docstring); False when it
        is not here or already leaving."""
        state = self.workers.get(worker_id)
        if state is None or state.leaving:
            return False
        state.leaving, state.left_at = True, self._clock()
        self._recount()
        return True

    def reap(self) -> list[str]:
        """Forget the workers that left, once drained and past `departure_grace_s`; their
        ids."""
        now = self._clock()
        gone = [
            worker_id for worker_id, state in self.workers.items()
            if state.leaving and state.inflight <= 0
            and now - state.left_at >= self.departure_grace_s
        ]  # fmt: skip
        if not gone:
            return gone
        for worker_id in gone:
            self.workers.pop(worker_id).unwatch()
            if self._ejected.pop(worker_id, None) is not None:
                self._next_return = min(self._ejected.values(), default=_NEVER)
        self._rebuild()
        return gone

    def pool_for(self, model: str | None) -> ModelPool | None:
        """The workers a turn for `model` may go to; None for a model no worker serves (and,
        where several are served, for a turn that names none). One lookup per turn."""
        pools = self._pools
        if not pools:
            return self._everyone  # no worker has listed its models: anyone may serve
        if model is None:
            if len(pools) == 1:
                return next(iter(pools.values()))
            return None
        return pools.get(model)

    def _rebuild(self) -> None:
        """The pools and the model names from the workers as they are now (on a change of
        membership or of a worker's models, never per turn)."""
        self._everyone.retired = True
        for pool in self._pools.values():
            pool.retired = True
        members: dict[str, list[WorkerState]] = {}
        for state in self.workers.values():
            state.unwatch()
            for name in state.models:
                members.setdefault(name, []).append(state)
        self._everyone = ModelPool(None, tuple(self.workers.values()))
        self._pools = {name: ModelPool(name, tuple(states)) for name, states in members.items()}
        self._model_names = list(members)
        self._recount()

    # -- outlier ejection ---------------------------------------------------------------------
    def record_success(self, worker_id: str) -> None:
        """A leg the worker answered (any status below 500): its failure run ends."""
        state = self.workers.get(worker_id)
        if state is not None and state.consecutive_failures:
            state.consecutive_failures = 0

    def record_failure(self, worker_id: str) -> bool:
        """A leg the worker failed (5xx, timeout, refused or broken connection); True when
        this failure ejected it."""
        state = self.workers.get(worker_id)
        if state is None:
            return False
        state.consecutive_failures += 1
        config = self.ejection
        threshold = config.consecutive_failures
        if state.ejected or threshold <= 0 or state.consecutive_failures < threshold:
            return False
        now = self._clock()
        if self._ejected:
            self._return_due(now)
        ejected, fleet = len(self._ejected), len(self.workers)
        if 100.0 * (ejected + 1) > config.max_percent * fleet and (ejected or fleet < 2):
            return False  # too much of the fleet is out already: it stays, failing or not
        if state.times_ejected and state.returned_at:
            served = int((now - state.returned_at) / config.base_s)
            state.times_ejected = max(0, state.times_ejected - served)
        state.times_ejected += 1
        state.ejections += 1
        seconds = min(config.base_s * state.times_ejected, config.max_s)
        state.ejected, state.ejected_until = True, now + seconds
        self._ejected[worker_id] = state.ejected_until
        self._next_return = min(self._next_return, state.ejected_until)
        self._arm_return(now)
        self._recount()
        log.warning("worker %s ejected for %g s after %d failed requests in a row",
                    worker_id, seconds, state.consecutive_failures)  # fmt: skip
        self._notify(worker_id, True)
        return True

    def ejected_for(self, worker_id: str) -> float:
        """Seconds until the worker returns from its ejection; 0.0 when it is not ejected."""
        if self._ejected:
            self._return_due()
        state = self.workers.get(worker_id)
        if state is None or not state.ejected:
            return 0.0
        return max(0.0, state.ejected_until - self._clock())

    def _return_due(self, now: float | None = None) -> None:
        """Bring back every worker whose ejection has ended (one comparison until one has)."""
        now = self._clock() if now is None else now
        if now < self._next_return:
            return
        returned = [w for w, until in self._ejected.items() if until <= now]
        for worker_id in returned:
            del self._ejected[worker_id]
            state = self.workers[worker_id]  # reap drops a forgotten worker's ejection
            state.ejected, state.consecutive_failures, state.returned_at = False, 0, now
            log.info("worker %s back from its ejection", worker_id)
        self._next_return = min(self._ejected.values(), default=_NEVER)
        self._recount()
        for worker_id in returned:
            self._notify(worker_id, False)

    def _arm_return(self, now: float) -> None:
        """One timer, at the earliest return (running in an event loop; reads check too)."""
        if self._return_timer is not None:
            self._return_timer.cancel()
            self._return_timer = None
        if not self._ejected:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        delay = max(0.001, self._next_return - now)
        self._return_timer = loop.call_later(delay, self._on_return_timer)

    def _on_return_timer(self) -> None:
        self._return_timer = None
        now = self._clock()
        self._return_due(now)
        self._arm_return(now)

    def _notify(self, worker_id: str, ejected: bool) -> None:
        if self._on_ejection is not None:
            try:
                self._on_ejection(worker_id, ejected, len(self._ejected))
            except Exception:
                log.exception("on_ejection failed for worker %s", worker_id)

    def model_names(self) -> list[str]:
        """Every model some worker lists (LoRA adapters included), each once."""
        return self._model_names

    def set_models(self, worker_id: str, models: tuple[str, ...]) -> bool:
        """The models a worker listed; True when they changed (the pools are rebuilt)."""
        state = self.workers.get(worker_id)
        if state is None or state.models == models:
            return False
        state.models = models
        self._rebuild()
        return True

    def views(
        self, fleet_inflight: Mapping[str, int], now: float, pool: ModelPool | None = None
    ) -> tuple[WorkerView, ...]:
        """The policy's view of the pool's workers (default: every worker), with the fleet's
        in-flight counts (an ejected worker reads as unhealthy, a leaving one as draining).
        A worker's view is built again only when what it shows changed (a scrape, its
        in-flight counts, its health), and the tuple is the last one while none did: its
        scrape's time is `scraped_at_s`, on the clock of `now` (the telemetry's).

        Only the workers marked changed since the last call are read (`WorkerState`), and
        every worker where `fleet_inflight` is another object than the last call's: edit
        it in place only along with the worker's own count (as a leg does, on both), or
        pass a new mapping. `changes(pool)` says which views changed."""
        if self._ejected:
            self._return_due()
        owner = self._everyone if pool is None else pool
        members, shared, marks = owner.members, owner.views, owner.marks
        count = len(members)
        if owner.retired or fleet_inflight is not owner.inflight_read or len(shared) != count:
            owner.inflight_read = fleet_inflight
            marks.clear()
            views = [self._view_of(state, fleet_inflight, now) for state in members]
            if len(shared) != count:
                owner.changes = None
            else:
                changed = [at for at in range(count) if views[at] is not shared[at]]
                if not changed:
                    return shared
                owner.changes = WorkerChanges(shared, tuple(changed))
            built = tuple(views)
            owner.views = built
            return built
        if not marks:
            return shared
        moved: list[int] = []
        listed: list[WorkerView] | None = None
        for at in sorted(marks):
            view = self._view_of(members[at], fleet_inflight, now)
            if view is not shared[at]:
                if listed is None:
                    listed = list(shared)
                listed[at] = view
                moved.append(at)
        marks.clear()
        if listed is None:
            return shared
        built = tuple(listed)
        owner.changes = WorkerChanges(shared, tuple(moved))
        owner.views = built
        return built

    def changes(self, pool: ModelPool | None = None) -> WorkerChanges | None:
        """Where the pool's latest `views` differ from the tuple before them (None: unknown)."""
        return (self._everyone if pool is None else pool).changes

    @staticmethod
    def _view_of(state: WorkerState, fleet_inflight: Mapping[str, int], now: float) -> WorkerView:
        """The worker's view: the last one while what it shows is the same."""
        spec = state.spec
        worker_id = spec.worker_id
        load = state.load
        inflight = state.inflight
        others = fleet_inflight.get(worker_id, 0)
        inflight = inflight if inflight > others else others
        healthy = state.healthy and not state.ejected
        draining = state.draining or state.leaving
        shown = (spec, load, healthy, inflight, state.started_since_scrape, draining)
        view = state.view
        if view is None or shown != state.view_of:
            view = state.view = WorkerView(
                worker_id=worker_id,
                role=spec.role,
                healthy=healthy,
                running=load.running if load else 0,
                waiting=load.waiting if load else 0,
                kv_usage=load.kv_usage if load else 0.0,
                inflight=inflight,
                started_since_scrape=state.started_since_scrape,
                draining=draining,
                node=spec.node,
                scraped_age_s=max(0.0, now - load.scraped_at) if load else 0.0,
                scraped_at_s=load.scraped_at if load else None,
                priority_scheduling=spec.priority_scheduling,
                nic_bps=nic_bps(spec.nic_gbps),
            )
            state.view_of = shown
        return view
