from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec
import pytest

from policies import (
    AdaptiveParams,
    AdaptivePolicy,
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    LinkView,
    Migrate,
    Objectives,
    Outcome,
    PolicyConfigError,
    Prediction,
    Recompute,
    Reject,
    Residency,
    Role,
    Turn,
    WorkerView,
    available_policies,
    create_policy,
)
from policies.adaptive.scoring import Scorer

KV = 131072  # bytes per token, Llama-3.1-8B bf16


def w(worker_id: str, role: Role, **fields: object) -> WorkerView:
    return msgspec.convert(
        {"worker_id": worker_id, "role": role, "healthy": True, **fields}, WorkerView
    )


def mesh(*ids: str, **fields: object) -> tuple[LinkView, ...]:
    """Links between every ordered pair of `ids`, 50 GB/s unless `fields` say otherwise."""
    base: dict[str, object] = {"capacity_bps": 50e9, **fields}
    return tuple(
        msgspec.convert({"src": src, "dst": dst, **base}, LinkView)
        for src in ids
        for dst in ids
        if src != dst
    )


def view(
    *workers: WorkerView,
    links: tuple[LinkView, ...] = (),
    resident: str | None = None,
    tokens: int = 8000,
) -> ClusterView:
    residency = None
    if resident is not None:
        residency = Residency(worker_id=resident, tokens=tokens, bytes=tokens * KV, epoch=2)
    return ClusterView(now_s=10.0, workers=workers, links=links, residency=residency)


def turn(prompt: int, uncached: int, ttft_ms: float = 1000.0, itl_ms: float = 50.0) -> Turn:
    return Turn(
        session_id="s1",
        request_id="r1",
        prompt_tokens=prompt,
        uncached_tokens=uncached,
        max_tokens=256,
        objectives=Objectives(ttft_ms=ttft_ms, itl_ms=itl_ms),
        arrival_s=10.0,
    )


def bare(decision: Decision) -> Decision:
    """The placement alone: without the terms, the reason and the due time."""
    if isinstance(decision, Reject):
        return msgspec.structs.replace(decision, predicted=Prediction(), reason="")
    return msgspec.structs.replace(decision, predicted=Prediction(), reason="", due_ms=None)


LINKS = mesh("p1", "d1", "d2")
CONGESTED = mesh("p1", "d1", "d2", reserved_bytes=10**12)
# A resident decode worker under 64 streams with 100 ms ITL objectives, an idle prefill worker.
BUSY = (w("p1", "prefill"), w("d1", "decode", running=64))
BUSY_TURN = turn(18_000, 16_000, ttft_ms=3000.0, itl_ms=100.0)
# The resident worker is overloaded; d2 idle, the link between them idle.
OVERLOADED = (
    w("p1", "prefill"),
    w("d1", "decode", running=40, waiting=32, kv_usage=0.97),
    w("d2", "decode"),
)
RETURNING = turn(8200, 200)
SATURATED = (
    w("p1", "prefill", waiting=50),
    w("d1", "decode", running=40, waiting=50),
    w("d2", "decode", waiting=50),
)
STREAMING = (w("p1", "prefill"), w("d1", "decode", running=32), w("d2", "decode", running=32))
# A new session's choice: beside 64 streams at once, or behind a queue past its objective.
STALL_OR_WAIT = (w("m1", "mixed", running=64), w("m2", "mixed", waiting=24))

CASES: list[tuple[str, Mapping[str, object], ClusterView, Turn, Decision]] = [
    (
        "short returning turn, lightly loaded resident",
        {},
        view(
            w("p1", "prefill"),
            w("d1", "decode", running=4),
            w("d2", "decode", running=2),
            links=LINKS,
            resident="d1",
            tokens=5800,
        ),
        turn(6000, 200),
        Colocate("d1"),
    ),
    (
        "long fresh prompt beside 64 streams",
        {},
        view(*BUSY, links=LINKS, resident="d1", tokens=2000),
        BUSY_TURN,
        Handoff("p1", "d1"),
    ),
    (
        "long fresh prompt, no link in the view",
        {},
        view(*BUSY, resident="d1", tokens=2000),
        BUSY_TURN,
        Handoff("p1", "d1"),
    ),
    (
        "long fresh prompt, links congested by other replicas",
        {},
        view(*BUSY, links=CONGESTED, resident="d1", tokens=2000),
        BUSY_TURN,
        Colocate("d1"),
    ),
    (
        # A migration runs its prefill leg on the source, behind the same queue.
        "resident overloaded, idle link: recompute rather than migrate",
        {},
        view(*OVERLOADED, links=LINKS, resident="d1"),
        RETURNING,
        Recompute("d2"),
    ),
    (
        "resident overloaded, links congested by other replicas",
        {},
        view(*OVERLOADED, links=CONGESTED, resident="d1"),
        RETURNING,
        Recompute("d2"),
    ),
    (
        "resident overloaded, migration threshold above its queue",
        {"migrate_queue_threshold": 64, "migrate_kv_usage": 1.0},
        view(*OVERLOADED, links=LINKS, resident="d1"),
        RETURNING,
        Recompute("d2"),
    ),
    (
        "nothing meets the objective",
        {},
        view(*SATURATED, links=LINKS, resident="d1"),
        turn(8200, 200, ttft_ms=10.0),
        Reject(retry_after_s=1.0),
    ),
    (
        "nothing meets the objective, own retry-after",
        {"retry_after_s": "2.5"},
        view(*SATURATED, links=LINKS, resident="d1"),
        turn(8200, 200, ttft_ms=10.0),
        Reject(retry_after_s=2.5),
    ),
    (
        "nothing meets the objective, served best effort where it costs least",
        {"on_infeasible": "serve"},
        view(*SATURATED, links=LINKS, resident="d1"),
        turn(8200, 200, ttft_ms=10.0),
        Colocate("d1"),
    ),
    (
        "new session, saturated fleet",
        {"on_infeasible": "serve"},
        view(*SATURATED, links=LINKS),
        turn(8200, 8200, ttft_ms=10.0),
        Colocate("d2"),
    ),
    (
        "new session's answer packs onto the fuller decode worker (its step meets the ITL)",
        {},
        view(
            w("p1", "prefill"),
            w("d1", "decode", running=4),
            w("d2", "decode", running=2),
            links=LINKS,
        ),
        turn(500, 500),
        Colocate("d1"),
    ),
    (
        "new session never migrates, even from a busy fleet",
        {},
        view(*OVERLOADED, links=LINKS),
        turn(8200, 8200),
        Colocate("d2"),
    ),
    (
        "unhealthy resident",
        {},
        view(
            w("p1", "prefill"),
            w("d1", "decode", healthy=False),
            w("d2", "decode"),
            links=LINKS,
            resident="d1",
        ),
        RETURNING,
        Recompute("d2"),
    ),
    (
        "draining resident",
        {},
        view(
            w("p1", "prefill"),
            w("d1", "decode", draining=True),
            w("d2", "decode"),
            links=LINKS,
            resident="d1",
        ),
        RETURNING,
        Recompute("d2"),
    ),
    (
        "resident gone from the fleet",
        {},
        view(w("p1", "prefill"), w("d2", "decode"), links=LINKS, resident="d9"),
        RETURNING,
        Recompute("d2"),
    ),
    (
        "resident is a healthy prefill worker: move its state",
        {},
        view(w("p1", "prefill"), w("d2", "decode"), links=LINKS, resident="p1"),
        RETURNING,
        Migrate("p1", "d2"),
    ),
    (
        "no decode workers",
        {},
        view(w("p1", "prefill"), w("d1", "decode", healthy=False), resident="d1"),
        RETURNING,
        Reject(retry_after_s=1.0),
    ),
    (
        "4k prompt beside 32 streams, unchunked prefill stalls them",
        {},
        view(*STREAMING, links=LINKS, resident="d1", tokens=2000),
        turn(6000, 4000, itl_ms=100.0),
        Handoff("p1", "d1"),
    ),
    (
        "4k prompt beside 32 streams, chunked prefill fits their slack",
        {"chunked_prefill": 512},
        view(*STREAMING, links=LINKS, resident="d1", tokens=2000),
        turn(6000, 4000, itl_ms=100.0),
        Colocate("d1"),
    ),
    (
        # Its own TTFT is one miss; a prefill stalling 64 streams costs more than one.
        "new session: rejected rather than stall 64 streams to meet its own objective",
        {},
        view(*STALL_OR_WAIT, links=mesh("m1", "m2")),
        turn(4000, 4000, itl_ms=100.0),
        Reject(retry_after_s=1.0),
    ),
    (
        "new session: served best effort behind the queue rather than stall 64 streams",
        {"on_infeasible": "serve"},
        view(*STALL_OR_WAIT, links=mesh("m1", "m2")),
        turn(4000, 4000, itl_ms=100.0),
        Colocate("m2"),
    ),
    (
        "mixed workers only: recompute on the idle one rather than stall 48 streams",
        {},
        view(
            w("m1", "mixed", running=48),
            w("m2", "mixed"),
            links=mesh("m1", "m2"),
            resident="m1",
            tokens=2000,
        ),
        turn(18_000, 16_000, ttft_ms=3000.0, itl_ms=100.0),
        Recompute("m2"),
    ),
]


@pytest.mark.parametrize(
    ("params", "cluster", "the_turn", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_decision(
    params: Mapping[str, object], cluster: ClusterView, the_turn: Turn, expected: Decision
) -> None:
    decision = create_policy("adaptive", params).decide(the_turn, cluster)
    assert bare(decision) == expected
    assert decision.reason
    if not isinstance(decision, Reject):  # served turns are due at their TTFT objective
        assert decision.due_ms == the_turn.objectives.ttft_ms


def test_handoff_carries_its_terms_and_names_them() -> None:
    decision = create_policy("adaptive").decide(
        BUSY_TURN, view(*BUSY, links=LINKS, resident="d1", tokens=2000)
    )
    assert isinstance(decision, Handoff)
    p = decision.predicted
    # Only the 16k tokens the resident decode worker lacks cross the idle 50 GB/s link.
    assert p.exposed_transfer_ms == pytest.approx(16_000 * KV / 50e9 * 1000)
    assert p.queue_delta_ms == 0.0
    # The prefill worker computes all 18k tokens; the resident would compute 16k after 2k.
    assert p.compute_delta_ms > 0.0
    separation = p.exposed_transfer_ms + p.queue_delta_ms + p.compute_delta_ms
    assert p.interference_ms > 100 * separation
    assert p.ttft_ms <= BUSY_TURN.objectives.ttft_ms
    # In expected misses: the unchunked 16k prefill would stall each of the 64 streams past
    # its ITL objective once, one of the 255 / 100 slow gaps its budget allows (answers of
    # the prior's 256 tokens).
    avoided = 64 / 2.55
    assert decision.reason.startswith(f"handoff p1->d1: I={avoided:.2f} > H+dQ+dC=0.")
    assert decision.reason.endswith(f" misses (H={p.exposed_transfer_ms:.0f}ms, TTFT "
                                    f"{p.ttft_ms:.0f}ms)")  # fmt: skip


def test_colocate_is_its_own_reference() -> None:
    cluster = view(
        w("p1", "prefill"), w("d1", "decode", running=4), links=LINKS, resident="d1", tokens=5800
    )
    decision = create_policy("adaptive").decide(turn(6000, 200), cluster)
    assert isinstance(decision, Colocate)
    p = decision.predicted
    assert (p.exposed_transfer_ms, p.queue_delta_ms, p.compute_delta_ms) == (0.0, 0.0, 0.0)
    assert 0.0 <= p.interference_ms < 1.0
    assert 0.0 < p.ttft_ms < 50.0
    assert decision.reason.startswith("colocate on d1: I=")
    assert decision.reason.endswith("of handoff p1->d1")


def test_migration_moves_the_whole_context_from_the_source() -> None:
    # The resident is a prefill worker: it prefills the 200 new tokens after its 8000, then
    # the decode worker pulls all 8200 (the router runs a migration as such a handoff).
    cluster = view(w("p1", "prefill"), w("d2", "decode"), links=LINKS, resident="p1")
    decision = create_policy("adaptive").decide(RETURNING, cluster)
    assert isinstance(decision, Migrate)
    p = decision.predicted
    assert p.exposed_transfer_ms == pytest.approx(8200 * KV / 50e9 * 1000)
    assert p.ttft_ms < 100.0
    assert decision.reason.startswith("migrate p1->d2: I=0.00 > H+dQ+dC=")


@pytest.mark.parametrize(
    ("uncached", "expected"),
    [
        pytest.param(200, Colocate("m1"), id="fast own prefill: the answer stays with its state"),
        pytest.param(4000, Handoff("m1", "m2"), id="slow own prefill: the answer leaves it"),
    ],
)
def test_an_answer_leaves_its_state_only_beside_its_own_slow_prefill(
    uncached: int, expected: Decision
) -> None:
    # A fresh 4k prompt lands on m1 and will stall its streams. A returning session resident
    # there decodes elsewhere only when its own prefill there is slow too: prefilling on m1
    # and decoding on m2 carries its whole context over (a migration in all but name), and m1
    # is not overloaded.
    policy = create_policy("adaptive")
    workers = (w("m1", "mixed", running=8), w("m2", "mixed", running=16))
    fresh = msgspec.structs.replace(turn(4000, 4000, itl_ms=100.0), session_id="new",
                                    request_id="new")  # fmt: skip
    placed = policy.decide(fresh, view(*workers, links=mesh("m1", "m2")))
    assert bare(placed) == Colocate("m1")
    back = view(*workers, links=mesh("m1", "m2"), resident="m1", tokens=6000)
    returning = turn(6000 + uncached, uncached, itl_ms=100.0)
    assert bare(policy.decide(returning, back)) == expected


def test_reject_carries_the_best_prediction() -> None:
    decision = create_policy("adaptive").decide(
        turn(8200, 200, ttft_ms=10.0), view(*SATURATED, links=LINKS, resident="d1")
    )
    assert isinstance(decision, Reject)
    assert decision.predicted.ttft_ms > 1000.0
    assert decision.reason == (
        f"reject: best colocate on d1 predicts TTFT {decision.predicted.ttft_ms:.0f}ms > 10ms"
    )


def test_reject_when_no_decode_worker_names_the_role() -> None:
    decision = create_policy("adaptive").decide(RETURNING, view(w("p1", "prefill")))
    assert decision == Reject(
        retry_after_s=1.0,
        reason="no eligible decode worker (role decode or mixed, healthy, not draining)",
    )


@pytest.mark.parametrize(
    ("link", "params", "expected_ms"),
    [
        (None, {}, 1000 * 16_000 * KV / 12.5e9),
        (None, {"default_link_bps": 25e9}, 1000 * 16_000 * KV / 25e9),
        ({"capacity_bps": 50e9}, {}, 1000 * 16_000 * KV / 50e9),
        # Other replicas' reservations over the 1 s horizon leave 25 GB/s.
        ({"capacity_bps": 50e9, "reserved_bytes": 25 * 10**9}, {}, 1000 * 16_000 * KV / 25e9),
        (
            {
                "capacity_bps": 50e9,
                "bytes_in_flight": 10**10,
                "reserved_bytes": 15 * 10**9,
                "latency_s": 0.002,
            },
            {},
            2.0 + 1000 * 16_000 * KV / 25e9,
        ),
        (
            {"capacity_bps": 50e9, "reserved_bytes": 50 * 10**9},
            {"link_horizon_s": 2.0},
            1000 * 16_000 * KV / 25e9,
        ),
        # Saturated: a 1% floor keeps the estimate finite and very large.
        ({"capacity_bps": 50e9, "reserved_bytes": 10**12}, {}, 1000 * 16_000 * KV / 0.5e9),
        ({"capacity_bps": 0.0, "observed_bps": 20e9}, {}, 1000 * 16_000 * KV / 20e9),
        ({"capacity_bps": 0.0}, {}, 1000 * 16_000 * KV / 12.5e9),
        ({"capacity_bps": math.nan, "latency_s": math.nan}, {}, 1000 * 16_000 * KV / 12.5e9),
    ],
)
def test_exposed_transfer(
    link: dict[str, object] | None, params: Mapping[str, object], expected_ms: float
) -> None:
    links = () if link is None else (msgspec.convert({"src": "p1", "dst": "d1", **link}, LinkView),)
    cluster = view(*BUSY, links=links, resident="d1", tokens=2000)
    policy = create_policy("adaptive", params)
    assert isinstance(policy, AdaptivePolicy)
    scorer = Scorer(
        BUSY_TURN,
        cluster,
        policy.estimates,
        links={(link.src, link.dst): link for link in links},
        horizon_s=policy.params.link_horizon_s,
        default_bps=policy.params.default_link_bps,
    )
    assert scorer.transfer_ms("p1", "d1", 16_000 * KV) == pytest.approx(expected_ms)
    assert scorer.transfer_ms("p1", "d1", 0) == 0.0


@pytest.mark.parametrize(
    ("start_ms", "available_bps"),
    [
        (0.0, 25e9),  # 25 GB reserved over the 1 s horizon
        (250.0, 37.5e9),  # 12.5 GB of them still to send when this transfer starts
        (500.0, 50e9),  # the link has drained them all by then
        (5000.0, 50e9),
    ],
)
def test_reserved_bytes_drain_until_the_transfer_starts(
    start_ms: float, available_bps: float
) -> None:
    link = LinkView("p1", "d1", capacity_bps=50e9, reserved_bytes=25 * 10**9)
    cluster = view(*BUSY, links=(link,), resident="d1", tokens=2000)
    policy = create_policy("adaptive")
    assert isinstance(policy, AdaptivePolicy)
    scorer = Scorer(
        BUSY_TURN,
        cluster,
        policy.estimates,
        links={("p1", "d1"): link},
        horizon_s=policy.params.link_horizon_s,
        default_bps=policy.params.default_link_bps,
    )
    expected_ms = 1000 * 16_000 * KV / available_bps
    assert scorer.transfer_ms("p1", "d1", 16_000 * KV, start_ms) == pytest.approx(expected_ms)
    # A handoff's transfer starts when its prefill ends.
    handoff = scorer.handoff(BUSY[0], BUSY[1])
    assert handoff.sent_ms > 500.0
    assert handoff.transfer_ms == pytest.approx(1000 * 16_000 * KV / 50e9)


def test_observed_slowness_turns_colocate_into_reject() -> None:
    policy = create_policy("adaptive")
    cluster = view(w("d1", "decode"))
    short = turn(4000, 4000, ttft_ms=200.0)
    before = policy.decide(short, cluster)
    assert isinstance(before, Colocate)
    assert before.predicted.ttft_ms < 150.0
    for _ in range(60):
        policy.observe(_outcome(prefill_ms=400.0, queue_ms=0.0))
    after = policy.decide(short, cluster)
    assert isinstance(after, Reject)
    assert after.predicted.ttft_ms == pytest.approx(400.0, rel=0.1)


def test_a_slow_measured_link_stops_handoffs() -> None:
    policy = create_policy("adaptive")
    cluster = view(*BUSY, links=LINKS, resident="d1", tokens=2000)
    assert isinstance(policy.decide(BUSY_TURN, cluster), Handoff)
    for _ in range(60):  # 0.5 GB/s measured on a link that claims 50 GB/s
        policy.observe(_outcome(action="handoff", transfer_ms=2000.0, transfer_bytes=10**9))
    assert bare(policy.decide(BUSY_TURN, cluster)) == Colocate("d1")


def test_failed_outcomes_leave_decisions_alone() -> None:
    policy, reference = create_policy("adaptive"), create_policy("adaptive")
    cluster = view(w("d1", "decode"))
    short = turn(4000, 4000, ttft_ms=200.0)
    for _ in range(60):
        policy.observe(_outcome(prefill_ms=400.0, ok=False))
    assert policy.decide(short, cluster) == reference.decide(short, cluster)


BAD_PARAMS: list[tuple[Mapping[str, object], str]] = [
    ({"gpu": "b200"}, "unknown GPU preset 'b200'; known: a100-80g, cpu, h100-sxm, h200-sxm"),
    ({"model": "llama-4"}, "unknown model preset 'llama-4'; known: llama-3.1-70b, llama-3.1-8b"),
    ({"tp": "0"}, "tp must be >= 1, got 0"),
    ({"chunked_prefill": "0"}, "chunked_prefill must be >= 1, got 0"),
    ({"on_infeasible": "maybe"}, "parameter 'on_infeasible': Invalid enum value 'maybe'"),
    ({"retry_after_s": "-1"}, "retry_after_s must be a finite number >= 0, got -1.0"),
    ({"retry_after_s": "nan"}, "retry_after_s must be a finite number >= 0, got nan"),
    ({"migrate_queue_threshold": "0"}, "migrate_queue_threshold must be >= 1, got 0"),
    ({"migrate_kv_usage": "0"}, "migrate_kv_usage must be in (0, 1], got 0.0"),
    ({"migrate_kv_usage": "1.5"}, "migrate_kv_usage must be in (0, 1], got 1.5"),
    ({"link_horizon_s": "0"}, "link_horizon_s must be a finite number > 0, got 0.0"),
    ({"default_link_bps": "inf"}, "default_link_bps must be a finite number > 0, got inf"),
    ({"shortlist": "0"}, "shortlist must be >= 1, got 0"),
    ({"learning_rate": "0"}, "learning_rate must be in (0, 1], got 0.0"),
    ({"stall_window_s": "0"}, "stall_window_s must be a finite number > 0, got 0.0"),
    ({"stall_window_s": "inf"}, "stall_window_s must be a finite number > 0, got inf"),
    ({"cache_window_s": "0"}, "cache_window_s must be a finite number > 0, got 0.0"),
    ({"cache_window_s": "nan"}, "cache_window_s must be a finite number > 0, got nan"),
    ({"threshold": "10"}, "unknown parameter 'threshold'"),
]


@pytest.mark.parametrize(("params", "message"), BAD_PARAMS, ids=[m for _, m in BAD_PARAMS])
def test_invalid_params(params: Mapping[str, object], message: str) -> None:
    with pytest.raises(PolicyConfigError) as raised:
        create_policy("adaptive", params)
    assert message in str(raised.value)


def test_params_direct_construction_validates() -> None:
    with pytest.raises(PolicyConfigError, match="unknown GPU preset 'b200'"):
        AdaptiveParams(gpu="b200")


def test_registered_and_built_from_strings() -> None:
    assert "adaptive" in available_policies()
    policy = create_policy(
        "adaptive",
        {"on_infeasible": "serve", "chunked_prefill": "512", "tp": "2", "gpu": "a100-80g"},
    )
    assert isinstance(policy, AdaptivePolicy)
    assert policy.name == "adaptive"
    assert policy.params == AdaptiveParams(
        on_infeasible="serve", chunked_prefill=512, tp=2, gpu="a100-80g"
    )
    assert policy.estimates.chunk_tokens == 512
    assert AdaptivePolicy().params == AdaptiveParams()


def _outcome(action: str = "colocate", **changes: object) -> Outcome:
    base = Outcome(
        request_id="r",
        session_id="s",
        action="colocate",
        prefill_worker="p1" if action == "handoff" else "d1",
        decode_worker="d1",
        prompt_tokens=4000,
        cached_tokens=0,
        completion_tokens=64,
        ok=True,
    )
    return msgspec.structs.replace(base, action=action, **changes)
