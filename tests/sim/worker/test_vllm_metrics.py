"""The simulated worker's /metrics page: valid exposition, vLLM's names, exact histograms."""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sim.cluster import SimCluster
from sim.commands import add_worker_options, worker_options
from sim.worker.vllm_metrics import LatencyHistogram, WorkerMetrics

BUCKETS = (0.001, 0.01, 0.1, 1.0, 2560.0)
VALUES = [0.0, 0.0005, 0.001, 0.0011, 0.01, 0.5, 1.0, 3.0, 5000.0]


def _worker_metrics() -> WorkerMetrics:
    parser = argparse.ArgumentParser()
    add_worker_options(parser)
    cluster = SimCluster.uniform(worker_options(parser.parse_args([]), 8101), 1, 8101)
    return cluster.workers[0].metrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_histogram_matches_prometheus_client() -> None:
    registry = CollectorRegistry()
    reference = Histogram("probe_seconds", "A probe.", ["model_name", "engine"],
                          buckets=BUCKETS, registry=registry).labels("m", "0")  # fmt: skip
    ours = LatencyHistogram("probe_seconds", "A probe.", BUCKETS, 'model_name="m",engine="0"')
    for value in VALUES:
        reference.observe(value)
        ours.observe(value)
    out: list[str] = []
    ours.render(out)
    assert _samples("".join(out)) == _samples(generate_latest(registry).decode())


def test_page_has_vllm_families_and_counts() -> None:
    metrics = _worker_metrics()
    metrics.itl.observe(0.02)
    metrics.itl.observe(0.3)
    metrics.observe_abort()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    kinds = {name: family.type for name, family in families.items()}
    assert kinds["vllm:num_requests_running"] == "gauge"
    assert kinds["vllm:kv_cache_usage_perc"] == "gauge"
    assert kinds["vllm:prompt_tokens"] == "counter"
    assert kinds["vllm:inter_token_latency_seconds"] == "histogram"
    samples = _samples(metrics.render().decode())
    labels = (("engine", "0"), ("model_name", "llama-3.1-8b"))
    assert samples[("vllm:inter_token_latency_seconds_count", labels)] == 2.0
    bucket = tuple(sorted((*labels, ("le", "0.025"))))
    assert samples[("vllm:inter_token_latency_seconds_bucket", bucket)] == 1.0
    aborted = (("engine", "0"), ("finished_reason", "abort"), ("model_name", "llama-3.1-8b"))
    assert samples[("vllm:request_success_total", aborted)] == 1.0
    assert samples[("vllm:num_requests_running", labels)] == 0.0
