"""The configured workers: who they are, how loaded and healthy, and one pooled HTTP client.

The router only ever connects to these workers, whatever a request says.

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
from dataclasses import dataclass, field

import aiohttp

from policies.types import WorkerView
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


@dataclass(slots=True)
class WorkerState:
    spec: WorkerSpec
    healthy: bool = True  # from the scraper (which also hears of refused connections)
    load: WorkerLoad | None = None
    draining: bool = False
    inflight: int = 0  # this replica's own requests on the worker now
    models: tuple[str, ...] = ()
    # Of `inflight`, those that began answering since the last scrape (`scrape_epoch` counts
    # the scrapes): `WorkerView.started_since_scrape`.
    started_since_scrape: int = 0
    scrape_epoch: int = 0
    # outlier ejection: failed legs in a row; ejected until `ejected_until` (monotonic);
    # `times_ejected` is the ejection time's multiplier, `ejections` all ejections so far
    consecutive_failures: int = 0
    ejected: bool = False
    ejected_until: float = 0.0
    times_ejected: int = 0
    ejections: int = 0
    returned_at: float = 0.0  # when it last came back from an ejection
    pulls: PullMeter = field(default_factory=PullMeter)  # its engine's KV pulls, measured

    @property
    def available(self) -> bool:
        """Healthy by its scrapes and not ejected: offered to the policy as healthy."""
        return self.healthy and not self.ejected


class WorkerPool:
    """Every configured worker's state, plus the pooled client session used to reach them."""

    def __init__(
        self,
        specs: Iterable[WorkerSpec],
        ejection: EjectionConfig | None = None,
        on_ejection: OnEjection | None = None,
        clock: Callable[[], float] = time.monotonic,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.tls = tls  # for https:// workers (router.fleet.tls); None: the system's defaults
        self.workers: dict[str, WorkerState] = {spec.worker_id: WorkerState(spec) for spec in specs}
        self._session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamPool | None = None
        # read on every turn: kept current where they change, not recounted per request
        self._healthy_count = len(self.workers)
        self._model_names: list[str] = []
        self.ejection = ejection if ejection is not None else EjectionConfig()
        self._on_ejection = on_ejection
        self._clock = clock
        self._ejected: dict[str, float] = {}  # worker -> ejected until (monotonic)
        self._next_return = _NEVER  # the earliest of those
        self._return_timer: asyncio.TimerHandle | None = None

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
        self._healthy_count = sum(1 for s in self.workers.values() if s.healthy and not s.ejected)

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
            state = self.workers[worker_id]
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
        return self._model_names

    def set_models(self, worker_id: str, models: tuple[str, ...]) -> None:
        self.workers[worker_id].models = models
        names: dict[str, None] = {}
        for state in self.workers.values():
            for name in state.models:
                names.setdefault(name)
        self._model_names = list(names)

    def views(self, fleet_inflight: Mapping[str, int], now: float) -> tuple[WorkerView, ...]:
        """The policy's view of every worker, with the fleet's in-flight counts (an ejected
        worker reads as unhealthy)."""
        if self._ejected:
            self._return_due()
        views = []
        for worker_id, state in self.workers.items():
            load = state.load
            views.append(
                WorkerView(
                    worker_id=worker_id,
                    role=state.spec.role,
                    healthy=state.healthy and not state.ejected,
                    running=load.running if load else 0,
                    waiting=load.waiting if load else 0,
                    kv_usage=load.kv_usage if load else 0.0,
                    inflight=max(state.inflight, fleet_inflight.get(worker_id, 0)),
                    started_since_scrape=state.started_since_scrape,
                    draining=state.draining,
                    node=state.spec.node,
                    scraped_age_s=max(0.0, now - load.scraped_at) if load else 0.0,
                    priority_scheduling=state.spec.priority_scheduling,
                )
            )
        return tuple(views)
