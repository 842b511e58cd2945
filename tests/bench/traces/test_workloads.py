from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from bench.traces.model import Trace, load_trace
from bench.traces.workloads import (
    ArrivalSpec,
    ThinkSpec,
    WorkloadSpec,
    cells,
    generate_matrix,
    read_spec,
)


def _by_class(trace: Trace) -> Counter[str]:
    return Counter(t.klass for c in trace.conversations for t in c.turns)


def test_cells_and_labels() -> None:
    spec = WorkloadSpec(
        prompt_tokens=(4096, 128),
        output_tokens=(256,),
        reuse=("none", "multi-turn"),
        turns=(2, 4),
    )
    assert [c.klass for c in cells(spec)] == [
        "p4096-g256-none",
        "p128-g256-none",
        "p4096-g256-multi-turn-t2",
        "p4096-g256-multi-turn-t4",
        "p128-g256-multi-turn-t2",
        "p128-g256-multi-turn-t4",
    ]


@pytest.mark.parametrize(
    "build",
    [
        lambda: WorkloadSpec(prompt_tokens=()),
        lambda: WorkloadSpec(output_tokens=(8, 8)),
        lambda: WorkloadSpec(turns=(0,)),
        lambda: WorkloadSpec(sessions_per_class=0),
        lambda: WorkloadSpec(system_prefix_tokens=-1),
        lambda: ArrivalSpec(rate_rps=0),
        lambda: ArrivalSpec(cv=0),
        lambda: ThinkSpec(mean_s=-1),
        lambda: ThinkSpec(sigma=0),
    ],
)
def test_invalid_spec(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        build()


def test_matrix_shapes_and_blocks() -> None:
    spec = WorkloadSpec(
        prompt_tokens=(600,),
        output_tokens=(100,),
        reuse=("none", "system-prefix", "multi-turn"),
        turns=(3,),
        sessions_per_class=2,
        system_prefix_tokens=1100,
        ttft_slo_ms=500.0,
        itl_slo_ms=50.0,
    )
    trace = generate_matrix(spec)
    assert _by_class(trace) == {
        "p600-g100-none": 2,
        "p600-g100-system-prefix": 2,
        "p600-g100-multi-turn-t3": 6,
    }
    assert all(
        (t.new_input_tokens, t.output_tokens, t.ttft_slo_ms, t.itl_slo_ms) == (600, 100, 500, 50)
        for c in trace.conversations
        for t in c.turns
    )
    by_class: dict[str, list[tuple[int, ...]]] = {}
    for c in trace.conversations:
        assert c.session_id.startswith(c.turns[0].klass + "-")
        by_class.setdefault(c.turns[0].klass, []).extend(t.prefix_blocks for t in c.turns)
        system = 1100 if c.turns[0].klass.endswith("system-prefix") else 0
        assert c.system_prefix_tokens == system
        for i, turn in enumerate(c.turns):
            assert len(turn.prefix_blocks) == -(-c.context_tokens(i) // 512)
    # The two full system blocks are shared by every system-prefix session, nothing else is.
    system_lists = by_class["p600-g100-system-prefix"]
    assert [b[:2] for b in system_lists] == [(0, 1), (0, 1)]
    everything = [b for lists in by_class.values() for blocks in lists for b in blocks]
    assert Counter(everything)[0] == 2
    # Multi-turn: contexts 600, 1300, 2000; turn k re-reads the blocks turn k-1 filled.
    for c in trace.conversations:
        if c.turns[0].klass.endswith("t3"):
            t0, t1, t2 = (t.prefix_blocks for t in c.turns)
            assert (len(t0), len(t1), len(t2)) == (2, 3, 4)
            assert t1[:1] == t0[:1] and t1[1] != t0[1]
            assert t2[:2] == t1[:2] and t2[2] != t1[2]
            assert [t.arrival_s for t in c.turns] == [c.turns[0].arrival_s] * 3


def test_deterministic_and_seeded() -> None:
    spec = WorkloadSpec(reuse=("none", "multi-turn"), turns=(3,), think=ThinkSpec(mean_s=1.0))
    assert generate_matrix(spec) == generate_matrix(spec)
    other = generate_matrix(msgspec.structs.replace(spec, seed=1))
    assert other != generate_matrix(spec)


def _starts(trace: Trace) -> list[float]:
    return [c.turns[0].arrival_s for c in trace.conversations]


def test_think_model_does_not_move_arrivals() -> None:
    base = WorkloadSpec(reuse=("multi-turn",), turns=(3,), think=ThinkSpec(mean_s=1.0))
    lognormal = msgspec.structs.replace(base, think=ThinkSpec("lognormal", 5.0, 0.5))
    a, b = generate_matrix(base), generate_matrix(lognormal)
    assert _starts(a) == _starts(b)
    assert all(c.turns[0].think_s == 0.0 for c in a.conversations)
    thinks_a = [t.think_s for c in a.conversations for t in c.turns[1:]]
    thinks_b = [t.think_s for c in b.conversations for t in c.turns[1:]]
    assert thinks_a != thinks_b and all(x > 0 for x in thinks_a + thinks_b)


@pytest.mark.parametrize(
    ("think", "expected_mean", "tolerance"),
    [
        (ThinkSpec("fixed", 2.5), 2.5, 0.0),
        (ThinkSpec("exponential", 2.0), 2.0, 0.15),
        (ThinkSpec("lognormal", 3.0, 0.8), 3.0, 0.25),
        (ThinkSpec("exponential", 0.0), 0.0, 0.0),
    ],
)
def test_think_time_means(think: ThinkSpec, expected_mean: float, tolerance: float) -> None:
    spec = WorkloadSpec(reuse=("multi-turn",), turns=(5,), sessions_per_class=500, think=think)
    trace = generate_matrix(spec)
    thinks = [t.think_s for c in trace.conversations for t in c.turns[1:]]
    assert len(thinks) == 2000
    assert statistics.fmean(thinks) == pytest.approx(expected_mean, abs=tolerance)


@pytest.mark.parametrize(
    ("arrival", "cv"),
    [
        (ArrivalSpec("poisson", rate_rps=4.0), 1.0),
        (ArrivalSpec("gamma", rate_rps=4.0, cv=1.0), 1.0),
        (ArrivalSpec("gamma", rate_rps=4.0, cv=3.0), 3.0),
        (ArrivalSpec("gamma", rate_rps=4.0, cv=0.25), 0.25),
    ],
)
def test_arrival_processes(arrival: ArrivalSpec, cv: float) -> None:
    spec = WorkloadSpec(sessions_per_class=4000, arrival=arrival)
    starts = _starts(generate_matrix(spec))
    gaps = [b - a for a, b in zip([0.0, *starts], starts, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.15)


def test_closed_loop_concurrency() -> None:
    spec = WorkloadSpec(arrival=ArrivalSpec("concurrency", concurrency=3))
    trace = generate_matrix(spec)
    assert trace.concurrency == 3
    assert _starts(trace) == [0.0] * 8
    assert generate_matrix(WorkloadSpec()).concurrency is None


def test_writes_native(tmp_path: Path) -> None:
    path = tmp_path / "matrix.jsonl"
    trace = generate_matrix(WorkloadSpec(reuse=("system-prefix",)), path)
    assert load_trace(path) == trace
    assert trace.source == "matrix:seed=0"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("spec.json", '{"prompt_tokens": [64], "reuse": ["multi-turn"], "turns": [2], "seed": 3}'),
        ("spec.toml", 'prompt_tokens = [64]\nreuse = ["multi-turn"]\nturns = [2]\nseed = 3\n'),
    ],
)
def test_read_spec(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert read_spec(path) == WorkloadSpec(
        prompt_tokens=(64,), reuse=("multi-turn",), turns=(2,), seed=3
    )


def test_read_spec_rejects_unknown_fields(tmp_path: Path) -> None:
    path = tmp_path / "spec.toml"
    path.write_text("prompt_token = [64]\n")
    with pytest.raises(ValueError, match="prompt_token"):
        read_spec(path)
