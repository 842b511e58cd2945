"""vLLM's Prometheus metrics, with vLLM's names and labels, for one simulated worker.

Gauges and counters are read from the engine at scrape time (exact, and free on the token
path); latency histograms are observed as requests progress, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sim.engine import Engine, RequestStats

_LABELS = ("model_name", "engine")
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, labels: tuple[str, str]) -> None:
        self._engine = engine
        self._labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        engine, labels = self._engine, self._labels
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             engine.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             engine.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             engine.kv_usage),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            gauge.add_metric(labels, float(value))
            yield gauge
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.",
             engine.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.",
             engine.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
             engine.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.",
             engine.prompt_tokens_total),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             engine.generation_tokens_total),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=_LABELS)
            counter.add_metric(labels, float(value))
            yield counter


class WorkerMetrics:
    """One worker's registry. Several workers in one process each own one."""

    def __init__(self, engine: Engine, model_name: str, engine_index: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = (model_name, engine_index)
        self.registry.register(_EngineCollector(engine, labels))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, _LABELS, registry=self.registry, buckets=buckets)
            return metric.labels(*labels)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", _LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", _LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", _LATENCY_BUCKETS,
        )  # fmt: skip
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self._success = {
            reason: success.labels(model_name, engine_index, reason)
            for reason in ("stop", "length", "abort")
        }

    def observe_finished(self, stats: RequestStats, finish_reason: str) -> None:
        self.ttft.observe(stats.first_token_time - stats.arrival_time)
        self.e2e.observe(stats.finished_time - stats.arrival_time)
        self.queue.observe(stats.first_scheduled_time - stats.arrival_time)
        self.prefill.observe(stats.first_token_time - stats.first_scheduled_time)
        self.decode.observe(stats.finished_time - stats.first_token_time)
        counter = self._success.get(finish_reason)
        if counter is not None:
            counter.inc()

    def observe_abort(self) -> None:
        self._success["abort"].inc()
