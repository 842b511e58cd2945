"""SGLang: a bootstrap handoff's legs (the same body to both servers) and the metric names
its /metrics page uses. Checked against captures of SGLang's own router (sglang-router 0.3.2,
tests/fixtures/sglang/) and SGLang 0.5.23's source."""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

from router.engines.metrics import EngineMetrics

# SGLang admits higher values first unless told otherwise: the router's priority is negated.
PRIORITY_SIGN = -1

# SGLang 0.5.23 (python/sglang/srt/observability/metrics_collector.py; before, srt/metrics/
# collector.py). SchedulerMetricsCollector's gauges `sglang:num_running_reqs`,
# `sglang:num_queue_reqs` and `sglang:token_usage` (KV pool use, 0..1), labelled model_name,
# engine_type (unified, prefill or decode), tp_rank, pp_rank, moe_ep_rank, and dp_rank under
# data parallelism. Only attention-TP rank 0 of each scheduler reports unless
# --enable-metrics-for-all-schedulers, when every TP rank repeats its scheduler's numbers: hence
# max within a dp_rank, sum across dp_ranks (a release without the dp_rank label reads as one
# scheduler, so data-parallel load is undercounted there). TokenizerMetricsCollector's counters
# give the prefix cache with vLLM's meaning, in tokens: `sglang:prompt_tokens_total` (label
# is_streaming) and `sglang:cached_tokens_total` (label cache_source: device, host, storage, or
# total), both summed over their series; the cached-token series appear at the first hit.
METRICS = EngineMetrics(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    prefix_hits=("sglang:cached_tokens_total",),
    prefix_queries=("sglang:prompt_tokens_total",),
    replica_label="dp_rank",
)


def bootstrap_host(base_url: str) -> str:
    """The prefill server's host as SGLang's router sends it in `bootstrap_host`: the URL's
    host without port, path or credentials; an IPv6 address keeps its brackets (the decode
    server joins it with the port into an address)."""
    netloc = urlsplit(base_url).netloc.rpartition("@")[2]
    if netloc.startswith("["):
        return netloc[: netloc.find("]") + 1]
    return netloc.partition(":")[0]


def legs(
    body: dict[str, Any], prefill_host: str, bootstrap_port: int | None, rng: random.Random
) -> tuple[dict[str, Any], dict[str, Any]]:
    """SGLang bootstrap: the same body to both servers, with one random room in [0, 2^63) per
    prompt. A batch of prompts (a list of texts or of token-id lists) gets one list of hosts,
    ports and rooms, item by item, as SGLang's router sends it: a single room would be
    stretched by the server to room + i, or reused, across the batch."""
    leg = dict(body)
    batch = _batch_size(body.get("prompt"))
    if batch is None:
        leg["bootstrap_host"] = prefill_host
        leg["bootstrap_port"] = bootstrap_port
        leg["bootstrap_room"] = rng.getrandbits(63)
    else:
        leg["bootstrap_host"] = [prefill_host] * batch
        leg["bootstrap_port"] = [bootstrap_port] * batch
        leg["bootstrap_room"] = [rng.getrandbits(63) for _ in range(batch)]
    return leg, dict(leg)


def _batch_size(prompt: object) -> int | None:
    """How many prompts a completions `prompt` holds when it is a batch; None for one prompt
    (a text, or a list of token ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return None
