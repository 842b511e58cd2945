"""Assemble the router: shared state, worker telemetry, policy, pipeline and HTTP endpoints."""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from policies import create_policy
from policies.types import WorkerView, idle_link_bps
from router.admin import Admin
from router.api import PASS_THROUGH, RESPONSES, SESSIONS_PREFIX, Api
from router.config import RouterConfig, WorkerSpec
from router.errors import error_response
from router.fleet.discovery import Source, source_of
from router.fleet.membership import Membership
from router.fleet.telemetry import Scraper, ScrapeTarget, WorkerLoad
from router.fleet.tls import worker_ssl_context
from router.fleet.workers import EjectionConfig, WorkerPool, WorkerState, nic_bps
from router.http import Request, Response, StreamWriter
from router.obs.events import EventLog, StageClock
from router.obs.metrics import RouterMetrics
from router.obs.tracing import Tracing
from router.state.embedded_redis import EmbeddedRedis
from router.state.health import describe_error
from router.state.shared import SharedState, StateConfig, WorkerRecord
from router.turn.execute import Executor
from router.turn.legs import LegRunner, LegTimeouts, WorkerUnreachable
from router.turn.pipeline import PolicyHolder, TurnPipeline

log = logging.getLogger("router")
_REAP_EVERY_S = 1.0  # how often workers that left are checked for having drained
_FIRST_REPORT_S = 10.0  # at start, the longest wait for discovery's first set of workers
_encode = msgspec.json.Encoder().encode


class Router:
    """One router replica. `start()` brings everything up; `handle` serves every request."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        # --api-key guards every endpoint but /health (and /admin, which has its own token)
        self._api_key = None if config.api_key is None else config.api_key.encode()
        self.metrics = RouterMetrics()
        self.pool = WorkerPool(
            config.workers,
            EjectionConfig.of(config),
            self.metrics.worker_ejection,
            tls=worker_ssl_context(config),
            departure_grace_s=config.departure_grace_s,
        )
        self.metrics.bind_workers(self.pool.workers)
        self.membership = Membership(self.pool, self._joined, self._left, self._forgotten)
        self.discovery: Source | None = source_of(config)
        policy_config = config.policy
        self.policy = PolicyHolder(
            policy_config.name, create_policy(policy_config.name, policy_config.params)
        )
        self.events = EventLog(path=config.events)
        self.clock = StageClock()
        # --otel: spans per turn and leg (the `otel` extra; OTEL_* variables configure it)
        self.tracing = Tracing.from_environment() if config.otel else None
        self._embedded: EmbeddedRedis | None = None
        self.state: SharedState | None = None
        self.scraper: Scraper | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._models: dict[str, dict[str, Any]] = {}
        self._endpoints: dict[str, Callable[[], Awaitable[Response]]] = {
            "/v1/models": self._list_models,
            "/health": self._health,
            "/ready": self._ready,
            "/metrics": self._metrics,
            "/version": self._version,
        }

    async def start(self) -> None:
        config = self.config
        url = config.redis
        if url == "embedded":
            self._embedded = EmbeddedRedis()
            url = self._embedded.start()
        state_config = StateConfig(
            url=url,
            prefix=config.redis_prefix,
            session_ttl_s=config.session_ttl_s,
            command_timeout_s=config.redis_timeout_s,
            connect_timeout_s=config.redis_connect_timeout_s,
        )
        self.state = SharedState(
            state_config,
            on_roundtrip=self.metrics.redis_roundtrip,
            on_degraded=self._on_degraded,
        )
        await self.state.start()
        self.state.leave_out_idle_links(self._implied_link_bps)
        session = self.pool.open_session(config.connect_timeout_s)
        for state in self.pool.workers.values():
            self._declare_links(state)
        interval = config.scrape_interval_ms / 1000
        targets = [_target(state) for state in self.pool.workers.values()]
        self.scraper = Scraper(session, targets, interval, max(0.2, 4 * interval),
                               self._on_scrape, on_models=self._on_models)  # fmt: skip
        await self.scraper.scrape_once()  # the static workers' loads and models
        self.scraper.start()
        self._tasks.append(asyncio.create_task(self._reap_loop()))
        if self.discovery is not None:
            await self._start_discovery(self.discovery)
        legs = LegRunner(self.pool, self.state, self.clock, self._on_upstream_error,
                         LegTimeouts.of(config))  # fmt: skip
        executor = Executor(config, legs, self.state, self.clock)
        self.pipeline = TurnPipeline(
            config, self.pool, self.state, self.policy, self.metrics, self.events, executor,
            self.clock, self._mark_failed,
        )  # fmt: skip
        self.pipeline.tracing = self.tracing
        self.api = Api(config, self.pool, legs, self.state)
        self.admin = Admin(config.admin_token, self.pool, self.state, self.events, self.policy,
                           allow_policy_import=config.allow_policy_import,
                           membership=self.membership)  # fmt: skip

    async def stop(self) -> None:
        pipeline: TurnPipeline | None = getattr(self, "pipeline", None)  # set by start()
        if pipeline is not None:
            pipeline.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # after close(): the last turns' spans are made
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks.clear()
        if self.scraper is not None:
            await self.scraper.stop()
        await self.pool.close()
        if self.state is not None:
            await self.state.close()
        await self.events.close()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def reload(self) -> None:
        """SIGHUP: discovery looks again now (the workers file is read again)."""
        if self.discovery is not None:
            self.discovery.reload()

    # -- membership -------------------------------------------------------------------------
    async def _start_discovery(self, source: Source) -> None:
        """Run the source; wait (a while) for its first set, so that the router does not
        start without the workers it is about to hear of."""
        first = asyncio.Event()

        def on_workers(specs: tuple[WorkerSpec, ...]) -> None:
            self.membership.reconcile(source.name, specs)
            first.set()

        self._tasks.append(asyncio.create_task(_supervised(source, on_workers)))
        try:
            async with asyncio.timeout(_FIRST_REPORT_S):
                await first.wait()
        except TimeoutError:
            log.warning("%s discovery reported no workers within %g s; serving on",
                        source.name, _FIRST_REPORT_S)  # fmt: skip

    def _joined(self, state: WorkerState) -> None:
        """A worker joined (or changed its spec): scrape it (its first scrape, now, lists its
        models; until then it serves no model), declare its links, show its metrics."""
        worker_id = state.spec.worker_id
        self.metrics.bind_workers((worker_id,))
        if self.state is not None:
            self._declare_links(state)
        if self.scraper is not None:
            self.scraper.add(_target(state))

    def _left(self, worker_id: str) -> None:
        """A worker left: no more scrapes; it drains (`WorkerPool.leave`). Its sessions'
        residency is void from now: the policy no longer sees the worker as able to serve
        (it migrates or recomputes them) and their next turns' commits replace it."""
        if self.scraper is not None:
            self.scraper.remove(worker_id)
        self.metrics.worker_update(worker_id, None, False)

    def _forgotten(self, worker_id: str) -> None:
        log.info("worker %s drained and forgotten", worker_id)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            self.membership.reap()

    # -- wiring ---------------------------------------------------------------------------
    def _declare_links(self, joined: WorkerState) -> None:
        """The link capacities between a worker and every other, both ways where the roles
        allow a transfer (a prefill-capable source, a decode-capable destination)."""
        assert self.state is not None
        new = joined.spec
        for state in self.pool.workers.values():
            other = state.spec
            if other.worker_id == new.worker_id:
                continue
            for src, dst in ((new, other), (other, new)):
                if src.role == "decode" or dst.role == "prefill":
                    continue
                capacity = nic_bps(min(src.nic_gbps, dst.nic_gbps))
                self.state.set_link_capacity(src.worker_id, dst.worker_id, capacity)

    def _implied_link_bps(self, src: str, dst: str) -> float:
        """The capacity a policy's view implies for the link src -> dst when it leaves it out
        (its workers' views carry their NIC rates, `WorkerPool.views`): an idle link declared
        so (`_declare_links`) need not be listed."""
        ends = [self.pool.get(src), self.pool.get(dst)]
        views = [
            None if state is None else WorkerView(
                worker_id=state.spec.worker_id, role=state.spec.role, healthy=True,
                nic_bps=nic_bps(state.spec.nic_gbps),
            )
            for state in ends
        ]  # fmt: skip
        return idle_link_bps(views[0], views[1])

    def _on_scrape(self, worker_id: str, load: WorkerLoad | None, healthy: bool) -> None:
        self.pool.on_scrape(worker_id, load, healthy)
        self.metrics.worker_update(worker_id, load, healthy)
        state = self.pool.get(worker_id)
        if load is not None and state is not None and self.state is not None:
            self.state.publish_worker(
                WorkerRecord(
                    worker_id=worker_id, role=state.spec.role, url=state.spec.url,
                    running=load.running, waiting=load.waiting, kv_usage=load.kv_usage,
                    scraped_at=load.scraped_at, scraped_by=self.state.config.replica_id,
                )
            )  # fmt: skip

    def _mark_failed(self, worker_id: str, reason: str | None = None) -> None:
        """The pipeline could not reach `worker_id`. It calls this while it handles the error,
        so without a `reason` the error in hand gives one: its class and message (a timeout is
        not a refused connection)."""
        if self.scraper is None:
            return
        if reason is None:
            error = sys.exc_info()[1]
            if isinstance(error, WorkerUnreachable) and error.__cause__ is not None:
                error = error.__cause__
            reason = "unreachable" if error is None else describe_error(error)
        self.scraper.mark_failed_now(worker_id, reason)

    def _on_upstream_error(self, worker_id: str, kind: str) -> None:
        self.metrics.upstream_error(worker_id, kind)

    def _on_degraded(self, degraded: bool) -> None:
        self.metrics.set_degraded(degraded)

    def _on_models(self, worker_id: str, models: tuple[dict[str, Any], ...]) -> None:
        """A worker's /v1/models (on the scrape path): its pools, and the union's entries."""
        for model in models:
            self._models[model["id"]] = model
        if self.pool.set_models(worker_id, tuple(model["id"] for model in models)):
            log.info("worker %s serves %s", worker_id, ", ".join(m["id"] for m in models))

    # -- endpoints --------------------------------------------------------------------------
    def handle(self, request: Request, writer: StreamWriter) -> Awaitable[Response | None]:
        """The HTTP server's one handler: turns, the OpenAI listing, health, metrics, admin.

        A turn is the pipeline's own coroutine (no wrapper to step through on every resume)."""
        path = request.path
        if self._api_key is not None and path != "/health" and not path.startswith(Admin.PREFIX):
            if not bearer_matches(request.headers.get("authorization"), self._api_key):
                return _answer(error_response(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    headers={"WWW-Authenticate": "Bearer"},
                ))  # fmt: skip
        method = request.method
        if method == "POST" and (path == "/v1/chat/completions" or path == "/v1/completions"):
            content_type = request.headers.get("content-type")
            if content_type != "application/json" and not is_json_media_type(content_type):
                return _answer(_unsupported_media_type(content_type))
            return self.pipeline.handle(request, writer, chat=path == "/v1/chat/completions")
        if method == "POST" and (path in PASS_THROUGH or path == RESPONSES):
            content_type = request.headers.get("content-type")
            if content_type != "application/json" and not is_json_media_type(content_type):
                return _answer(_unsupported_media_type(content_type))
            if path == RESPONSES:
                return self.api.responses(request, writer)
            return self.api.forward(request, writer)
        if method == "DELETE" and path.startswith(SESSIONS_PREFIX):
            return self.api.end_session(path[len(SESSIONS_PREFIX) :])
        return self._handle_other(request)

    async def _handle_other(self, request: Request) -> Response | None:
        path, method = request.path, request.method
        if path == "/v1/chat/completions" or path == "/v1/completions":
            return error_response(405, f"method {method} not allowed")
        if path in PASS_THROUGH or path == RESPONSES:
            return error_response(405, f"method {method} not allowed")
        if path.startswith(SESSIONS_PREFIX) and len(path) > len(SESSIONS_PREFIX):
            return error_response(405, f"method {method} not allowed")
        self.pipeline.settle()  # what is reported includes every turn already answered
        if path.startswith(Admin.PREFIX):
            return await self.admin.handle(request)
        endpoint = self._endpoints.get(path)
        if endpoint is None:
            return error_response(404, f"{path} not found")
        if method not in ("GET", "HEAD"):
            return error_response(405, f"method {method} not allowed")
        return await endpoint()

    async def _list_models(self) -> Response:
        names = self.pool.model_names()
        data = [self._models[name] for name in names if name in self._models]
        return Response(200, _encode({"object": "list", "data": data}))

    async def _version(self) -> Response:
        return await self.api.version()

    async def _health(self) -> Response:
        degraded = self.state is not None and self.state.degraded
        return Response(200, _encode({"status": "ok", "degraded": degraded}))

    async def _ready(self) -> Response:
        """200 while turns can be served: some worker is healthy. Redis down is no reason to
        take a replica out of rotation (every replica would go at once, while each serves
        from its local view): `degraded` says so, as does the `session_router_degraded` gauge."""
        assert self.state is not None
        # while degraded the recovery task probes Redis; a probe here would only be slow
        redis_ok = not self.state.degraded and await self.state.ping()
        healthy = self.pool.healthy_count()
        body = {"redis": redis_ok, "healthy_workers": healthy, "degraded": self.state.degraded}
        return Response(200 if healthy > 0 else 503, _encode(body))

    async def _metrics(self) -> Response:
        for worker_id, worker in self.pool.workers.items():
            self.metrics.set_inflight(worker_id, worker.inflight)
        if self.state is not None:
            for (src, dst), link in self.state.link_views().items():
                self.metrics.set_link(src, dst, link.handoff_bytes, link.migration_bytes)
        return Response(200, self.metrics.render(), content_type=self.metrics.content_type)


async def _supervised(source: Source, on_workers: Callable[[tuple[WorkerSpec, ...]], None]) -> None:
    """Run a source for as long as the router runs: one that fails (sources retry their own
    errors, so a bug) is logged and started again."""
    while True:
        try:
            await source.run(on_workers)
        except Exception:
            log.exception("%s discovery failed; started again in 1 s", source.name)
        await asyncio.sleep(1.0)


def _target(state: WorkerState) -> ScrapeTarget:
    spec = state.spec
    return ScrapeTarget(worker_id=spec.worker_id, url=spec.base_url, engine=spec.engine)


async def _answer(response: Response) -> Response:
    return response


def _unsupported_media_type(content_type: str | None) -> Response:
    return error_response(
        415, "Content-Type must be application/json (UTF-8), got "
        f"{(content_type or 'none')[:64]!r}", "Content-Type",
    )  # fmt: skip


def bearer_matches(authorization: str | None, key: bytes) -> bool:
    """Whether an Authorization header is `Bearer <key>` (the scheme in any case), compared in
    constant time."""
    if authorization is None:
        return False
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode("latin-1", "replace")  # the header's own bytes
    return hmac.compare_digest(given, key) and scheme.lower() == "bearer"


def is_json_media_type(content_type: str | None) -> bool:
    """`application/json`, in any case, with parameters (a charset only if it is UTF-8): a
    browser's cross-site form post (urlencoded, multipart, text/plain) is not one."""
    if content_type is None:
        return False
    media, _, parameters = content_type.partition(";")
    if media.strip().lower() != "application/json":
        return False
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            return False
    return True
