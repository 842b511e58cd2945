from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.traces.model import (
    Conversation,
    Trace,
    TraceTurn,
    decode_native,
    encode_native,
    load_trace,
    read_native,
    write_native,
)


def _turn(
    arrival: float,
    new: int = 10,
    out: int = 5,
    *,
    prefix_blocks: tuple[int, ...] = (),
    think_s: float = 0.0,
) -> TraceTurn:
    return TraceTurn(arrival, new, out, prefix_blocks=prefix_blocks, think_s=think_s)


def _trace() -> Trace:
    return Trace(
        name="t",
        conversations=(
            Conversation("a", (_turn(0.0, 100, 10), _turn(0.0, 20, 30, think_s=1.5)), 50),
            Conversation("b", (_turn(0.5, prefix_blocks=(1, 2)),)),
            # A later turn whose earliest start precedes its first turn's arrival.
            Conversation("c", (_turn(2.0), _turn(1.0), _turn(3.0))),
        ),
        block_tokens=16,
        source="unit",
    )


def _order(trace: Trace) -> list[tuple[str, int]]:
    return [(s.conversation.session_id, s.turn_index) for s in trace.iter_turns()]


def test_helpers() -> None:
    trace = _trace()
    assert trace.num_turns == 6
    assert trace.duration_s == 3.0
    assert Trace("empty", ()).duration_s == 0.0
    a = trace.conversations[0]
    assert [a.context_tokens(i) for i in range(2)] == [150, 50 + 100 + 10 + 20]


def test_iter_turns_orders_by_arrival_and_keeps_session_order() -> None:
    assert _order(_trace()) == [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("c", 2)]


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (0, {}),
        (1, {"a": 1}),
        (3, {"a": 2, "b": 1}),
        (5, {"a": 2, "b": 1, "c": 2}),
        (99, {"a": 2, "b": 1, "c": 3}),
    ],
)
def test_slice_keeps_a_prefix_of_each_session(limit: int, expected: dict[str, int]) -> None:
    sliced = _trace().slice(limit)
    assert {c.session_id: len(c.turns) for c in sliced.conversations} == expected
    assert sliced.num_turns == min(limit, 6)
    assert (sliced.name, sliced.block_tokens, sliced.source) == ("t", 16, "unit")


def test_scaled_divides_arrivals_keeps_think() -> None:
    trace = _trace().scaled(2.0)
    assert [t.arrival_s for c in trace.conversations for t in c.turns] == [
        0.0,
        0.0,
        0.25,
        1.0,
        0.5,
        1.5,
    ]
    assert trace.conversations[0].turns[1].think_s == 1.5
    assert trace.duration_s == 1.5
    with pytest.raises(ValueError, match="rate_scale"):
        _trace().scaled(0)


@pytest.mark.parametrize(
    "build",
    [
        lambda: _turn(0.0, new=-1),
        lambda: _turn(-1.0),
        lambda: _turn(0.0, think_s=-0.1),
        lambda: Conversation("x", ()),
        lambda: Trace("t", (Conversation("x", (_turn(0),)), Conversation("x", (_turn(1),)))),
        lambda: Trace("t", (), block_tokens=0),
        lambda: Trace("t", (), concurrency=0),
    ],
)
def test_invalid_values_rejected(build: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        build()


def test_native_header_and_roundtrip(tmp_path: Path) -> None:
    trace = msgspec.structs.replace(_trace(), concurrency=4)
    path = tmp_path / "x.jsonl"
    write_native(trace, path)
    lines = path.read_bytes().splitlines()
    assert json.loads(lines[0]) == {
        "format": "session-router-trace",
        "version": 1,
        "name": "t",
        "block_tokens": 16,
        "source": "unit",
        "concurrency": 4,
    }
    assert len(lines) == 4
    # Empty, null and zero-int defaults are omitted from conversation lines.
    assert json.loads(lines[2]) == {
        "session_id": "b",
        "turns": [
            {
                "arrival_s": 0.5,
                "new_input_tokens": 10,
                "output_tokens": 5,
                "prefix_blocks": [1, 2],
                "think_s": 0.0,
            }
        ],
    }
    assert read_native(path) == trace
    assert load_trace(path) == trace


def test_native_detected_by_content_not_extension(tmp_path: Path) -> None:
    path = tmp_path / "looks_like.csv"
    path.write_bytes(b"\n" + encode_native(_trace()).replace(b"\n", b"\n\n"))
    assert load_trace(path) == _trace()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty"),
        (
            b'{"format": "session-router-trace", "version": 2, "name": "x"}\n',
            "version 2",
        ),
        (b'{"format": "other", "version": 1, "name": "x"}\n', "format"),
        (
            b'{"format": "session-router-trace", "version": 1, "name": "x"}\n'
            b'{"session_id": "s", "turns": [{"arrival_s": 0, "new_input_tokens": 1,'
            b' "output_tokens": 1, "surprise": 1}]}\n',
            "surprise",
        ),
    ],
)
def test_native_rejects_bad_input(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_native(data)


def test_unknown_content_names_formats_tried(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("hello,world\n1,2\n")
    with pytest.raises(ValueError, match="tried native, mooncake, azure, burstgpt, sharegpt"):
        load_trace(path)


_floats = st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False)
_turns = st.builds(
    TraceTurn,
    arrival_s=_floats,
    new_input_tokens=st.integers(0, 10**6),
    output_tokens=st.integers(0, 10**5),
    prefix_blocks=st.lists(st.integers(-(2**62), 2**62), max_size=5).map(tuple),
    think_s=_floats,
    ttft_slo_ms=st.none() | _floats,
    itl_slo_ms=st.none() | _floats,
    klass=st.text(max_size=8),
)


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(st.lists(_turns, min_size=1, max_size=4), max_size=5),
    name=st.text(max_size=10),
    system=st.integers(0, 4096),
)
def test_native_roundtrip_property(turns: list[list[TraceTurn]], name: str, system: int) -> None:
    trace = Trace(
        name=name,
        conversations=tuple(Conversation(f"s{i}", tuple(ts), system) for i, ts in enumerate(turns)),
    )
    assert decode_native(encode_native(trace)) == trace
    sliced = trace.slice(trace.num_turns // 2)
    assert sliced.num_turns == trace.num_turns // 2
    order = _order(trace)
    assert sorted(order) == sorted(
        (c.session_id, i) for c in trace.conversations for i, _ in enumerate(c.turns)
    )
    for session in {s for s, _ in order}:
        indexes = [i for s, i in order if s == session]
        assert indexes == sorted(indexes)
