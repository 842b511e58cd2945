"""Non-stationary workloads: phases, ramps, returning bursts and stitched traces."""

from __future__ import annotations

import msgspec
import pytest

from bench.traces.model import Conversation, Trace, TraceTurn
from bench.traces.phases import (
    LONG_ANSWER,
    LONG_PROMPT,
    RETURNING,
    Phase,
    PhasedSpec,
    ReturningBurst,
    SessionClass,
    generate_phased,
    mix_shift,
    ramp_shift,
    returning_burst,
    stitch,
)


def _starts(trace: Trace) -> list[tuple[float, str]]:
    return sorted((c.turns[0].arrival_s, c.turns[0].klass) for c in trace.conversations)


@pytest.mark.parametrize("make", [lambda: mix_shift(20, 2.0, 2), lambda: ramp_shift(60, 2.0),
                                  lambda: returning_burst(60, 2.0)])  # fmt: skip
def test_same_spec_same_trace_and_seeds_differ(make: object) -> None:
    spec = make()  # type: ignore[operator]
    assert generate_phased(spec) == generate_phased(spec)
    other = generate_phased(msgspec.structs.replace(spec, seed=1))
    assert other.conversations != generate_phased(spec).conversations


def test_mix_shift_alternates_its_phases() -> None:
    trace = generate_phased(mix_shift(phase_s=20, rate_rps=3.0, cycles=2))
    for start, klass in _starts(trace):
        expected = LONG_PROMPT if int(start // 20) % 2 == 0 else LONG_ANSWER
        assert klass == expected.label
    assert trace.duration_s < 80 and len(trace.conversations) > 150


def test_a_ramp_raises_the_rate_and_turns_the_mix() -> None:
    trace = generate_phased(ramp_shift(duration_s=300, rate_rps=2.0))
    starts = _starts(trace)
    early = [k for s, k in starts if s < 100]
    late = [k for s, k in starts if s >= 200]
    assert len(late) > 1.6 * len(early)  # 1 -> 3 sessions/s: thirds average 4/3 and 8/3
    assert early.count(LONG_ANSWER.label) > 0.6 * len(early)
    assert late.count(LONG_PROMPT.label) > 0.6 * len(late)


def test_returning_sessions_come_back_together() -> None:
    spec = returning_burst(duration_s=200, rate_rps=2.0)
    trace = generate_phased(spec)
    back = [c for c in trace.conversations if c.turns[0].klass == RETURNING.label]
    assert len(back) > 20
    for c in back:
        assert c.turns[0].arrival_s < 50
        assert all(100 <= t.arrival_s <= 104 for t in c.turns[1:])
        assert c.turns[1].prefix_blocks[:16] == c.turns[0].prefix_blocks[:16]  # context reread


def test_stretched_keeps_wall_time_at_its_scale() -> None:
    spec = mix_shift(phase_s=10, rate_rps=1.0, cycles=1)
    trace = generate_phased(spec.stretched(4.0)).scaled(4.0)
    assert trace.duration_s <= 20
    first = [k for s, k in _starts(trace) if s < 10]
    assert set(first) == {LONG_PROMPT.label} and len(first) > 20  # 4 x 1 session/s


@pytest.mark.parametrize(
    "build",
    [lambda: Phase(0, 1.0, (LONG_PROMPT,)), lambda: Phase(1, 1.0, ()),
     lambda: Phase(1, 1.0, (LONG_PROMPT,), end_weights=(1.0, 2.0)),
     lambda: SessionClass(0, 1), lambda: ReturningBurst(SessionClass(100, 10), 1.0, 0, 1, 2, 1),
     lambda: ReturningBurst(RETURNING, 1.0, 5, 1, 2, 1), lambda: PhasedSpec("x", ())],
)  # fmt: skip
def test_bad_specs_are_refused(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


def _part(name: str, arrivals: list[float], blocks: tuple[int, ...]) -> Trace:
    conversations = tuple(
        Conversation(f"s{i}", (TraceTurn(a, 100, 10, blocks),)) for i, a in enumerate(arrivals)
    )
    return Trace(name, conversations)


def test_stitch_runs_parts_in_sequence_with_their_own_sessions_and_blocks() -> None:
    a = _part("a", [5.0, 7.0, 15.0], (0, 1))
    b = _part("b", [100.0, 103.0], (0, 3))
    trace = stitch("ab", [("a", a), ("b", b)], gap_s=1.0)
    turns = [(c.session_id, c.turns[0].arrival_s, c.turns[0].prefix_blocks, c.turns[0].klass)
             for c in trace.conversations]  # fmt: skip
    assert turns == [("a/s0", 0.0, (0, 1), "a"), ("a/s1", 2.0, (0, 1), "a"),
                     ("a/s2", 10.0, (0, 1), "a"), ("b/s0", 11.0, (2, 5), "b"),
                     ("b/s1", 14.0, (2, 5), "b")]  # fmt: skip
    with pytest.raises(ValueError, match="block sizes"):
        stitch("x", [("a", a), ("c", msgspec.structs.replace(b, block_tokens=16))])
