"""Deadline order: adaptive's decisions say when each turn is due, and on a worker that admits
the earliest due first a turn passes the queued work due after it."""

from __future__ import annotations

import msgspec
import pytest

from policies import ClusterView, Objectives, Reject, Residency, Turn, create_policy
from policies.adaptive.ledgers.work import WorkLedger
from policies.testing.views import KV, w

# (placed at, work ms, due at) on m1, each placed behind the one before
PLACED = [(10.0, 400.0, 70.0), (10.0, 400.0, 11.0), (10.0, 400.0, 70.0)]


@pytest.mark.parametrize(
    ("now", "due", "share"),
    [
        (10.0, 12.0, 2 / 3),  # the running one, and the one due at 11 s
        (10.0, 10.5, 1 / 3),  # due before all queued: only the running one is ahead
        (10.0, 80.0, 1.0),  # due after all of them
        (10.2, 10.5, 0.2 / 1.0),  # 200 ms of the running one left, of 1 s left in all
        (11.3, 10.5, 1.0),  # nothing left but the last, which has started
    ],
)
def test_the_share_of_placed_work_run_before_a_turn_due_then(
    now: float, due: float, share: float
) -> None:
    ledger = WorkLedger()
    for i, (at, work, due_at) in enumerate(PLACED):
        ledger.place(f"r{i}", "m1", at, work, due_s=due_at)
    assert ledger.due_share("m1", now, due) == pytest.approx(share)
    assert ledger.due_share("m2", now, due) == 1.0  # nothing placed there


def _turn(request: str, prompt: int, ttft_ms: float) -> Turn:
    return Turn(session_id=request, request_id=request, prompt_tokens=prompt,
                uncached_tokens=prompt, max_tokens=64, arrival_s=10.0,
                objectives=Objectives(ttft_ms=ttft_ms, itl_ms=100.0))  # fmt: skip


@pytest.mark.parametrize(("by_priority", "rejected"), [(False, True), (True, False)])
def test_an_urgent_turn_passes_the_queued_work_due_later(by_priority: bool, rejected: bool) -> None:
    """Twelve 8000-token prompts due in a minute queue on the one worker (~3 s of prefills);
    a 2000-token prompt due in a second waits behind all of them first come, first served
    (rejected), but only behind the one already running where the worker admits the
    earliest due first (served: its FIFO prediction, the reason's, still misses)."""
    policy = create_policy("adaptive")
    cluster = ClusterView(now_s=10.0, workers=(w("d1", "decode", priority_scheduling=by_priority),))
    for i in range(12):
        queued = policy.decide(_turn(f"bulk{i}", 8000, 60_000.0), cluster)
        assert not isinstance(queued, Reject) and queued.due_ms == 60_000.0
    urgent = policy.decide(_turn("urgent", 2000, 1000.0), cluster)
    assert isinstance(urgent, Reject) is rejected
    if not rejected:
        assert urgent.due_ms == 1000.0
        assert urgent.reason.startswith("best effort")


@pytest.mark.parametrize(
    ("cached", "due"),
    [
        (12_000, 1800.0),  # 4500 new tokens where its context is: as a fresh turn
        (0, 3600.0),  # all 16500 to prefill: its objective, capped at twice a fresh one's
    ],
    ids=["light", "heavy"],
)
def test_a_returning_turn_light_where_it_prefills_is_due_as_a_fresh_one(
    cached: int, due: float
) -> None:
    """Fresh 4000-token prompts are due in 1.8 s. A session's fourth turn, 16500 tokens due in
    4.3 s, waits behind none of them where its context is cached: it prefills little more
    than they do, and a wait behind them would let their prefills evict that context."""
    policy = create_policy("adaptive")
    cluster = ClusterView(now_s=10.0, workers=(w("d1"), w("d2")))
    for i in range(4):
        fresh = policy.decide(_turn(f"fresh{i}", 4000, 1800.0), cluster)
        assert not isinstance(fresh, Reject) and fresh.due_ms == 1800.0
    resident = Residency(worker_id="d1", tokens=cached, bytes=cached * KV, epoch=1, turns=3)
    returning = Turn(session_id="long", request_id="long-t3", prompt_tokens=16_500,
                     uncached_tokens=16_500 - cached, max_tokens=64, arrival_s=10.0,
                     objectives=Objectives(ttft_ms=4300.0, itl_ms=100.0))  # fmt: skip
    view = msgspec.structs.replace(cluster, residency=resident)
    decision = policy.decide(returning, view)
    assert not isinstance(decision, Reject) and decision.due_ms == due
