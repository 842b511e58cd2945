"""The router's own Prometheus metrics, served on its /metrics.

Every name is under `session_router_` and follows Prometheus's naming conventions: base units
(`_seconds`, `_bytes`), `_total` on counters, `_ratio` on 0..1 values and ratios, a plural
noun for counts (`_requests`, `_tokens`). The older `router_*` names are exported as well, for
one more release (`router.obs.aliases`).

Every method here may run on a request's path. Those that run on every turn update plain
numbers (`router.obs.cells`), exported when /metrics is scraped; the rarer ones use
prometheus_client children created once and then found in a dict.

`session_router_estimate_error_ratio{term}` is a histogram, not a gauge: a gauge would show only the
last turn's error, while calibrating the policies needs the distribution (bias is the median's
distance from 1, spread its width). Each observation is realised / predicted for one term of
I > H + dQ + dC, or for the TTFT estimate: 1 is exact, 2 means twice what was predicted, and a
sign disagreement (a delta predicted negative that came out positive) falls in the `le="0"`
bucket. Terms predicted as 0 (not estimated) are skipped. A ratio rather than the relative
error keeps every bucket bound non-negative, which prometheus_client needs to export `_sum`.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from typing import TYPE_CHECKING, get_args

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from policies.types import Action, Prediction
from router import native
from router.obs.aliases import DeprecatedNames
from router.obs.cells import CellsCollector, CounterCells, GaugeCells, HistogramCells
from router.obs.events import EventOutcome
from router.version import version

if TYPE_CHECKING:
    from router.fleet.telemetry import WorkerLoad

DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.025)
REDIS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
HANDOFF_BUCKETS = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
ERROR_RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0, 10.0)

# policy: the placement policy refused the turn (429); no_worker: no healthy or reachable
# worker could take it (503).
REJECT_REASONS = ("policy", "no_worker")

# Prediction field -> the `term` label value.
ESTIMATE_TERMS = (
    ("interference_ms", "interference"),
    ("exposed_transfer_ms", "exposed_transfer"),
    ("queue_delta_ms", "queue_delta"),
    ("compute_delta_ms", "compute_delta"),
    ("ttft_ms", "ttft"),
)


class RouterMetrics:
    """The router's metrics in their own registry (or the one given)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        # Label values known up front are bound now, so they render as 0 before first use.
        self.requests_total = CounterCells(
            "session_router_requests",
            "Turns finished, by action and outcome.",
            ["action", "outcome"],
            known=[(a, o) for a in get_args(Action) for o in get_args(EventOutcome)],
        )
        self.decisions_total = CounterCells(
            "session_router_decisions",
            "Placement decisions, by policy and action.",
            ["policy", "action"],
        )
        self.decision_seconds = HistogramCells(
            "session_router_decision_seconds", "Time in policy.decide.", DECISION_BUCKETS
        )
        self.redis_roundtrip_seconds = Histogram(
            "session_router_redis_roundtrip_seconds",
            "Redis round trips, by kind of operation.",
            ["kind"],
            buckets=REDIS_BUCKETS,
            registry=reg,
        )
        self.ttft_seconds = HistogramCells(
            "session_router_ttft_seconds",
            "Admission to the first content chunk relayed.",
            TTFT_BUCKETS,
        )
        self.handoff_seconds = HistogramCells(
            "session_router_handoff_seconds",
            "Prefill end to decode start of a handed-off turn.",
            HANDOFF_BUCKETS,
        )
        self.hold_seconds = HistogramCells(
            "session_router_hold_seconds",
            "How long turns were held in the router before going out, as decided.",
            HANDOFF_BUCKETS,
        )
        self.transfer_bytes_total = CounterCells(
            "session_router_transfer_bytes", "KV bytes moved between workers."
        )
        self.inflight = GaugeCells(
            "session_router_inflight_requests",
            "Turns this router has in flight, by worker.",
            ["worker"],
        )
        self.rejected_total = Counter(
            "session_router_rejected_requests_total",
            "Rejected turns, by reason.",
            ["reason"],
            registry=reg,
        )
        self.recomputed_tokens_total = CounterCells(
            "session_router_recomputed_tokens", "Context tokens prefilled again."
        )
        self.degraded = Gauge(
            "session_router_degraded",
            "1 while shared state is unreachable and the router runs on its local view.",
            registry=reg,
        )
        self.retries_total = Counter(
            "session_router_retries_total",
            "Retried upstream calls, by reason.",
            ["reason"],
            registry=reg,
        )
        self.worker_healthy = self._worker_gauge("session_router_worker_healthy", "1 if healthy.")
        self.worker_running = self._worker_gauge(
            "session_router_worker_running_requests", "Running requests."
        )
        self.worker_waiting = self._worker_gauge(
            "session_router_worker_waiting_requests", "Waiting requests."
        )
        self.worker_kv_usage = self._worker_gauge(
            "session_router_worker_kv_usage_ratio", "KV usage, 0..1."
        )
        self.link_reserved_bytes = Gauge(
            "session_router_link_reserved_bytes",
            "Bytes reserved on a link (all replicas).",
            ["src", "dst"],
            registry=reg,
        )
        self.link_inflight_bytes = Gauge(
            "session_router_link_inflight_bytes",
            "Bytes in flight on a link (all replicas).",
            ["src", "dst"],
            registry=reg,
        )
        self.estimate_error_ratio = HistogramCells(
            "session_router_estimate_error_ratio",
            "realised / predicted, by term.",
            ERROR_RATIO_BUCKETS,
            ["term"],
            known=[(term,) for _, term in ESTIMATE_TERMS],
        )
        self.client_disconnects_total = Counter(
            "session_router_client_disconnects_total", "Clients gone before the end.", registry=reg
        )
        self.upstream_errors_total = Counter(
            "session_router_upstream_errors_total",
            "Failed upstream calls, by worker and kind.",
            ["worker", "kind"],
            registry=reg,
        )
        self.worker_ejections_total = Counter(
            "session_router_worker_ejections_total",
            "Outlier ejections of a worker (failed requests in a row), by worker.",
            ["worker"],
            registry=reg,
        )
        self.workers_ejected = Gauge(
            "session_router_workers_ejected", "Workers ejected as outliers now.", registry=reg
        )
        self.build_info = Gauge(
            "session_router_build_info",
            "Always 1: the router's version, its Python, and whether its compiled hot path "
            "runs (native on|off).",
            ["version", "python", "native"],
            registry=reg,
        )
        self.build_info.labels(
            version(), platform.python_version(), "on" if native.active else "off"
        ).set(1)

        cells = CellsCollector([
            self.requests_total, self.decisions_total, self.decision_seconds,
            self.ttft_seconds, self.handoff_seconds, self.hold_seconds, self.transfer_bytes_total,
            self.inflight,
            self.recomputed_tokens_total, self.estimate_error_ratio,
        ])  # fmt: skip
        cells.register(reg)
        # the older names, for one more release (router/obs/aliases.py)
        reg.register(DeprecatedNames([
            cells, self.redis_roundtrip_seconds, self.rejected_total, self.degraded,
            self.retries_total, self.worker_healthy, self.worker_running, self.worker_waiting,
            self.worker_kv_usage, self.link_reserved_bytes, self.link_inflight_bytes,
            self.client_disconnects_total, self.upstream_errors_total,
            self.worker_ejections_total, self.workers_ejected, self.build_info,
        ]))  # fmt: skip
        self._redis: dict[str, Histogram] = {}
        # the reasons the router uses, exported at 0 from the start
        self._rejected: dict[str, Counter] = {
            reason: self.rejected_total.labels(reason) for reason in REJECT_REASONS
        }
        self._retries: dict[str, Counter] = {}
        self._upstream_errors: dict[tuple[str, str], Counter] = {}
        self._workers: dict[str, tuple[Gauge, Gauge, Gauge, Gauge]] = {}
        self._ejections: dict[str, Counter] = {}
        self._links: dict[tuple[str, str], tuple[Gauge, Gauge]] = {}

    def _worker_gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, ["worker"], registry=self.registry)

    def bind_workers(self, worker_ids: Iterable[str]) -> None:
        """Create the per-worker children now, so every worker shows from the first scrape."""
        for worker_id in worker_ids:
            self._worker_children(worker_id)
            self.inflight.set((worker_id,), 0.0)
            self._ejection_child(worker_id)

    # --- request path -------------------------------------------------------------------

    def request_done(self, action: str, outcome: str) -> None:
        self.requests_total.inc((action, outcome))

    def decision(self, policy: str, action: str, seconds: float) -> None:
        self.decisions_total.inc((policy, action))
        self.decision_seconds.observe(seconds)

    def redis_roundtrip(self, kind: str, seconds: float) -> None:
        child = self._redis.get(kind)
        if child is None:
            child = self._redis[kind] = self.redis_roundtrip_seconds.labels(kind)
        child.observe(seconds)

    def ttft(self, seconds: float) -> None:
        self.ttft_seconds.observe(seconds)

    def handoff(self, seconds: float) -> None:
        self.handoff_seconds.observe(seconds)

    def held(self, seconds: float) -> None:
        self.hold_seconds.observe(seconds)

    def transferred(self, nbytes: int) -> None:
        self.transfer_bytes_total.inc((), nbytes)

    def set_inflight(self, worker_id: str, count: int) -> None:
        """The turns this router has on a worker now (read from the pool when scraped, so the
        request path moves one counter, not two)."""
        self.inflight.set((worker_id,), float(count))

    def rejected(self, reason: str) -> None:
        child = self._rejected.get(reason)
        if child is None:
            child = self._rejected[reason] = self.rejected_total.labels(reason)
        child.inc()

    def recomputed(self, tokens: int) -> None:
        self.recomputed_tokens_total.inc((), tokens)

    def set_degraded(self, degraded: bool) -> None:
        self.degraded.set(1 if degraded else 0)

    def retry(self, reason: str) -> None:
        child = self._retries.get(reason)
        if child is None:
            child = self._retries[reason] = self.retries_total.labels(reason)
        child.inc()

    def client_disconnect(self) -> None:
        self.client_disconnects_total.inc()

    def upstream_error(self, worker_id: str, kind: str) -> None:
        key = (worker_id, kind)
        child = self._upstream_errors.get(key)
        if child is None:
            child = self._upstream_errors[key] = self.upstream_errors_total.labels(*key)
        child.inc()

    def estimate_error(self, predicted: Prediction, realised: Prediction) -> None:
        """One observation per term the policy estimated (non-zero prediction)."""
        observe = self.estimate_error_ratio.observe
        for field, term in ESTIMATE_TERMS:
            guess: float = getattr(predicted, field)
            if guess != 0.0:
                observe(getattr(realised, field) / guess, (term,))

    # --- background updates -------------------------------------------------------------

    def worker_update(self, worker_id: str, load: WorkerLoad | None, healthy: bool) -> None:
        """Matches the scraper's on_update; a failed scrape (None) keeps the last load."""
        healthy_child, running, waiting, kv_usage = self._worker_children(worker_id)
        healthy_child.set(1 if healthy else 0)
        if load is not None:
            running.set(load.running)
            waiting.set(load.waiting)
            kv_usage.set(load.kv_usage)

    def worker_ejection(self, worker_id: str, ejected: bool, ejected_now: int) -> None:
        """Matches the worker pool's on_ejection: a worker ejected (counted) or back."""
        if ejected:
            self._ejection_child(worker_id).inc()
        self.workers_ejected.set(ejected_now)

    def _ejection_child(self, worker_id: str) -> Counter:
        child = self._ejections.get(worker_id)
        if child is None:
            child = self._ejections[worker_id] = self.worker_ejections_total.labels(worker_id)
        return child

    def set_link(self, src: str, dst: str, reserved_bytes: int, inflight_bytes: int) -> None:
        children = self._links.get((src, dst))
        if children is None:
            children = self._links[src, dst] = (
                self.link_reserved_bytes.labels(src, dst),
                self.link_inflight_bytes.labels(src, dst),
            )
        children[0].set(reserved_bytes)
        children[1].set(inflight_bytes)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))

    def _worker_children(self, worker_id: str) -> tuple[Gauge, Gauge, Gauge, Gauge]:
        children = self._workers.get(worker_id)
        if children is None:
            children = self._workers[worker_id] = (
                self.worker_healthy.labels(worker_id),
                self.worker_running.labels(worker_id),
                self.worker_waiting.labels(worker_id),
                self.worker_kv_usage.labels(worker_id),
            )
        return children
