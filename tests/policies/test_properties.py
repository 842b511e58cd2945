from __future__ import annotations

from collections.abc import Mapping

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import (
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    Migrate,
    Objectives,
    Policy,
    Recompute,
    Reject,
    Residency,
    Turn,
    WorkerView,
    create_policy,
)

SPECS: list[tuple[str, Mapping[str, object]]] = [
    ("round-robin", {}),
    ("colocate", {}),
    ("disaggregate", {}),
    ("threshold", {}),
    ("threshold", {"threshold": 0}),
    ("threshold", {"threshold": 3000}),
]
SPEC_IDS = [f"{name}{dict(params) or ''}" for name, params in SPECS]
PREFILL_ROLES = ("prefill", "mixed")
DECODE_ROLES = ("decode", "mixed")

_decision_decoder = msgspec.json.Decoder(Decision)


@st.composite
def clusters(draw: st.DrawFn) -> ClusterView:
    ids = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=3), max_size=7, unique=True))
    workers = tuple(
        WorkerView(
            worker_id=worker_id,
            role=draw(st.sampled_from(("prefill", "decode", "mixed"))),
            healthy=draw(st.booleans()),
            draining=draw(st.booleans()),
            running=draw(st.integers(0, 64)),
            waiting=draw(st.integers(0, 64)),
            inflight=draw(st.integers(0, 16)),
        )
        for worker_id in ids
    )
    resident = draw(st.none() | st.sampled_from([*ids, "gone"]))
    residency = None
    if resident is not None:
        tokens = draw(st.integers(1, 100_000))
        residency = Residency(worker_id=resident, tokens=tokens, bytes=tokens * 131072, epoch=1)
    return ClusterView(now_s=0.0, workers=workers, residency=residency)


turns = st.builds(
    lambda uncached, extra: Turn(
        session_id="s",
        request_id="r",
        prompt_tokens=uncached + extra,
        uncached_tokens=uncached,
        max_tokens=64,
        objectives=Objectives(ttft_ms=1000.0, itl_ms=50.0),
        arrival_s=0.0,
    ),
    st.integers(0, 10_000),
    st.integers(0, 10_000),
)
steps = st.lists(st.tuples(turns, clusters()), min_size=1, max_size=6)


def _can(view: ClusterView, worker_id: str, roles: tuple[str, ...]) -> bool:
    worker = view.worker(worker_id)
    return worker is not None and worker.accepts_new_work and worker.role in roles


def _any_can(view: ClusterView, roles: tuple[str, ...]) -> bool:
    return any(w.accepts_new_work and w.role in roles for w in view.workers)


def _run(policy: Policy, sequence: list[tuple[Turn, ClusterView]]) -> list[Decision]:
    return [policy.decide(turn, view) for turn, view in sequence]


@pytest.mark.parametrize(("name", "params"), SPECS, ids=SPEC_IDS)
@given(sequence=steps)
def test_decisions_are_feasible(
    name: str, params: Mapping[str, object], sequence: list[tuple[Turn, ClusterView]]
) -> None:
    policy = create_policy(name, params)
    for (_, view), decision in zip(sequence, _run(policy, sequence), strict=True):
        assert decision.reason
        match decision:
            case Colocate(worker=worker) | Recompute(worker=worker):
                assert _can(view, worker, DECODE_ROLES)
            case Handoff(prefill_worker=prefill, decode_worker=decode):
                assert prefill != decode
                assert _can(view, prefill, PREFILL_ROLES)
                assert _can(view, decode, DECODE_ROLES)
            case Migrate(source=source, destination=destination):
                assert view.residency is not None
                assert source == view.residency.worker_id
                assert _can(view, destination, DECODE_ROLES)
            case Reject():
                # Only a missing role justifies a refusal; only round-robin needs prefill.
                assert not _any_can(view, DECODE_ROLES) or (
                    name == "round-robin" and not _any_can(view, PREFILL_ROLES)
                )
        if isinstance(decision, Recompute):
            assert view.residency is not None
            assert decision.worker != view.residency.worker_id


# round-robin is session-blind by design.
@pytest.mark.parametrize(("name", "params"), SPECS[1:], ids=SPEC_IDS[1:])
@given(sequence=steps)
def test_affinity_kept_when_possible(
    name: str, params: Mapping[str, object], sequence: list[tuple[Turn, ClusterView]]
) -> None:
    policy = create_policy(name, params)
    for (_, view), decision in zip(sequence, _run(policy, sequence), strict=True):
        if view.residency is None or not _can(view, view.residency.worker_id, DECODE_ROLES):
            continue
        resident = view.residency.worker_id
        match decision:
            case Colocate(worker=worker):
                assert worker == resident
            case Handoff(decode_worker=decode):
                assert decode == resident
            case _:
                raise AssertionError(f"{decision!r} abandons an eligible resident worker")


@pytest.mark.parametrize(("name", "params"), SPECS, ids=SPEC_IDS)
@given(sequence=steps)
def test_handoff_only_where_the_policy_allows(
    name: str, params: Mapping[str, object], sequence: list[tuple[Turn, ClusterView]]
) -> None:
    policy = create_policy(name, params)
    threshold = int(str(params.get("threshold", 1024)))
    for (turn, _), decision in zip(sequence, _run(policy, sequence), strict=True):
        if not isinstance(decision, Handoff):
            continue
        assert name != "colocate"
        if name == "threshold":
            assert turn.uncached_tokens >= threshold


@pytest.mark.parametrize(("name", "params"), SPECS, ids=SPEC_IDS)
@given(sequence=steps, data=st.data())
def test_deterministic_and_order_independent(
    name: str,
    params: Mapping[str, object],
    sequence: list[tuple[Turn, ClusterView]],
    data: st.DataObject,
) -> None:
    expected = _run(create_policy(name, params), sequence)
    assert _run(create_policy(name, params), sequence) == expected
    shuffled = [
        (
            turn,
            msgspec.structs.replace(view, workers=tuple(data.draw(st.permutations(view.workers)))),
        )
        for turn, view in sequence
    ]
    assert _run(create_policy(name, params), shuffled) == expected
    if name != "round-robin":  # the others keep no state between turns
        policy = create_policy(name, params)
        for (turn, view), decision in zip(sequence, expected, strict=True):
            assert policy.decide(turn, view) == decision
            assert policy.decide(turn, view) == decision


@pytest.mark.parametrize(("name", "params"), SPECS, ids=SPEC_IDS)
@given(sequence=steps)
def test_decisions_round_trip_as_tagged_union(
    name: str, params: Mapping[str, object], sequence: list[tuple[Turn, ClusterView]]
) -> None:
    for decision in _run(create_policy(name, params), sequence):
        encoded = msgspec.json.encode(decision)
        assert _decision_decoder.decode(encoded) == decision
        assert type(_decision_decoder.decode(encoded)) is type(decision)
