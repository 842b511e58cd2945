"""vLLM 0.32's Prometheus metrics, with vLLM's names, labels, help texts and buckets, for one
simulated worker.

Gauges and counters are read from the engine at scrape time (exact, and free on the token
path); histograms are observed as requests progress, as vLLM does. Every worker exports the
NixlConnector's metrics (a simulated worker is always NIXL-capable): the transfer ones where it
pulls (decode), the expired holds where it holds (prefill). Labels are written in the order
vLLM's page has them (sorted by name); floats as prometheus_client writes them.

The page is written as text directly. The engine and the HTTP server share one event loop, and
the router scrapes every worker every 250 ms: prometheus_client took ~2.4 ms per page, so four
workers in one process lost ~10 ms of their step schedule at every scrape, which showed up as
missed decode steps in every stream's inter-token gaps. Rendering here takes a small fraction
of that, and observing a histogram takes no lock.
"""

from __future__ import annotations

from bisect import bisect_left

from sim.engine.engine import Engine, RequestStats
from sim.fabric.kv_pull import PullResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_NIXL_POST_BUCKETS = (0.001, *_NIXL_XFER_BUCKETS)
_NIXL_BYTES_BUCKETS = tuple(float(2 ** (11 + 2 * i)) for i in range(12))  # 2 KiB .. 8 GiB
_NIXL_DESCRIPTOR_BUCKETS = (
    10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0, 20000.0,
    50000.0,
)  # fmt: skip
_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WAITING_REASONS = ("capacity", "deferred")


def go_float(value: float) -> str:
    """A float as prometheus_client (after Go) writes it: `2.097152e+06`, `0.5`, `+Inf`."""
    if value == float("inf"):
        return "+Inf"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6 and "e" not in text:  # Go switches to exponents sooner
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def _help(name: str, kind: str, doc: str) -> str:
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


def _labels(**pairs: str) -> str:
    return ",".join(f'{key}="{_escape(value)}"' for key, value in sorted(pairs.items()))


class Histogram:
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

    def __init__(
        self, name: str, doc: str, buckets: tuple[float, ...], labels: dict[str, str]
    ) -> None:
        self._bounds = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._head = _help(name, "histogram", doc)
        self._bucket_prefixes = [
            f"{name}_bucket{{{_labels(**labels, le=go_float(le))}}} "
            for le in (*buckets, float("inf"))
        ]
        plain = _labels(**labels)
        self._sum_prefix = f"{name}_sum{{{plain}}} "
        self._count_prefix = f"{name}_count{{{plain}}} "

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def render(self, out: list[str]) -> None:
        out.append(self._head)
        running = 0
        for prefix, count in zip(self._bucket_prefixes, self._counts, strict=True):
            running += count
            out.append(f"{prefix}{running}.0\n")
        out.append(f"{self._count_prefix}{running}.0\n{self._sum_prefix}{go_float(self._sum)}\n")


class WorkerMetrics:
    """One worker's /metrics page. Several workers in one process each own one.

    `kv_fetches`: decode legs waiting for their KV to arrive. vLLM keeps such a request in its
    waiting queue, so it counts in `vllm:num_requests_waiting` with reason "deferred"."""

    def __init__(self, engine: Engine, model_name: str, engine_index: str = "0") -> None:
        self._engine = engine
        base = {"engine": engine_index, "model_name": model_name}
        self._labels = _labels(**base)
        self._base = base
        self.kv_fetches = 0
        self._nixl_failed = 0

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets, base)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", _REQUEST_BUCKETS,
        )  # fmt: skip
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", _REQUEST_BUCKETS,
        )  # fmt: skip
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", _REQUEST_BUCKETS,
        )  # fmt: skip
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", _REQUEST_BUCKETS,
        )  # fmt: skip
        self.nixl_xfer = histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.", _NIXL_XFER_BUCKETS,
        )  # fmt: skip
        self.nixl_post = histogram(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.", _NIXL_POST_BUCKETS,
        )  # fmt: skip
        self.nixl_bytes = histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.", _NIXL_BYTES_BUCKETS,
        )  # fmt: skip
        self.nixl_descriptors = histogram(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",  # sic, vLLM's
            _NIXL_DESCRIPTOR_BUCKETS,
        )  # fmt: skip
        self._histograms = (
            self.nixl_xfer, self.nixl_post, self.nixl_bytes, self.nixl_descriptors, self.ttft,
            self.itl, self.e2e, self.queue, self.prefill, self.decode,
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

    def observe_pull(self, pull: PullResult) -> None:
        """A decode leg's KV pull: one NIXL transfer where blocks moved, a failed one where the
        source could not serve it (the leg then prefills locally)."""
        if pull.status == "fallback":
            self._nixl_failed += 1
        elif pull.moved:
            self.nixl_xfer.observe(pull.seconds)
            self.nixl_post.observe(pull.post_seconds)
            self.nixl_bytes.observe(float(pull.transferred_bytes))
            self.nixl_descriptors.observe(float(pull.descriptors))

    def render(self) -> bytes:
        """The exposition page (Prometheus text format 0.0.4)."""
        engine, labels = self._engine, self._labels
        out: list[str] = []
        for histogram in self._histograms[:4]:
            histogram.render(out)
        for name, doc, value in (
            ("vllm:nixl_num_failed_transfers_total",
             "Number of failed NIXL KV Cache transfers, including handshake and notification "
             "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
             self._nixl_failed),
            ("vllm:nixl_num_kv_expired_reqs_total",
             "Number of requests that had their KV expire. NOTE: This metric is tracked on the "
             "P instance.", engine.num_held_expired),
        ):  # fmt: skip
            out.append(f"{_help(name, 'counter', doc)}{name}{{{labels}}} {go_float(value)}\n")
        waiting = engine.num_waiting + self.kv_fetches
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             engine.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             waiting),
        ):  # fmt: skip
            out.append(f"{_help(name, 'gauge', doc)}{name}{{{labels}}} {go_float(value)}\n")
        name = "vllm:num_requests_waiting_by_reason"
        out.append(_help(
            name, "gauge",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        ))  # fmt: skip
        for reason, count in zip(WAITING_REASONS, (engine.num_waiting, self.kv_fetches),
                                 strict=True):  # fmt: skip
            out.append(f"{name}{{{_labels(**self._base, reason=reason)}}} {go_float(count)}\n")
        name = "vllm:kv_cache_usage_perc"
        out.append(f"{_help(name, 'gauge', 'KV-cache usage. 1 means 100 percent usage.')}"
                   f"{name}{{{labels}}} {go_float(engine.kv_usage)}\n")  # fmt: skip
        for name, doc, value in (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             engine.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             engine.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             engine.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.",
             engine.prompt_tokens_total),
        ):  # fmt: skip
            total = f"{name}_total"  # format 0.0.4 names a counter's family with the suffix
            out.append(f"{_help(total, 'counter', doc)}{total}{{{labels}}} {go_float(value)}\n")
        name = "vllm:prompt_tokens_by_source_total"
        out.append(_help(name, "counter", "Number of prompt tokens by source."))
        by_source = (engine.prompt_tokens_computed, engine.prompt_tokens_local_hit,
                     engine.prompt_tokens_external)  # fmt: skip
        for source, count in zip(PROMPT_SOURCES, by_source, strict=True):
            out.append(f"{name}{{{_labels(**self._base, source=source)}}} {go_float(count)}\n")
        name = "vllm:generation_tokens_total"
        out.append(f"{_help(name, 'counter', 'Number of generation tokens processed.')}"
                   f"{name}{{{labels}}} {go_float(engine.generation_tokens_total)}\n")  # fmt: skip
        name = "vllm:request_success_total"
        out.append(_help(name, "counter", "Count of successfully processed requests."))
        for reason, count in self._success.items():
            sample = _labels(**self._base, finished_reason=reason)
            out.append(f"{name}{{{sample}}} {go_float(count)}\n")
        for histogram in self._histograms[4:]:
            histogram.render(out)
        return "".join(out).encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
