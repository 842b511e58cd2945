"""Worker telemetry: scrape each worker's /metrics, keep its load and its health.

The router places turns from live worker load (queue lengths, KV usage). A `Scraper` polls every
worker on a fixed-rate schedule, each worker independently, so a slow or dead worker never
delays the others' updates; a `WorkerHealth` per worker turns scrape results (and refused
connections reported by the proxy) into a healthy flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

import aiohttp
import msgspec

from router.engines import sglang, vllm
from router.engines.metrics import EngineMetrics
from router.fleet.prom_text import Sample, parse_samples

logger = logging.getLogger("router.fleet.telemetry")

Engine = Literal["vllm", "sglang"]


class WorkerLoad(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker's load at `scraped_at` (unix seconds).

    `running`/`waiting` are summed over the worker's engines (data-parallel ranks);
    `kv_usage` (0..1) is the fullest engine's. The prefix-cache counters are cumulative
    (tokens on current vLLM; some older releases counted blocks) and None where the engine
    does not expose them. So are the KV pulls' counters (`pulls` transfers into this worker,
    taking `pull_seconds` and moving `pull_bytes` in all: vLLM's NIXL metrics).
    """

    running: int
    waiting: int
    kv_usage: float
    prefix_hits: int | None
    prefix_queries: int | None
    scraped_at: float
    pulls: int | None = None
    pull_seconds: float | None = None
    pull_bytes: float | None = None


# on_update(worker_id, load or None when the scrape failed, healthy)
OnUpdate = Callable[[str, WorkerLoad | None, bool], None]
# on_models(worker_id, the model objects of its /v1/models, each with a string "id")
OnModels = Callable[[str, tuple[dict[str, Any], ...]], None]

# A worker's /v1/models is read at its first good scrape, as it turns healthy again, and then
# every MODELS_EVERY_S (LoRA adapters come and go); what it lists is bounded.
MODELS_EVERY_S = 30.0
MAX_MODELS = 4096
MAX_MODEL_ID_CHARS = 1024


def parse_models(body: bytes) -> tuple[dict[str, Any], ...]:
    """The model objects of an OpenAI `/v1/models` answer (LoRA adapters are entries too):
    each an object with a non-empty string `id`, at most `MAX_MODEL_ID_CHARS` long, ids
    unique; ValueError for anything else."""
    data = msgspec.json.decode(body)
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list) or len(entries) > MAX_MODELS:
        raise ValueError(f"not a model list of at most {MAX_MODELS} entries")
    models: dict[str, dict[str, Any]] = {}
    for entry in entries:
        ident = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(ident, str) or not 0 < len(ident) <= MAX_MODEL_ID_CHARS:
            raise ValueError(f"a model entry without a usable id: {str(entry)[:100]!r}")
        models.setdefault(ident, entry)
    return tuple(models.values())


_ENGINES: dict[str, EngineMetrics] = {"vllm": vllm.METRICS, "sglang": sglang.METRICS}


def parse_worker_load(text: str, engine: Engine, now: float) -> WorkerLoad:
    """A worker's load from its /metrics page; `now` becomes `scraped_at`.

    A gauge the page lacks counts as 0; a page with none of the engine's load gauges raises
    ValueError (wrong engine kind, or not a worker's metrics page). NaN and infinite values
    are ignored.
    """
    spec = _ENGINES[engine]
    samples = _read_groups(text, spec.groups)
    running = _pick(samples, spec.running)
    waiting = _pick(samples, spec.waiting)
    usage = _pick(samples, spec.kv_usage)
    if running is None and waiting is None and usage is None:
        expected = ", ".join(spec.running + spec.waiting + spec.kv_usage)
        raise ValueError(f"no {engine} load metrics in the scraped page (expected {expected})")
    hits = _pick(samples, spec.prefix_hits)
    queries = _pick(samples, spec.prefix_queries)
    pulls = _pick(samples, spec.pulls)
    pull_seconds = _pick(samples, spec.pull_seconds)
    pull_bytes = _pick(samples, spec.pull_bytes)
    if hits is None and queries is not None:
        hits = []  # SGLang writes its cached-token series at the first hit only
    return WorkerLoad(
        running=round(_sum_replicas(running, spec.replica_label)),
        waiting=round(_sum_replicas(waiting, spec.replica_label)),
        kv_usage=min(1.0, max(0.0, _max_value(usage))),
        prefix_hits=None if hits is None else round(_sum_finite(hits)),
        prefix_queries=None if queries is None else round(_sum_finite(queries)),
        scraped_at=now,
        pulls=None if pulls is None else round(_sum_finite(pulls)),
        pull_seconds=None if pull_seconds is None else _sum_finite(pull_seconds),
        pull_bytes=None if pull_bytes is None else _sum_finite(pull_bytes),
    )


def _read_groups(text: str, groups: tuple[tuple[str, ...], ...]) -> dict[str, list[Sample]]:
    # Each name costs a scan of the page, so older names are looked for only when the
    # current name is absent.
    samples = parse_samples(text, frozenset(names[0] for names in groups if names))
    fallbacks = frozenset(
        name for names in groups if names and names[0] not in samples for name in names[1:]
    )
    if fallbacks:
        samples.update(parse_samples(text, fallbacks))
    return samples


def _pick(samples: dict[str, list[Sample]], names: tuple[str, ...]) -> list[Sample] | None:
    for name in names:
        found = samples.get(name)
        if found is not None:
            return found
    return None


def _sum_replicas(series: list[Sample] | None, replica_label: str) -> float:
    if not series:
        return 0.0
    per_replica: dict[str, float] = {}
    for labels, value in series:
        if math.isfinite(value):
            key = labels.get(replica_label, "")
            per_replica[key] = max(value, per_replica.get(key, value))
    return sum(per_replica.values())


def _sum_finite(series: list[Sample]) -> float:
    return sum(value for _, value in series if math.isfinite(value))


def _max_value(series: list[Sample] | None) -> float:
    if not series:
        return 0.0
    return max((value for _, value in series if math.isfinite(value)), default=0.0)


class WorkerHealth:
    """Health of one worker from consecutive scrape results.

    A worker never scraped yet counts as healthy (`known` is False): the router may start
    before its workers finish booting, and a worker that is really down is caught within
    `failure_threshold` scrape intervals, or at once when the proxy's connection is refused
    (`mark_failed_now`). It turns unhealthy after `failure_threshold` consecutive failures and
    healthy again after one success. Each `record_*` returns True when `healthy` changed.
    """

    __slots__ = ("_healthy", "consecutive_failures", "failure_threshold", "known")

    def __init__(self, failure_threshold: int = 3) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.failure_threshold = failure_threshold
        self.consecutive_failures = 0
        self.known = False
        self._healthy = True

    @property
    def healthy(self) -> bool:
        return self._healthy

    def record_success(self) -> bool:
        self.known = True
        self.consecutive_failures = 0
        changed = not self._healthy
        self._healthy = True
        return changed

    def record_failure(self) -> bool:
        self.known = True
        self.consecutive_failures += 1
        if self._healthy and self.consecutive_failures >= self.failure_threshold:
            self._healthy = False
            return True
        return False

    def mark_failed_now(self) -> bool:
        """Unhealthy at once (the proxy saw a refused connection); the next success heals."""
        self.known = True
        self.consecutive_failures = max(self.consecutive_failures, self.failure_threshold)
        changed = self._healthy
        self._healthy = False
        return changed


class ScrapeTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A worker to scrape: its id, base URL (without /metrics) and engine kind."""

    worker_id: str
    url: str
    engine: Engine


def next_tick(previous_tick: float, interval_s: float, now: float) -> float:
    """The fixed-rate schedule: previous tick + interval, skipping ticks already missed."""
    tick = previous_tick + interval_s
    if tick <= now:
        tick += (math.floor((now - tick) / interval_s) + 1) * interval_s
    return tick


class Scraper:
    """Scrapes every target's GET {url}/metrics and reports each result to `on_update`.

    `on_update(worker_id, load, healthy)` runs once per scrape result as soon as that worker
    answers or fails (`load` is None on failure). Running (`start`), each worker is scraped on
    its own fixed-rate schedule; a worker whose previous scrape is still pending skips the
    tick, so a hanging worker holds up nobody, and at most one scrape per worker is in flight.
    `scraped_at` is taken from `clock` (unix seconds), so replicas can judge each other's data.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        targets: Sequence[ScrapeTarget],
        interval_s: float,
        timeout_s: float,
        on_update: OnUpdate,
        *,
        failure_threshold: int = 3,
        clock: Callable[[], float] = time.time,
        on_models: OnModels | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be positive")
        ids = [target.worker_id for target in targets]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate worker_id in scrape targets")
        self._session = session
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._on_update = on_update
        self._on_models = on_models
        self._models_every = max(1, round(MODELS_EVERY_S / interval_s))  # in scrapes
        self._failure_threshold = failure_threshold
        self._clock = clock
        self._targets: dict[str, ScrapeTarget] = {}
        self._urls: dict[str, tuple[str, str]] = {}  # worker -> (metrics URL, models URL)
        self._health: dict[str, WorkerHealth] = {}
        self._models_due: dict[str, int] = {}  # worker -> scrapes until its models are read
        self._loads: dict[str, WorkerLoad] = {}
        self._healthy: dict[str, bool] = {}
        self._loads_view = MappingProxyType(self._loads)
        self._healthy_view = MappingProxyType(self._healthy)
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        for target in targets:
            self.add(target)

    def add(self, target: ScrapeTarget) -> None:
        """Scrape one more worker (or a known one at its new URL), from the next tick; while
        running, its first scrape starts now."""
        worker_id = target.worker_id
        known = self._targets.get(worker_id)
        if known == target:
            return
        if known is not None:
            self.remove(worker_id)
        base = target.url.rstrip("/")
        self._targets[worker_id] = target
        self._urls[worker_id] = (base + "/metrics", base + "/v1/models")
        self._health[worker_id] = WorkerHealth(self._failure_threshold)
        self._healthy[worker_id] = True
        self._models_due[worker_id] = 0
        if self._loop_task is not None:
            self._inflight[worker_id] = asyncio.get_running_loop().create_task(self._scrape(target))

    def remove(self, worker_id: str) -> None:
        """Stop scraping a worker (a scrape in flight is cancelled); no-op for an unknown one."""
        if self._targets.pop(worker_id, None) is None:
            return
        pending = self._inflight.pop(worker_id, None)
        if pending is not None:
            pending.cancel()
        for table in (self._urls, self._health, self._models_due, self._loads, self._healthy):
            table.pop(worker_id, None)

    def loads(self) -> Mapping[str, WorkerLoad]:
        """The last successful load per worker (a live read-only view; stale ones included)."""
        return self._loads_view

    def health(self) -> Mapping[str, bool]:
        """The healthy flag per worker (a live read-only view)."""
        return self._healthy_view

    def worker_health(self, worker_id: str) -> WorkerHealth:
        return self._health[worker_id]

    def targets(self) -> Mapping[str, ScrapeTarget]:
        return MappingProxyType(self._targets)

    def start(self) -> None:
        """Begin scraping in the background; call from within the running event loop."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop the schedule and cancel scrapes in flight."""
        tasks = list(self._inflight.values())
        if self._loop_task is not None:
            tasks.append(self._loop_task)
            self._loop_task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._inflight.clear()

    async def scrape_once(self) -> None:
        """Scrape all targets concurrently, each under its own timeout; wait for all."""
        await asyncio.gather(*(self._scrape(target) for target in list(self._targets.values())))

    def mark_failed_now(self, worker_id: str, reason: str = "connection refused") -> None:
        """The proxy saw this worker fail: mark it unhealthy without waiting for a scrape (a
        worker no longer scraped is ignored)."""
        health = self._health.get(worker_id)
        if health is None:
            return
        if health.mark_failed_now():
            logger.warning("worker %s marked unhealthy by the proxy: %s", worker_id, reason)
        self._publish(worker_id, None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        tick = loop.time()
        while True:
            for target in list(self._targets.values()):
                pending = self._inflight.get(target.worker_id)
                if pending is None or pending.done():
                    self._inflight[target.worker_id] = loop.create_task(self._scrape(target))
            tick = next_tick(tick, self._interval_s, loop.time())
            await asyncio.sleep(tick - loop.time())

    async def _scrape(self, target: ScrapeTarget) -> None:
        worker_id = target.worker_id
        urls = self._urls.get(worker_id)
        if urls is None or self._targets.get(worker_id) is not target:
            return  # removed (or moved) since this scrape was scheduled
        load: WorkerLoad | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._session.get(urls[0]) as response:
                    if response.status != 200:
                        raise ValueError(f"HTTP {response.status}")
                    body = await response.read()
            load = parse_worker_load(body.decode("utf-8", "replace"), target.engine, self._clock())
        except TimeoutError:
            self._failed(worker_id, f"no answer within {self._timeout_s:g} s")
        except Exception as exc:
            # Any failure, expected (connection refused, bad status, unparseable page) or not,
            # is a failed scrape of this worker only; the scraper itself must keep running.
            self._failed(worker_id, f"{type(exc).__name__}: {exc}")
        else:
            health = self._health.get(worker_id)
            if health is None:
                return  # removed while it was scraped
            self._loads[worker_id] = load
            if health.record_success():
                logger.info("worker %s healthy again", worker_id)
                self._models_due[worker_id] = 0  # a restarted worker may serve others now
            due = self._models_due[worker_id]
            if due <= 0 and self._on_models is not None:
                await self._read_models(worker_id, urls[1])
            else:
                self._models_due[worker_id] = due - 1
        self._publish(worker_id, load)

    async def _read_models(self, worker_id: str, url: str) -> None:
        """The worker's /v1/models, to `on_models`; read again in `MODELS_EVERY_S`, or at the
        next scrape where this one failed."""
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._session.get(url) as response:
                    if response.status != 200:
                        raise ValueError(f"HTTP {response.status}")
                    body = await response.read()
            models = parse_models(body)
        except TimeoutError:
            logger.warning("worker %s: /v1/models gave no answer within %g s", worker_id,
                           self._timeout_s)  # fmt: skip
            return
        except Exception as exc:  # as for a scrape: this worker's listing only
            logger.warning("worker %s: /v1/models unusable: %s: %s", worker_id,
                           type(exc).__name__, exc)  # fmt: skip
            return
        if worker_id not in self._targets:
            return
        self._models_due[worker_id] = self._models_every
        assert self._on_models is not None
        try:
            self._on_models(worker_id, models)
        except Exception:
            logger.exception("on_models failed for worker %s", worker_id)

    def _failed(self, worker_id: str, reason: str) -> None:
        health = self._health.get(worker_id)
        if health is None:
            return
        if health.record_failure():
            logger.warning(
                "worker %s unhealthy after %d consecutive failed scrapes, last: %s",
                worker_id,
                health.consecutive_failures,
                reason,
            )

    def _publish(self, worker_id: str, load: WorkerLoad | None) -> None:
        health = self._health.get(worker_id)
        if health is None:
            return  # removed while it was scraped
        healthy = health.healthy
        self._healthy[worker_id] = healthy
        try:
            self._on_update(worker_id, load, healthy)
        except Exception:
            logger.exception("on_update failed for worker %s", worker_id)
