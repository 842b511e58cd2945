"""What users would feel: per-request latency metrics, good requests, and the run summary.

All times in a `RequestResult` are client monotonic seconds; every metric is in ms. TTFT runs
from sending to the first content chunk. ITL gaps are all the gaps between consecutive
content chunks; stalls are gaps strictly over `stall_ms` (default 250). TPOT is
(done - first chunk) / (completion_tokens - 1). Percentiles interpolate linearly between
order statistics (numpy's default): rank (n - 1) * q / 100.

A request is good when it completed, its TTFT is at most its TTFT objective and the p99 of its
own gaps is at most its ITL objective (fewer than 2 chunks: no gaps, the ITL condition holds;
no chunk at all: no TTFT, not good). A request's own `ttft_slo_ms` / `itl_slo_ms` win;
otherwise `Objectives`: TTFT 1000 ms + 0.2 ms per prompt token, ITL 100 ms.

summary.json (`Summary`, schema_version 1) is `{"schema_version": 1, "runs": [RunSummary]}`,
each run an object with:
    policy: str, rate_scale: float, duration_s: float, first_token_convention: "decode" |
    "prefill", stall_ms: float, objectives: {ttft_base_ms, ttft_per_prompt_token_ms, itl_ms},
    requests, completed, rejected, errors: int (statuses "completed", "rejected", "error"),
    good: int, slo_attainment: good / requests, goodput_rps: good / duration_s,
    ttft_ms: {p50, p90, p99}, itl_ms: {p50, p90, p99, max} (pooled gaps), tpot_ms: {p50, p99},
    stalls: int (pooled), recomputed_tokens: int, transferred_bytes: int,
    exposed_transfer_ms: {p50, p99}, actions: {action: count}, per_class: {klass: attainment},
    misses: {rejected, failed, ttft_late, ttft_late_foreseen, itl_over} (`MissCauses`: why the
    requests that were not good were not; absent in files written before it),
    evicted_tokens: int (`evicted_tokens`; 0 in files written before it).
Latency statistics cover completed requests only; a statistic with no sample is null, and
ratios over nothing are 0.0.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from policies.types import Prediction

Status = Literal["completed", "rejected", "error"]
FirstTokenConvention = Literal["decode", "prefill"]
SCHEMA_VERSION = 1
DEFAULT_STALL_MS = 250.0


class RequestResult(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One replayed turn as the client saw it, plus the router's stage fields if known."""

    request_id: str
    session_id: str
    turn_index: int
    klass: str
    policy: str
    sent_at: float
    first_chunk_at: float | None
    chunk_times: list[float]
    done_at: float | None
    status: Status
    http_status: int
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    action: str | None = None
    recomputed_tokens: int = 0
    transferred_bytes: int = 0
    exposed_transfer_ms: float | None = None
    # The router's predicted TTFT for this turn when it placed it (joined like `action`).
    predicted_ttft_ms: float | None = None


class Objectives(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Default objectives for requests that carry none of their own."""

    ttft_base_ms: float = 1000.0
    ttft_per_prompt_token_ms: float = 0.2
    itl_ms: float = 100.0

    def ttft_for(self, result: RequestResult) -> float:
        if result.ttft_slo_ms is not None:
            return result.ttft_slo_ms
        return self.ttft_base_ms + self.ttft_per_prompt_token_ms * result.prompt_tokens

    def itl_for(self, result: RequestResult) -> float:
        return self.itl_ms if result.itl_slo_ms is None else result.itl_slo_ms


DEFAULT_OBJECTIVES = Objectives()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), linear interpolation; ValueError when empty."""
    return percentiles(values, (q,))[0]


def percentiles(values: Sequence[float], qs: Sequence[float]) -> tuple[float, ...]:
    """Several percentiles of one sample, sorting it once."""
    if not values:
        raise ValueError("percentile of an empty sample")
    ordered = sorted(values)
    last = len(ordered) - 1
    out = []
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile q={q} outside [0, 100]")
        rank = last * q / 100
        low = math.floor(rank)
        high = min(low + 1, last)
        out.append(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))
    return tuple(out)


def ttft_ms(result: RequestResult) -> float | None:
    first = result.first_chunk_at
    if first is None and result.chunk_times:
        first = result.chunk_times[0]
    return None if first is None else (first - result.sent_at) * 1000.0


def itl_gaps_ms(result: RequestResult) -> list[float]:
    times = result.chunk_times
    return [(b - a) * 1000.0 for a, b in itertools.pairwise(times)]


class ItlStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


def itl_stats(gaps: Sequence[float]) -> ItlStats:
    """p50/p90/p99/max of some gaps (one request's, or pooled); all None when empty."""
    if not gaps:
        return ItlStats()
    p50, p90, p99 = percentiles(gaps, (50, 90, 99))
    return ItlStats(p50, p90, p99, max(gaps))


def tpot_ms(result: RequestResult) -> float | None:
    """Mean time per output token after the first; None below 2 tokens or without times."""
    first = result.first_chunk_at
    if first is None or result.done_at is None or result.completion_tokens < 2:
        return None
    return (result.done_at - first) * 1000.0 / (result.completion_tokens - 1)


def count_stalls(gaps: Iterable[float], stall_ms: float = DEFAULT_STALL_MS) -> int:
    return sum(1 for gap in gaps if gap > stall_ms)


def is_good(result: RequestResult, objectives: Objectives = DEFAULT_OBJECTIVES) -> bool:
    return miss_cause(result, objectives) is None


class TtftStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


class TailStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    p50: float | None = None
    p99: float | None = None


class MissCauses(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Why requests were not good, each counted once, in this order: rejected; failed (an
    error); TTFT over its objective (`ttft_late`; of those, `ttft_late_foreseen` the router
    placed predicting so, best effort); else the p99 of its gaps over its ITL objective."""

    rejected: int = 0
    failed: int = 0
    ttft_late: int = 0
    ttft_late_foreseen: int = 0
    itl_over: int = 0


def predicted_ttft(predicted: Prediction | None) -> float | None:
    """The TTFT a policy predicted for a turn, None where it predicts none (the baselines'
    decisions carry an empty `Prediction`)."""
    return predicted.ttft_ms if predicted is not None and predicted.ttft_ms > 0.0 else None


def miss_cause(result: RequestResult, objectives: Objectives = DEFAULT_OBJECTIVES) -> str | None:
    """The `MissCauses` field counting `result`, or None when it is good (`is_good`)."""
    if result.status != "completed":
        return "rejected" if result.status == "rejected" else "failed"
    ttft = ttft_ms(result)
    objective = objectives.ttft_for(result)
    if ttft is None or ttft > objective:
        predicted = result.predicted_ttft_ms
        return (
            "ttft_late_foreseen" if predicted is not None and predicted > objective else "ttft_late"
        )
    gaps = itl_gaps_ms(result)
    return "itl_over" if gaps and percentile(gaps, 99) > objectives.itl_for(result) else None


def _tally(causes: Counter[str | None]) -> MissCauses:
    return MissCauses(
        rejected=causes["rejected"],
        failed=causes["failed"],
        ttft_late=causes["ttft_late"] + causes["ttft_late_foreseen"],
        ttft_late_foreseen=causes["ttft_late_foreseen"],
        itl_over=causes["itl_over"],
    )


class RunSummary(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One replay of one trace under one policy at one rate (see the module docstring)."""

    policy: str
    rate_scale: float
    duration_s: float
    first_token_convention: FirstTokenConvention
    stall_ms: float
    objectives: Objectives
    requests: int
    completed: int
    rejected: int
    errors: int
    good: int
    slo_attainment: float
    goodput_rps: float
    ttft_ms: TtftStats
    itl_ms: ItlStats
    tpot_ms: TailStats
    stalls: int
    recomputed_tokens: int
    transferred_bytes: int
    exposed_transfer_ms: TailStats
    actions: dict[str, int]
    per_class: dict[str, float]
    misses: MissCauses | None = None
    max_goodput_rps: float | None = None  # only by `bench simulate --find-max-goodput`
    evicted_tokens: int = 0


class Summary(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    runs: list[RunSummary]
    schema_version: int = SCHEMA_VERSION


def _tail(values: Sequence[float]) -> TailStats:
    return TailStats(*percentiles(values, (50, 99))) if values else TailStats()


def summarise(
    results: Sequence[RequestResult],
    policy: str,
    rate_scale: float,
    duration_s: float,
    first_token_convention: FirstTokenConvention,
    stall_ms: float = DEFAULT_STALL_MS,
    objectives: Objectives = DEFAULT_OBJECTIVES,
) -> RunSummary:
    statuses = Counter(r.status for r in results)
    ttfts: list[float] = []
    gaps: list[float] = []
    tpots: list[float] = []
    good = 0
    class_total: Counter[str] = Counter()
    class_good: Counter[str] = Counter()
    causes: Counter[str | None] = Counter()
    for r in results:
        class_total[r.klass] += 1
        cause = miss_cause(r, objectives)
        causes[cause] += 1
        if r.status != "completed":
            continue
        ttft = ttft_ms(r)
        if ttft is not None:
            ttfts.append(ttft)
        gaps.extend(itl_gaps_ms(r))
        tpot = tpot_ms(r)
        if tpot is not None:
            tpots.append(tpot)
        if cause is None:
            good += 1
            class_good[r.klass] += 1
    exposed = [r.exposed_transfer_ms for r in results if r.exposed_transfer_ms is not None]
    return RunSummary(
        policy=policy,
        rate_scale=rate_scale,
        duration_s=duration_s,
        first_token_convention=first_token_convention,
        stall_ms=stall_ms,
        objectives=objectives,
        requests=len(results),
        completed=statuses["completed"],
        rejected=statuses["rejected"],
        errors=statuses["error"],
        good=good,
        slo_attainment=good / len(results) if results else 0.0,
        goodput_rps=good / duration_s if duration_s > 0 else 0.0,
        ttft_ms=TtftStats(*percentiles(ttfts, (50, 90, 99))) if ttfts else TtftStats(),
        itl_ms=itl_stats(gaps),
        tpot_ms=_tail(tpots),
        stalls=count_stalls(gaps, stall_ms),
        recomputed_tokens=sum(r.recomputed_tokens for r in results),
        transferred_bytes=sum(r.transferred_bytes for r in results),
        exposed_transfer_ms=_tail(exposed),
        actions=dict(sorted(Counter(r.action for r in results if r.action).items())),
        per_class={k: class_good[k] / n for k, n in sorted(class_total.items())},
        misses=_tally(causes),
        evicted_tokens=evicted_tokens(results),
    )


# Prefix caching counts whole KV blocks (16 tokens in vLLM and the simulated workers) and the
# answer's last token has no KV yet, so a kept context reads a few tokens short of cached.
EVICTION_SLACK_TOKENS = 32


def evicted_tokens(results: Iterable[RequestResult]) -> int:
    """Context tokens the worker no longer held when the session's next turn came back to it:
    of each colocated turn following the session's previous completed turn, the context that
    turn left there (its prompt and answer, at most this prompt) less the tokens the worker
    reported cached, where more than `EVICTION_SLACK_TOKENS` are missing. The engine's prefix
    cache evicted them, so the turn prefilled them again: recomputed cache no placement chose
    (`recomputed_tokens` counts the chosen recomputes)."""
    done = {(r.session_id, r.turn_index): r for r in results if r.status == "completed"}
    lost = 0
    for (session, index), r in done.items():
        previous = done.get((session, index - 1))
        if r.action != "colocate" or previous is None or previous.prompt_tokens <= 0:
            continue
        kept = min(previous.prompt_tokens + previous.completion_tokens, r.prompt_tokens)
        missing = kept - r.cached_tokens
        if missing > EVICTION_SLACK_TOKENS:
            lost += missing
    return lost


def max_goodput_rate(points: Iterable[tuple[float, float]], target: float = 0.9) -> float | None:
    """The highest measured rate whose attainment is >= `target`; None if there is none.

    No interpolation: only rates actually replayed count, and a passing rate counts even when
    a lower one failed (the definition is "highest rate at which", not "below the first miss").
    """
    passing = [rate for rate, attainment in points if attainment >= target]
    return max(passing) if passing else None


def encode_summary(summary: Summary) -> bytes:
    return msgspec.json.format(msgspec.json.encode(summary), indent=2) + b"\n"


def write_summary(summary: Summary, path: str | Path) -> None:
    Path(path).write_bytes(encode_summary(summary))


def read_summary(path: str | Path) -> Summary:
    summary = msgspec.json.decode(Path(path).read_bytes(), type=Summary)
    if summary.schema_version != SCHEMA_VERSION:
        raise ValueError(f"unsupported summary schema_version {summary.schema_version}")
    return summary
