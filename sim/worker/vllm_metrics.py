"""vLLM's Prometheus metrics, with vLLM's names and labels, for one simulated worker.

Gauges and counters are read from the engine at scrape time (exact, and free on the token
path); latency histograms are observed as requests progress, as vLLM does.

The page is written as text directly. The engine and the HTTP server share one event loop, and
the router scrapes every worker every 250 ms: prometheus_client took ~2.4 ms per page, so four
workers in one process lost ~10 ms of their step schedule at every scrape, which showed up as
missed decode steps in every stream's inter-token gaps. Rendering here takes a small fraction
of that, and observing a histogram takes no lock.
"""

from __future__ import annotations

from bisect import bisect_left

from sim.engine.engine import Engine, RequestStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_FINISH_REASONS = ("stop", "length", "abort")


def _help(name: str, kind: str, doc: str) -> str:
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class LatencyHistogram:
    """One labelled histogram: a count per bucket (`le` inclusive), the sum, the text lines."""

    __slots__ = (
        "_bounds",
        "_bucket_prefixes",
        "_count_prefix",
        "_counts",
        "_head",
        "_sum",
        "_sum_prefix",
    )  # fmt: skip

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], labels: str) -> None:
        self._bounds = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._head = _help(name, "histogram", doc)
        self._bucket_prefixes = [f'{name}_bucket{{{labels},le="{le}"}} '
                                 for le in (*map(repr, buckets), "+Inf")]  # fmt: skip
        self._sum_prefix = f"{name}_sum{{{labels}}} "
        self._count_prefix = f"{name}_count{{{labels}}} "

    def observe(self, seconds: float) -> None:
        self._counts[bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def render(self, out: list[str]) -> None:
        out.append(self._head)
        running = 0
        for prefix, count in zip(self._bucket_prefixes, self._counts, strict=True):
            running += count
            out.append(f"{prefix}{running}.0\n")
        out.append(f"{self._count_prefix}{running}.0\n{self._sum_prefix}{self._sum!r}\n")


class WorkerMetrics:
    """One worker's /metrics page. Several workers in one process each own one."""

    def __init__(self, engine: Engine, model_name: str, engine_index: str = "0") -> None:
        self._engine = engine
        labels = f'model_name="{_escape(model_name)}",engine="{_escape(engine_index)}"'
        self._labels = labels

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> LatencyHistogram:
            return LatencyHistogram(name, doc, buckets, labels)

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
        self._success = dict.fromkeys(_FINISH_REASONS, 0)

    def observe_finished(self, stats: RequestStats, finish_reason: str) -> None:
        self.ttft.observe(stats.first_token_time - stats.arrival_time)
        self.e2e.observe(stats.finished_time - stats.arrival_time)
        self.queue.observe(stats.first_scheduled_time - stats.arrival_time)
        self.prefill.observe(stats.first_token_time - stats.first_scheduled_time)
        self.decode.observe(stats.finished_time - stats.first_token_time)
        if finish_reason in self._success:
            self._success[finish_reason] += 1

    def observe_abort(self) -> None:
        self._success["abort"] += 1

    def render(self) -> bytes:
        """The exposition page (Prometheus text format 0.0.4)."""
        engine, labels = self._engine, self._labels
        out: list[str] = []
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             engine.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             engine.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             engine.kv_usage),
        ):  # fmt: skip
            out.append(f"{_help(name, 'gauge', doc)}{name}{{{labels}}} {float(value)!r}\n")
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
            total = f"{name}_total"  # format 0.0.4 names a counter's family with the suffix
            out.append(f"{_help(total, 'counter', doc)}{total}{{{labels}}} {float(value)!r}\n")
        for histogram in (self.ttft, self.itl, self.e2e, self.queue, self.prefill, self.decode):
            histogram.render(out)
        name = "vllm:request_success_total"
        out.append(_help(name, "counter", "Count of successfully processed requests."))
        for reason, count in self._success.items():
            out.append(f'{name}{{{labels},finished_reason="{reason}"}} {float(count)!r}\n')
        return "".join(out).encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
