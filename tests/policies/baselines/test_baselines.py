from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import pytest

from policies import (
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    Objectives,
    Outcome,
    Recompute,
    Reject,
    Residency,
    Role,
    Turn,
    WorkerView,
    create_policy,
)


def w(
    worker_id: str,
    role: Role,
    *,
    healthy: bool = True,
    draining: bool = False,
    running: int = 0,
    waiting: int = 0,
    inflight: int = 0,
) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        role=role,
        healthy=healthy,
        draining=draining,
        running=running,
        waiting=waiting,
        inflight=inflight,
    )


def view(*workers: WorkerView, resident: str | None = None) -> ClusterView:
    residency = None
    if resident is not None:
        residency = Residency(worker_id=resident, tokens=4000, bytes=4000 * 131072, epoch=3)
    return ClusterView(now_s=100.0, workers=workers, residency=residency)


def turn(uncached: int = 2000, prompt: int = 6000) -> Turn:
    return Turn(
        session_id="s1",
        request_id="r1",
        prompt_tokens=max(prompt, uncached),
        uncached_tokens=uncached,
        max_tokens=128,
        objectives=Objectives(ttft_ms=1000.0, itl_ms=50.0),
        arrival_s=100.0,
    )


def without_reason(decision: Decision) -> Decision:
    return msgspec.structs.replace(decision, reason="")


REJECT_DECODE = Reject(retry_after_s=1.0)
REJECT_PREFILL = Reject(retry_after_s=1.0)

# A split fleet: p2 and d2 are the least loaded of their roles.
P1 = w("p1", "prefill", running=4)
P2 = w("p2", "prefill", waiting=1)
D1 = w("d1", "decode", running=6, waiting=1)
D2 = w("d2", "decode", running=3)
SPLIT = (P1, P2, D1, D2)
D1_SICK = w("d1", "decode", healthy=False, running=6)
D1_DRAINING = w("d1", "decode", draining=True, running=6)
D2_SICK = w("d2", "decode", healthy=False)
M1 = w("m1", "mixed", running=2)
M2 = w("m2", "mixed", running=1)

CASES: list[tuple[str, str, Mapping[str, object], ClusterView, Turn, Decision]] = [
    # colocate: affinity, never hands off
    ("new session", "colocate", {}, view(*SPLIT), turn(), Colocate("d2")),
    ("resident healthy", "colocate", {}, view(*SPLIT, resident="d1"), turn(), Colocate("d1")),
    (
        "resident unhealthy",
        "colocate",
        {},
        view(P1, P2, D1_SICK, D2, resident="d1"),
        turn(),
        Recompute("d2"),
    ),
    (
        "resident draining",
        "colocate",
        {},
        view(P1, P2, D1_DRAINING, D2, resident="d1"),
        turn(),
        Recompute("d2"),
    ),
    ("resident gone", "colocate", {}, view(P1, D2, resident="d9"), turn(), Recompute("d2")),
    ("resident on prefill", "colocate", {}, view(*SPLIT, resident="p1"), turn(), Recompute("d2")),
    ("no prefill workers", "colocate", {}, view(D1, D2), turn(), Colocate("d2")),
    ("no decode workers", "colocate", {}, view(P1, P2), turn(), REJECT_DECODE),
    ("decode all down", "colocate", {}, view(P1, D1_SICK, D2_SICK), turn(), REJECT_DECODE),
    ("mixed only", "colocate", {}, view(M1, M2), turn(), Colocate("m2")),
    # disaggregate: fixed split
    ("new session", "disaggregate", {}, view(*SPLIT), turn(), Handoff("p2", "d2")),
    (
        "resident healthy",
        "disaggregate",
        {},
        view(*SPLIT, resident="d1"),
        turn(),
        Handoff("p2", "d1"),
    ),
    (
        "resident unhealthy",
        "disaggregate",
        {},
        view(P1, P2, D1_SICK, D2, resident="d1"),
        turn(),
        Handoff("p2", "d2"),
    ),
    (
        "resident draining",
        "disaggregate",
        {},
        view(P1, P2, D1_DRAINING, D2, resident="d1"),
        turn(),
        Handoff("p2", "d2"),
    ),
    ("no prefill, new session", "disaggregate", {}, view(D1, D2), turn(), Colocate("d2")),
    (
        "no prefill, resident healthy",
        "disaggregate",
        {},
        view(D1, D2, resident="d1"),
        turn(),
        Colocate("d1"),
    ),
    (
        "no prefill, resident unhealthy",
        "disaggregate",
        {},
        view(D1_SICK, D2, resident="d1"),
        turn(),
        Recompute("d2"),
    ),
    (
        "prefill draining",
        "disaggregate",
        {},
        view(w("p1", "prefill", draining=True), D2),
        turn(),
        Colocate("d2"),
    ),
    ("no decode workers", "disaggregate", {}, view(P1, P2), turn(), REJECT_DECODE),
    ("mixed pair", "disaggregate", {}, view(M1, M2), turn(), Handoff("m1", "m2")),
    ("single mixed", "disaggregate", {}, view(M1), turn(), Colocate("m1")),
    ("mixed decodes", "disaggregate", {}, view(P1, M2, D2), turn(), Handoff("p1", "m2")),
    (
        "mixed prefills",
        "disaggregate",
        {},
        view(P1, M2, D1, resident="d1"),
        turn(),
        Handoff("m2", "d1"),
    ),
    # threshold: conditional disaggregation at 1024 uncached tokens
    ("below, new session", "threshold", {}, view(*SPLIT), turn(1023), Colocate("d2")),
    ("at, new session", "threshold", {}, view(*SPLIT), turn(1024), Handoff("p2", "d2")),
    ("above, new session", "threshold", {}, view(*SPLIT), turn(50_000), Handoff("p2", "d2")),
    (
        "below, resident healthy",
        "threshold",
        {},
        view(*SPLIT, resident="d1"),
        turn(10),
        Colocate("d1"),
    ),
    (
        "above, resident healthy",
        "threshold",
        {},
        view(*SPLIT, resident="d1"),
        turn(5000),
        Handoff("p2", "d1"),
    ),
    (
        "below, resident unhealthy",
        "threshold",
        {},
        view(P1, D1_SICK, D2, resident="d1"),
        turn(10),
        Recompute("d2"),
    ),
    (
        "below, resident draining",
        "threshold",
        {},
        view(P1, D1_DRAINING, D2, resident="d1"),
        turn(10),
        Recompute("d2"),
    ),
    (
        "above, resident draining",
        "threshold",
        {},
        view(P1, D1_DRAINING, D2, resident="d1"),
        turn(5000),
        Handoff("p1", "d2"),
    ),
    ("above, no prefill", "threshold", {}, view(D1, D2), turn(5000), Colocate("d2")),
    ("below, no decode", "threshold", {}, view(P1, P2), turn(10), REJECT_DECODE),
    ("above, no decode", "threshold", {}, view(P1, P2), turn(5000), REJECT_DECODE),
    ("zero threshold", "threshold", {"threshold": "0"}, view(*SPLIT), turn(0), Handoff("p2", "d2")),
    ("raised, below", "threshold", {"threshold": "2048"}, view(*SPLIT), turn(2047), Colocate("d2")),
    (
        "raised, at",
        "threshold",
        {"threshold": "2048"},
        view(*SPLIT),
        turn(2048),
        Handoff("p2", "d2"),
    ),
]


@pytest.mark.parametrize(
    ("spec", "params", "cluster", "the_turn", "expected"),
    [pytest.param(*case[1:], id=f"{case[1]}: {case[0]}") for case in CASES],
)
def test_decision(
    spec: str,
    params: Mapping[str, object],
    cluster: ClusterView,
    the_turn: Turn,
    expected: Decision,
) -> None:
    decision = create_policy(spec, params).decide(the_turn, cluster)
    assert without_reason(decision) == expected
    assert decision.reason


@pytest.mark.parametrize(
    ("spec", "cluster", "missing"),
    [
        ("colocate", view(P1), "decode"),
        ("disaggregate", view(P1), "decode"),
        ("threshold", view(P1), "decode"),
        ("round-robin", view(P1), "decode"),
        ("round-robin", view(D1, D2), "prefill"),
        ("round-robin", view(), "decode"),
    ],
)
def test_reject_names_missing_role(spec: str, cluster: ClusterView, missing: str) -> None:
    decision = create_policy(spec).decide(turn(), cluster)
    assert isinstance(decision, Reject)
    assert decision.retry_after_s == 1.0
    assert decision.reason.startswith(f"no eligible {missing} worker")


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        # score = inflight + running + 2 x waiting
        ((w("d1", "decode", running=3), w("d2", "decode", waiting=2)), "d1"),
        ((w("d1", "decode", waiting=2), w("d2", "decode", inflight=1, running=2)), "d2"),
        ((w("d1", "decode", inflight=4), w("d2", "decode", waiting=1, running=1)), "d2"),
        # ties go to the lower worker_id, whatever the order in the view
        ((w("d2", "decode", running=2), w("d1", "decode", waiting=1)), "d1"),
        ((w("m9", "mixed"), w("d3", "decode")), "d3"),
    ],
)
def test_least_loaded_score(workers: tuple[WorkerView, ...], expected: str) -> None:
    assert without_reason(create_policy("colocate").decide(turn(), view(*workers))) == Colocate(
        expected
    )


ROUND_ROBIN_CASES: list[tuple[str, Sequence[ClusterView], list[Decision]]] = [
    (
        "split cycles both pools",
        [view(P1, P2, D1, D2, w("d3", "decode"))] * 3,
        [Handoff("p1", "d1"), Handoff("p2", "d2"), Handoff("p1", "d3")],
    ),
    (
        "ignores load and residency",
        [view(*SPLIT, resident="d2")] * 3,
        [Handoff("p1", "d1"), Handoff("p2", "d2"), Handoff("p1", "d1")],
    ),
    (
        "skips unhealthy and draining",
        [view(P1, w("p2", "prefill", draining=True), D1, D2_SICK)] * 3,
        [Handoff("p1", "d1")] * 3,
    ),
    ("mixed only colocates", [view(M2, M1)] * 3, [Colocate("m1"), Colocate("m2"), Colocate("m1")]),
    (
        "mixed workers join both pools",
        [view(P1, M1, D1)] * 3,
        [Handoff("m1", "d1"), Handoff("p1", "m1"), Handoff("m1", "d1")],
    ),
    (
        "one worker for both colocates",
        [view(M1, D1)] * 3,
        [Handoff("m1", "d1"), Colocate("m1"), Handoff("m1", "d1")],
    ),
    (
        "reject does not advance",
        [view(*SPLIT), view(P1, P2), view(*SPLIT)],
        [Handoff("p1", "d1"), REJECT_DECODE, Handoff("p2", "d2")],
    ),
    ("no prefill workers", [view(D1, D2)] * 3, [REJECT_PREFILL] * 3),
    ("no decode workers", [view(P1, P2)] * 3, [REJECT_DECODE] * 3),
]


@pytest.mark.parametrize(
    ("clusters", "expected"),
    [pytest.param(case[1], case[2], id=case[0]) for case in ROUND_ROBIN_CASES],
)
def test_round_robin_sequence(clusters: Sequence[ClusterView], expected: list[Decision]) -> None:
    policy = create_policy("round-robin")
    decisions = [without_reason(policy.decide(turn(), cluster)) for cluster in clusters]
    assert decisions == expected


@pytest.mark.parametrize("spec", ["round-robin", "colocate", "disaggregate", "threshold"])
def test_observe_changes_nothing(spec: str) -> None:
    cluster = view(*SPLIT, M1, resident="d1")
    turns = [turn(uncached) for uncached in (10, 5000, 1024, 0)]
    reference = create_policy(spec)
    expected = [reference.decide(t, cluster) for t in turns]
    policy = create_policy(spec)
    decisions = []
    for t in turns:
        decision = policy.decide(t, cluster)
        policy.observe(_outcome())
        decisions.append(decision)
    assert decisions == expected


def _outcome() -> Outcome:
    return Outcome(
        request_id="r1",
        session_id="s1",
        action="handoff",
        prefill_worker="p2",
        decode_worker="d2",
        prompt_tokens=6000,
        cached_tokens=4000,
        completion_tokens=128,
        ok=True,
        transfer_ms=30.0,
        ttft_ms=400.0,
    )
