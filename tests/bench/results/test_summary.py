from __future__ import annotations

import json
from pathlib import Path

import pytest
from msgspec.structs import astuple, replace

from bench.results.summary import (
    ItlStats,
    MissCauses,
    Objectives,
    RequestResult,
    Status,
    Summary,
    TailStats,
    TtftStats,
    count_stalls,
    encode_summary,
    evicted_tokens,
    is_good,
    itl_gaps_ms,
    itl_stats,
    max_goodput_rate,
    miss_cause,
    percentile,
    percentiles,
    read_summary,
    summarise,
    tpot_ms,
    ttft_ms,
    write_summary,
)

# Times are binary fractions so every difference below is exact in floating point.


def _result(
    chunks: list[float],
    *,
    sent: float = 10.0,
    done: float | None = None,
    status: Status = "completed",
    prompt: int = 1000,
    completion: int | None = None,
    klass: str = "k",
    ttft_slo: float | None = None,
    itl_slo: float | None = None,
    action: str | None = None,
    recomputed: int = 0,
    transferred: int = 0,
    exposed: float | None = None,
    predicted: float | None = None,
) -> RequestResult:
    return RequestResult(
        request_id="r",
        session_id="s",
        turn_index=0,
        klass=klass,
        policy="p",
        sent_at=sent,
        first_chunk_at=chunks[0] if chunks else None,
        chunk_times=chunks,
        done_at=done if done is not None else (chunks[-1] if chunks else None),
        status=status,
        http_status=200 if status == "completed" else 429,
        prompt_tokens=prompt,
        completion_tokens=len(chunks) if completion is None else completion,
        ttft_slo_ms=ttft_slo,
        itl_slo_ms=itl_slo,
        action=action,
        recomputed_tokens=recomputed,
        transferred_bytes=transferred,
        exposed_transfer_ms=exposed,
        predicted_ttft_ms=predicted,
    )


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([4, 1, 3, 2], 90, 3.7),
        ([1, 2, 3, 4], 0, 1),
        ([1, 2, 3, 4], 100, 4),
        ([7], 99, 7),
        ([0, 10], 25, 2.5),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 99, 10.9),
    ],
)
def test_percentile_linear(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("values", "q"), [([], 50), ([1], -1), ([1], 100.5)])
def test_percentile_rejects(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, q)


def test_percentiles_sorts_once_same_answers() -> None:
    assert percentiles([3, 1, 2], (0, 50, 100)) == (1, 2, 3)


def test_request_timeline() -> None:
    r = _result([10.25, 10.5, 10.625, 11.0], done=11.25)
    assert ttft_ms(r) == 250.0
    assert itl_gaps_ms(r) == [250.0, 125.0, 375.0]
    assert itl_stats(itl_gaps_ms(r)) == ItlStats(250.0, 350.0, 372.5, 375.0)
    assert tpot_ms(r) == 1000.0 / 3
    assert count_stalls(itl_gaps_ms(r)) == 1
    assert count_stalls(itl_gaps_ms(r), stall_ms=250.0) == 1
    assert count_stalls(itl_gaps_ms(r), stall_ms=100.0) == 3


def test_degenerate_timelines() -> None:
    none = _result([], status="error", done=None)
    assert (ttft_ms(none), itl_gaps_ms(none), tpot_ms(none)) == (None, [], None)
    assert itl_stats([]) == ItlStats()
    one = _result([10.5])
    assert (ttft_ms(one), itl_gaps_ms(one), tpot_ms(one)) == (500.0, [], None)
    # A missing first_chunk_at falls back to the first chunk time.
    late = RequestResult(
        "r", "s", 0, "k", "p", 1.0, None, [1.5, 2.0], 2.0, "completed", 200, completion_tokens=2
    )
    assert ttft_ms(late) == 500.0


@pytest.mark.parametrize(
    ("result", "good"),
    [
        # TTFT objective 1000 + 0.2 * 1000 = 1200 ms.
        (_result([11.125, 11.1875]), True),
        (_result([11.25, 11.3125]), False),
        (_result([11.25, 11.3125], prompt=1250), True),
        (_result([11.25, 11.3125], ttft_slo=1250.0), True),
        (_result([10.5, 10.75]), False),  # a 250 ms gap > 100 ms
        (_result([10.5, 10.75], itl_slo=250.0), True),
        (_result([10.5]), True),  # one chunk: no gaps
        (_result([]), False),  # completed without any chunk: no TTFT
        (_result([10.5, 10.5625], status="rejected"), False),
        (_result([10.5, 10.5625], status="error"), False),
    ],
)
def test_is_good(result: RequestResult, good: bool) -> None:
    assert is_good(result) is good


def test_is_good_uses_p99_of_own_gaps() -> None:
    # 100 gaps of 62.5 ms then one of 1 s: the p99 rank (99 of 0..100) is a 62.5 ms gap.
    chunks = [10.5 + 0.0625 * i for i in range(101)]
    chunks.append(chunks[-1] + 1.0)
    r = _result(chunks)
    assert percentile(itl_gaps_ms(r), 99) == 62.5
    assert is_good(r)
    # Two long gaps out of 101 push the p99 over the objective.
    chunks[50:] = [c + 1.0 for c in chunks[50:]]
    assert not is_good(_result(chunks))
    assert is_good(_result(chunks), Objectives(itl_ms=1062.5))


@pytest.mark.parametrize(
    ("result", "cause"),
    [
        # TTFT objective 1000 + 0.2 * 1000 = 1200 ms.
        pytest.param(_result([11.125, 11.1875]), None, id="good"),
        pytest.param(_result([], status="rejected"), "rejected", id="rejected"),
        pytest.param(_result([10.5, 10.75], status="error"), "failed", id="failed"),
        pytest.param(_result([11.25, 11.3125]), "ttft_late", id="late"),
        pytest.param(_result([11.25, 11.3125], predicted=900.0), "ttft_late", id="unforeseen"),
        pytest.param(
            _result([11.25, 11.3125], predicted=1300.0), "ttft_late_foreseen", id="foreseen"
        ),
        pytest.param(_result([]), "ttft_late", id="no-first-token"),
        # Late and with a 250 ms gap: counted once, as late.
        pytest.param(_result([11.25, 11.5]), "ttft_late", id="late-and-slow"),
        pytest.param(_result([10.5, 10.75]), "itl_over", id="slow"),
        pytest.param(_result([10.5, 10.75], itl_slo=250.0), None, id="own-itl-objective"),
    ],
)
def test_miss_cause_names_why_a_request_is_not_good(result: RequestResult, cause: str) -> None:
    assert miss_cause(result) == cause
    assert (cause is None) is is_good(result)


def test_summarise_counts_why_requests_were_not_good() -> None:
    results = [
        _result([10.25, 10.3125]),
        _result([], status="rejected"),
        _result([], status="rejected"),
        _result([10.125], status="error"),
        _result([11.5], predicted=1500.0),
        _result([11.5], predicted=1000.0),
        _result([10.5, 10.75]),
    ]
    s = summarise(results, "adaptive", 1.0, 4.0, "decode")
    assert s.misses == MissCauses(rejected=2, failed=1, ttft_late=2, ttft_late_foreseen=1,
                                  itl_over=1)  # fmt: skip
    assert s.misses.rejected + s.misses.failed + s.misses.ttft_late + s.misses.itl_over == (
        s.requests - s.good
    )


def test_summarise_exact() -> None:
    results = [
        _result([10.25, 10.3125, 10.375], klass="a", action="colocate", exposed=2.0),
        _result([10.5, 10.75], klass="a", action="handoff", transferred=4096, exposed=6.0),
        _result([], status="rejected", klass="b", action="reject"),
        _result([10.125], status="error", klass="b", recomputed=7),
        _result([11.5, 11.5625], klass="b", action="recompute", recomputed=900),
    ]
    s = summarise(results, "adaptive", 2.0, 4.0, "decode")
    assert (s.policy, s.rate_scale, s.duration_s, s.first_token_convention) == (
        "adaptive",
        2.0,
        4.0,
        "decode",
    )
    assert (s.requests, s.completed, s.rejected, s.errors, s.good) == (5, 3, 1, 1, 1)
    assert s.slo_attainment == 0.2
    assert s.goodput_rps == 0.25
    assert astuple(s.ttft_ms) == pytest.approx((500.0, 1300.0, 1480.0))
    assert astuple(s.itl_ms) == pytest.approx((62.5, 193.75, 244.375, 250.0))
    assert astuple(s.tpot_ms) == pytest.approx((62.5, 246.25))
    assert s.stalls == 0
    assert (s.recomputed_tokens, s.transferred_bytes) == (907, 4096)
    assert astuple(s.exposed_transfer_ms) == pytest.approx((4.0, 5.96))
    assert s.actions == {"colocate": 1, "handoff": 1, "recompute": 1, "reject": 1}
    assert s.per_class == {"a": 0.5, "b": 0.0}
    assert s.objectives == Objectives() and s.stall_ms == 250.0
    assert summarise(results, "adaptive", 2.0, 4.0, "decode", stall_ms=200.0).stalls == 1


def _turn(
    index: int, prompt: int, completion: int, cached: int, action: str = "colocate",
    session: str = "s", status: Status = "completed",
) -> RequestResult:  # fmt: skip
    base = _result([10.5, 10.75], prompt=prompt, completion=completion, action=action,
                   status=status)  # fmt: skip
    return replace(base, session_id=session, turn_index=index, cached_tokens=cached,
                   request_id=f"{session}#{index}")  # fmt: skip


@pytest.mark.parametrize(
    ("results", "evicted"),
    [
        # the worker kept the first turn's prompt and answer, less a partial block
        pytest.param([_turn(0, 1000, 500, 0), _turn(1, 1700, 500, 1488)], 0, id="kept"),
        # it held 600 of the 1500: 900 prefilled again
        pytest.param([_turn(0, 1000, 500, 0), _turn(1, 1700, 500, 600)], 900, id="evicted"),
        pytest.param([_turn(0, 1000, 500, 0), _turn(1, 1700, 500, 0)], 1500, id="all gone"),
        # a recompute elsewhere is chosen, not evicted (recomputed_tokens counts it)
        pytest.param(
            [_turn(0, 1000, 500, 0), _turn(1, 1700, 500, 0, "recompute")], 0, id="recompute"
        ),
        # after a rejected turn the context is the one before it: nothing to compare with
        pytest.param(
            [_turn(0, 1000, 500, 0, status="rejected"), _turn(1, 1700, 500, 0)],
            0,
            id="after a rejection",
        ),
        # another session's turns are not this one's context
        pytest.param(
            [_turn(0, 1000, 500, 0, session="a"), _turn(1, 1700, 500, 0, session="b")],
            0,
            id="other session",
        ),
        # a prompt shorter than the kept context (the client cut its history) counts itself
        pytest.param([_turn(0, 1000, 500, 0), _turn(1, 800, 500, 100)], 700, id="shorter"),
        pytest.param(
            [_turn(0, 1000, 500, 0), _turn(1, 1700, 500, 1000), _turn(2, 2400, 500, 0)],
            500 + 2200,
            id="two turns",
        ),
    ],
)
def test_evicted_tokens(results: list[RequestResult], evicted: int) -> None:
    assert evicted_tokens(results) == evicted
    assert summarise(results, "colocate", 1.0, 1.0, "decode").evicted_tokens == evicted


def test_summarise_empty() -> None:
    s = summarise([], "colocate", 1.0, 0.0, "prefill")
    assert (s.requests, s.completed, s.good, s.slo_attainment, s.goodput_rps) == (0, 0, 0, 0, 0)
    assert s.ttft_ms == TtftStats() and s.itl_ms == ItlStats() and s.tpot_ms == TailStats()
    assert s.exposed_transfer_ms == TailStats() and s.actions == {} and s.per_class == {}


def test_summary_json_roundtrip(tmp_path: Path) -> None:
    runs = [
        summarise([_result([10.25, 10.5])], "colocate", 1.0, 10.0, "decode"),
        summarise([], "adaptive", 2.0, 5.0, "prefill"),
    ]
    summary = Summary(runs)
    path = tmp_path / "summary.json"
    write_summary(summary, path)
    assert read_summary(path) == summary
    document = json.loads(encode_summary(summary))
    assert document["schema_version"] == 1
    # max_goodput_rps appears only where a search set it (bench simulate)
    assert set(document["runs"][0]) - {"max_goodput_rps"} == {
        "policy",
        "rate_scale",
        "duration_s",
        "first_token_convention",
        "stall_ms",
        "objectives",
        "requests",
        "completed",
        "rejected",
        "errors",
        "good",
        "slo_attainment",
        "goodput_rps",
        "ttft_ms",
        "itl_ms",
        "tpot_ms",
        "stalls",
        "recomputed_tokens",
        "transferred_bytes",
        "exposed_transfer_ms",
        "actions",
        "per_class",
        "misses",
    }
    assert document["runs"][1]["ttft_ms"] == {"p50": None, "p90": None, "p99": None}
    path.write_text(json.dumps({**document, "schema_version": 2}))
    with pytest.raises(ValueError, match="schema_version"):
        read_summary(path)


@pytest.mark.parametrize(
    ("points", "target", "expected"),
    [
        ([(1.0, 0.99), (2.0, 0.95), (4.0, 0.7)], 0.9, 2.0),
        ([(4.0, 0.7), (1.0, 0.99), (2.0, 0.9)], 0.9, 2.0),
        ([(1.0, 0.95), (2.0, 0.85), (3.0, 0.91)], 0.9, 3.0),
        ([(1.0, 0.5)], 0.9, None),
        ([], 0.9, None),
        ([(1.0, 0.5), (2.0, 0.4)], 0.45, 1.0),
    ],
)
def test_max_goodput_rate(
    points: list[tuple[float, float]], target: float, expected: float | None
) -> None:
    assert max_goodput_rate(points, target) == expected
