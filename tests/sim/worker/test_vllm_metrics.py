"""The simulated worker's /metrics page: valid exposition, vLLM's names, exact histograms."""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as ReferenceHistogram
from prometheus_client.parser import text_string_to_metric_families

from sim.cluster import SimCluster
from sim.commands import add_worker_options, worker_options
from sim.engine.engine import EngineRequest
from sim.fabric.kv_pull import PullResult
from sim.worker.vllm_metrics import Histogram, WorkerMetrics

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
    reference = ReferenceHistogram("probe_seconds", "A probe.", ["model_name", "engine"],
                          buckets=BUCKETS, registry=registry).labels("m", "0")  # fmt: skip
    ours = Histogram("probe_seconds", "A probe.", BUCKETS, {"model_name": "m", "engine": "0"})
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


def test_pulls_and_waiting_for_kv_are_counted_as_vllm_counts_them() -> None:
    metrics = _worker_metrics()
    metrics.observe_pull(PullResult("pulled", 1107, 1_179_648, 0.009, 0.0004, 2))
    metrics.observe_pull(PullResult("pulled", 64))  # all cached here: no transfer posted
    metrics.observe_pull(PullResult("fallback", reason="source answered 404"))
    metrics.kv_fetches = 2  # decode legs waiting for their KV
    samples = _samples(metrics.render().decode())
    labels = (("engine", "0"), ("model_name", "llama-3.1-8b"))
    assert samples[("vllm:nixl_bytes_transferred_sum", labels)] == 1_179_648.0
    assert samples[("vllm:nixl_bytes_transferred_count", labels)] == 1.0
    assert samples[("vllm:nixl_xfer_time_seconds_sum", labels)] == 0.009
    assert samples[("vllm:nixl_post_time_seconds_sum", labels)] == 0.0004
    assert samples[("vllm:nixl_num_descriptors_sum", labels)] == 2.0
    assert samples[("vllm:nixl_num_failed_transfers_total", labels)] == 1.0
    assert samples[("vllm:nixl_num_kv_expired_reqs_total", labels)] == 0.0
    assert samples[("vllm:num_requests_waiting", labels)] == 2.0
    by_reason = {
        reason: samples[("vllm:num_requests_waiting_by_reason", (*labels, ("reason", reason)))]
        for reason in ("capacity", "deferred")
    }
    assert by_reason == {"capacity": 0.0, "deferred": 2.0}


def test_expired_holds_are_counted_on_the_prefill_side() -> None:
    parser = argparse.ArgumentParser()
    add_worker_options(parser)
    worker = SimCluster.uniform(worker_options(parser.parse_args([]), 8101), 1, 8101).workers[0]
    metrics, engine = worker.metrics, worker.engine
    engine.held_timeout_s = 0.0
    engine.add_request(EngineRequest("p", list(range(40)), 1, 0.0, hold_blocks_on_finish=True))
    while engine.has_work():
        assert engine.begin_step() is not None
        engine.finish_step()
    assert engine.num_held == 1 and engine.expire_held() == 1
    samples = _samples(metrics.render().decode())
    labels = (("engine", "0"), ("model_name", "llama-3.1-8b"))
    assert samples[("vllm:nixl_num_kv_expired_reqs_total", labels)] == 1.0
    sources = {
        source: samples[("vllm:prompt_tokens_by_source_total", (*labels, ("source", source)))]
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert sources == {"local_compute": 40.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
