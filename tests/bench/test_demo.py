"""The demo's pieces: its trace, the fixed split tuned in hindsight, good requests over time."""

from __future__ import annotations

from bench.demo import DEMO_PHASE_S, best_fixed_split, demo_trace, good_over_time
from bench.results.summary import Objectives, RequestResult
from bench.stack.layout import ClusterSpec
from bench.traces.phases import LONG_ANSWER, LONG_PROMPT


def test_the_demo_trace_shifts_its_mix_every_phase() -> None:
    trace = demo_trace()
    assert trace == demo_trace() and trace.name == "demo"
    for c in trace.conversations:
        phase = int(c.turns[0].arrival_s // DEMO_PHASE_S)
        assert c.turns[0].klass == (LONG_PROMPT if phase % 2 == 0 else LONG_ANSWER).label


def test_the_best_fixed_split_is_the_best_of_every_layout_tried() -> None:
    trace = demo_trace(rate_rps=0.5).slice(40)
    cluster = ClusterSpec(2, "h200-sxm", "llama-3.1-8b")
    split = best_fixed_split(trace, cluster)
    # one K on two workers: disaggregate and every threshold candidate
    assert split.prefill_workers == 1 and split.tried > 2
    assert split.policy in ("disaggregate", "threshold") and 0.0 <= split.attainment <= 1.0


def _result(sent: float, good: bool) -> RequestResult:
    chunks = [sent + 0.1 + 0.01 * k for k in range(4)] if good else []
    return RequestResult(
        request_id=f"r{sent}", session_id="s", turn_index=0, klass="", policy="p",
        sent_at=sent, first_chunk_at=chunks[0] if chunks else None, chunk_times=chunks,
        done_at=chunks[-1] if chunks else sent, status="completed" if good else "rejected",
        http_status=200 if good else 429, prompt_tokens=10, completion_tokens=len(chunks),
    )  # fmt: skip


def test_good_over_time_draws_good_requests_per_bucket() -> None:
    # 5 s buckets: 2 sent and good; 2 sent, 1 good; 2 sent, none good
    results = [_result(t, good) for t, good in
               [(0, True), (1, True), (5, True), (6, False), (10, False), (11, False)]]  # fmt: skip
    assert good_over_time(results, Objectives()) == "█▄ "
    assert good_over_time([], Objectives()) == ""
