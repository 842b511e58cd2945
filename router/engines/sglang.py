"""SGLang: a bootstrap handoff's legs (the same body to both servers) and the metric names
its /metrics page uses."""

from __future__ import annotations

import random
from typing import Any

from router.engines.metrics import EngineMetrics

# SGLang admits higher values first unless told otherwise: the router's priority is negated.
PRIORITY_SIGN = -1

# SGLang (python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector; and
# docs/references/production_metrics.md): gauges `sglang:num_running_reqs`,
# `sglang:num_queue_reqs` and `sglang:token_usage` (KV pool use, 0..1), labelled model_name,
# engine_type, tp_rank, pp_rank (dp_rank under data parallelism). Only attention-TP rank 0 of
# each scheduler reports unless --enable-metrics-for-all-schedulers, when every TP rank repeats
# its scheduler's numbers: hence max within a dp_rank, sum across dp_ranks (a release without
# the dp_rank label reads as one scheduler, so data-parallel load is undercounted there). No
# prefix-cache hit/query token counters with vLLM's meaning exist (only a hit-rate gauge), so
# those stay None.
METRICS = EngineMetrics(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    prefix_hits=(),
    prefix_queries=(),
    replica_label="dp_rank",
)


def legs(
    body: dict[str, Any], prefill_host: str, bootstrap_port: int | None, rng: random.Random
) -> tuple[dict[str, Any], dict[str, Any]]:
    """SGLang bootstrap: the same body to both servers, with one random 63-bit room."""
    room = rng.getrandbits(63)
    leg = dict(body)
    leg["bootstrap_host"] = prefill_host
    leg["bootstrap_port"] = bootstrap_port
    leg["bootstrap_room"] = room
    return leg, dict(leg)
