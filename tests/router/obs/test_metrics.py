from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from policies.types import Prediction
from router.fleet.telemetry import WorkerLoad
from router.obs.metrics import RouterMetrics

# Sample name as rendered -> its exact label names (histogram `le` excluded).
EXPECTED: dict[str, set[str]] = {
    "session_router_requests_total": {"action", "outcome"},
    "session_router_decisions_total": {"policy", "action"},
    "session_router_decision_seconds_bucket": set(),
    "session_router_redis_roundtrip_seconds_bucket": {"kind"},
    "session_router_ttft_seconds_bucket": set(),
    "session_router_handoff_seconds_bucket": set(),
    "session_router_transfer_bytes_total": set(),
    "session_router_inflight_requests": {"worker"},
    "session_router_rejected_requests_total": {"reason"},
    "session_router_recomputed_tokens_total": set(),
    "session_router_degraded": set(),
    "session_router_retries_total": {"reason"},
    "session_router_worker_healthy": {"worker"},
    "session_router_worker_running_requests": {"worker"},
    "session_router_worker_waiting_requests": {"worker"},
    "session_router_worker_kv_usage_ratio": {"worker"},
    "session_router_link_reserved_bytes": {"src", "dst"},
    "session_router_link_inflight_bytes": {"src", "dst"},
    "session_router_estimate_error_ratio_bucket": {"term"},
    "session_router_client_disconnects_total": set(),
    "session_router_upstream_errors_total": {"worker", "kind"},
}


def observe_everything(metrics: RouterMetrics) -> None:
    metrics.request_done("handoff", "completed")
    metrics.decision("adaptive", "handoff", 4e-6)
    metrics.redis_roundtrip("snapshot", 1.2e-4)
    metrics.ttft(0.21)
    metrics.handoff(0.03)
    metrics.transferred(1 << 30)
    metrics.set_inflight("d0", 1)
    metrics.rejected("no_capacity")
    metrics.recomputed(8192)
    metrics.set_degraded(True)
    metrics.retry("connect")
    metrics.worker_update("d0", WorkerLoad(3, 1, 0.5, None, None, 1.0), True)
    metrics.set_link("p0", "d0", 1 << 20, 1 << 19)
    metrics.estimate_error(Prediction(ttft_ms=200.0), Prediction(ttft_ms=250.0))
    metrics.client_disconnect()
    metrics.upstream_error("d0", "timeout")


def samples(metrics: RouterMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def test_every_metric_renders_with_exact_label_names() -> None:
    metrics = RouterMetrics()
    observe_everything(metrics)
    rendered = samples(metrics)
    for name, label_names in EXPECTED.items():
        assert name in rendered, name
        for labels, _ in rendered[name]:
            assert set(labels) - {"le"} == label_names, name


@pytest.mark.parametrize(
    ("name", "labels", "value"),
    [
        ("session_router_requests_total", {"action": "handoff", "outcome": "completed"}, 1.0),
        ("session_router_requests_total", {"action": "reject", "outcome": "rejected"}, 0.0),
        ("session_router_decisions_total", {"policy": "adaptive", "action": "handoff"}, 1.0),
        ("session_router_decision_seconds_bucket", {"le": "1e-06"}, 0.0),
        ("session_router_decision_seconds_bucket", {"le": "5e-06"}, 1.0),
        ("session_router_redis_roundtrip_seconds_bucket", {"kind": "snapshot", "le": "5e-05"}, 0.0),
        (
            "session_router_redis_roundtrip_seconds_bucket",
            {"kind": "snapshot", "le": "0.00025"},
            1.0,
        ),
        ("session_router_ttft_seconds_count", {}, 1.0),
        ("session_router_handoff_seconds_sum", {}, 0.03),
        ("session_router_transfer_bytes_total", {}, float(1 << 30)),
        ("session_router_inflight_requests", {"worker": "d0"}, 1.0),
        ("session_router_rejected_requests_total", {"reason": "no_capacity"}, 1.0),
        ("session_router_recomputed_tokens_total", {}, 8192.0),
        ("session_router_degraded", {}, 1.0),
        ("session_router_retries_total", {"reason": "connect"}, 1.0),
        ("session_router_worker_healthy", {"worker": "d0"}, 1.0),
        ("session_router_worker_running_requests", {"worker": "d0"}, 3.0),
        ("session_router_worker_waiting_requests", {"worker": "d0"}, 1.0),
        ("session_router_worker_kv_usage_ratio", {"worker": "d0"}, 0.5),
        ("session_router_link_reserved_bytes", {"src": "p0", "dst": "d0"}, float(1 << 20)),
        ("session_router_link_inflight_bytes", {"src": "p0", "dst": "d0"}, float(1 << 19)),
        ("session_router_estimate_error_ratio_sum", {"term": "ttft"}, 1.25),
        ("session_router_estimate_error_ratio_bucket", {"term": "ttft", "le": "1.11"}, 0.0),
        ("session_router_estimate_error_ratio_bucket", {"term": "ttft", "le": "1.25"}, 1.0),
        ("session_router_estimate_error_ratio_count", {"term": "ttft"}, 1.0),
        ("session_router_estimate_error_ratio_count", {"term": "interference"}, 0.0),
        ("session_router_client_disconnects_total", {}, 1.0),
        ("session_router_upstream_errors_total", {"worker": "d0", "kind": "timeout"}, 1.0),
    ],
)
def test_observed_values(name: str, labels: dict[str, str], value: float) -> None:
    metrics = RouterMetrics()
    observe_everything(metrics)
    assert metrics.registry.get_sample_value(name, labels) == value


def test_failed_scrape_keeps_the_last_load_and_clears_healthy() -> None:
    metrics = RouterMetrics()
    metrics.bind_workers(["d0", "d1"])
    metrics.worker_update("d0", WorkerLoad(3, 1, 0.5, None, None, 1.0), True)
    metrics.worker_update("d0", None, False)
    metrics.set_inflight("d1", 1)
    metrics.set_inflight("d1", 0)
    get = metrics.registry.get_sample_value
    assert get("session_router_worker_healthy", {"worker": "d0"}) == 0.0
    assert get("session_router_worker_running_requests", {"worker": "d0"}) == 3.0
    assert (
        get("session_router_worker_kv_usage_ratio", {"worker": "d1"}) == 0.0
    )  # bound, never scraped
    assert get("session_router_inflight_requests", {"worker": "d1"}) == 0.0
    metrics.set_degraded(False)
    assert get("session_router_degraded", {}) == 0.0


def test_estimate_error_skips_terms_not_estimated() -> None:
    metrics = RouterMetrics()
    metrics.estimate_error(
        Prediction(interference_ms=20.0, queue_delta_ms=-8.0),
        Prediction(interference_ms=10.0, queue_delta_ms=-4.0, compute_delta_ms=99.0),
    )
    get = metrics.registry.get_sample_value
    assert get("session_router_estimate_error_ratio_sum", {"term": "interference"}) == 0.5
    assert get("session_router_estimate_error_ratio_sum", {"term": "queue_delta"}) == 0.5
    metrics.estimate_error(Prediction(queue_delta_ms=-8.0), Prediction(queue_delta_ms=2.0))
    assert (
        get("session_router_estimate_error_ratio_bucket", {"term": "queue_delta", "le": "0.0"})
        == 1.0
    )
    assert get("session_router_estimate_error_ratio_count", {"term": "compute_delta"}) == 0.0


HOT_CALLS: list[tuple[str, Callable[[RouterMetrics], None]]] = [
    ("redis_roundtrip_seconds", lambda m: m.redis_roundtrip("commit", 1e-4)),
    ("rejected_total", lambda m: m.rejected("slo")),
    ("retries_total", lambda m: m.retry("connect")),
    ("upstream_errors_total", lambda m: m.upstream_error("w", "reset")),
    ("link_reserved_bytes", lambda m: m.set_link("a", "b", 1, 1)),
    ("worker_running", lambda m: m.worker_update("w", WorkerLoad(1, 0, 0.0, 0, 0, 0.0), True)),
]


@pytest.mark.parametrize(("attribute", "call"), HOT_CALLS, ids=[a for a, _ in HOT_CALLS])
def test_labelled_children_are_bound_once(
    attribute: str, call: Callable[[RouterMetrics], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    metrics = RouterMetrics()
    metric = getattr(metrics, attribute)
    calls = []
    original = metric.labels

    def counting_labels(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(metric, "labels", counting_labels)
    for _ in range(100):
        call(metrics)
    assert len(calls) == 1


def test_registries_are_separate_and_injectable() -> None:
    first, second = RouterMetrics(), RouterMetrics()
    first.client_disconnect()
    assert second.registry.get_sample_value("session_router_client_disconnects_total") == 0.0
    shared = CollectorRegistry()
    metrics = RouterMetrics(registry=shared)
    assert metrics.registry is shared
    assert shared.get_sample_value("session_router_degraded") == 0.0
    assert metrics.content_type.startswith("text/plain")
    assert isinstance(metrics.render(), bytes)
