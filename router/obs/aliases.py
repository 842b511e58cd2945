"""The metric names from before the `session_router_` prefix, exported for one more release.

Every metric moved under `session_router_`, and some took the suffix Prometheus's naming
conventions ask for (`_requests`, `_ratio`). Dashboards and alerts written for the old names
keep working while they move: at scrape time each renamed family is written a second time under
its old name, its help text saying which name replaces it. Nothing on a request's path knows
about the old names. Deprecated: this module and its collector in `RouterMetrics` go in the
next release.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import Metric

# current family name -> its old name (families as collected: a counter without `_total`)
DEPRECATED_NAMES: dict[str, str] = {
    "session_router_requests": "router_requests",
    "session_router_decisions": "router_decisions",
    "session_router_decision_seconds": "router_decision_seconds",
    "session_router_redis_roundtrip_seconds": "router_redis_roundtrip_seconds",
    "session_router_ttft_seconds": "router_ttft_seconds",
    "session_router_handoff_seconds": "router_handoff_seconds",
    "session_router_hold_seconds": "router_hold_seconds",
    "session_router_transfer_bytes": "router_transfer_bytes",
    "session_router_inflight_requests": "router_inflight",
    "session_router_rejected_requests": "router_rejected",
    "session_router_recomputed_tokens": "router_recomputed_tokens",
    "session_router_degraded": "router_degraded",
    "session_router_retries": "router_retries",
    "session_router_worker_healthy": "router_worker_healthy",
    "session_router_worker_running_requests": "router_worker_running",
    "session_router_worker_waiting_requests": "router_worker_waiting",
    "session_router_worker_kv_usage_ratio": "router_worker_kv_usage",
    "session_router_link_reserved_bytes": "router_link_reserved_bytes",
    "session_router_link_inflight_bytes": "router_link_inflight_bytes",
    "session_router_estimate_error_ratio": "router_estimate_error_ratio",
    "session_router_client_disconnects": "router_client_disconnects",
    "session_router_upstream_errors": "router_upstream_errors",
    "session_router_worker_ejections": "router_worker_ejections",
    "session_router_workers_ejected": "router_workers_ejected",
    "session_router_build_info": "router_build_info",
}


class _Source(Protocol):
    def collect(self) -> Iterable[Metric]: ...


def renamed(family: Metric, old: str) -> Metric:
    """`family` under its old name: every sample renamed, the values and labels the same."""
    current = family.name + "_total" if family.type == "counter" else family.name
    copy = Metric(
        old,
        f"Deprecated (goes in the next release): renamed {current}. {family.documentation}",
        family.type,
    )
    cut = len(family.name)
    copy.samples = [sample._replace(name=old + sample.name[cut:]) for sample in family.samples]
    return copy


class DeprecatedNames:
    """A collector writing the renamed families of `sources` under their old names."""

    def __init__(self, sources: Sequence[_Source]) -> None:
        self._sources = tuple(sources)

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for family in source.collect():
                old = DEPRECATED_NAMES.get(family.name)
                if old is not None:
                    yield renamed(family, old)
