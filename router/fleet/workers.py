"""The configured workers: who they are, how loaded and healthy, and one pooled HTTP client.

The router only ever connects to these workers, whatever a request says.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import aiohttp

from policies.types import WorkerView
from router.config import WorkerSpec
from router.fleet.telemetry import WorkerLoad
from router.http import UpstreamPool


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


class WorkerPool:
    """Every configured worker's state, plus the pooled client session used to reach them."""

    def __init__(self, specs: Iterable[WorkerSpec]) -> None:
        self.workers: dict[str, WorkerState] = {spec.worker_id: WorkerState(spec) for spec in specs}
        self._session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamPool | None = None
        # read on every turn: kept current where they change, not recounted per request
        self._healthy_count = len(self.workers)
        self._model_names: list[str] = []

    def open_session(self, connect_timeout_s: float) -> aiohttp.ClientSession:
        """Open the pooled clients: `upstream` carries turns (lean, keep-alive, TCP_NODELAY),
        the returned aiohttp session scrapes metrics and lists models, off the turn's path."""
        self._upstream = UpstreamPool(connect_timeout_s=connect_timeout_s)
        # No per-host limit (the workers' own queues are the admission control) and no
        # environment proxies.
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=0,
            keepalive_timeout=60,
            enable_cleanup_closed=True,
            family=socket.AF_UNSPEC,
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
            self._healthy_count = sum(1 for s in self.workers.values() if s.healthy)
        if load is not None:
            state.load = load
            state.scrape_epoch += 1
            state.started_since_scrape = 0

    def healthy_count(self) -> int:
        return self._healthy_count

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
        """The policy's view of every worker, with the fleet's in-flight counts."""
        views = []
        for worker_id, state in self.workers.items():
            load = state.load
            views.append(
                WorkerView(
                    worker_id=worker_id,
                    role=state.spec.role,
                    healthy=state.healthy,
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
