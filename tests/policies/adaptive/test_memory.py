"""What `adaptive` remembers of its own placements: the prefill work it placed per worker
(`WorkLedger`), where a session's last split turn was prefilled (its prefix cache), what a
placed prefill leg was assumed to find; and KV crowding."""

from __future__ import annotations

import random

import msgspec
import pytest

from policies import (
    ClusterView,
    Handoff,
    Objectives,
    Outcome,
    Residency,
    Turn,
    create_policy,
)
from policies.adaptive import tuning
from policies.adaptive.ledgers.legs import kv_crowding
from policies.adaptive.ledgers.work import WorkLedger
from policies.adaptive.policy import AdaptivePolicy
from policies.adaptive.scoring import Scorer
from policies.adaptive.tuning import KV_CROWDED_FROM, KV_FULL_MISSES
from policies.costmodel.estimates import Estimates, PrefillLeg
from policies.testing.views import KV, w


def turn(prompt: int, uncached: int, request: str, session: str = "s") -> Turn:
    return Turn(
        session_id=session, request_id=request, prompt_tokens=prompt, uncached_tokens=uncached,
        max_tokens=256, objectives=Objectives(ttft_ms=1000.0 + 0.2 * prompt, itl_ms=100.0),
        arrival_s=10.0,
    )  # fmt: skip


def test_work_ledger_queues_placed_work_and_leaves_the_asking_request_out() -> None:
    ledger = WorkLedger()
    assert ledger.backlog_ms("m1", 10.0) == 0.0
    ledger.place("r1", "m1", 10.0, 300.0)
    ledger.place("r2", "m1", 10.1, 200.0)  # behind r1: busy until 10.5
    assert ledger.backlog_ms("m1", 10.1) == pytest.approx(400.0)
    assert ledger.backlog_ms("m1", 10.1, exclude="r2") == pytest.approx(200.0)
    assert ledger.backlog_ms("m1", 11.0) == 0.0  # all done by then
    # Placing a request again replaces its work, exactly.
    before = ledger.backlog_ms("m1", 10.1)
    ledger.place("r2", "m1", 10.1, 200.0)
    assert ledger.backlog_ms("m1", 10.1) == before
    ledger.place("r2", "m2", 10.1, 200.0)
    assert ledger.backlog_ms("m1", 10.1) == pytest.approx(200.0)
    assert ledger.backlog_ms("m2", 10.1) == pytest.approx(200.0)
    # A finished request's work, and what was ahead of it, is done.
    ledger.finish("r1", 10.1)
    assert ledger.backlog_ms("m1", 10.1) == pytest.approx(0.0, abs=1e-9)
    ledger.finish("unknown", 10.1)


def test_a_handoffs_prefill_worker_keeps_the_sessions_prompt_cached() -> None:
    policy = create_policy("adaptive", {})
    assert isinstance(policy, AdaptivePolicy)
    # d1 decodes 40 streams: the 8k prompt is prefilled on p1 and handed off to d1.
    workers = (w("p1", "prefill"), w("p2", "prefill"), w("d1", "decode", running=40))
    first = policy.decide(turn(8000, 8000, "r1"), ClusterView(now_s=10.0, workers=workers))
    assert isinstance(first, Handoff)
    assert first.prefill_worker == "p1"
    # The next turn resends those 8000 tokens (and the answer, and 3488 new ones): p1 still
    # holds the 8000, so it prefills 3744 where p2 would prefill all 11744.
    residency = Residency(worker_id="d1", tokens=8256, bytes=8256 * KV, epoch=1)
    nxt = turn(11744, 3488, "r2")
    cluster = ClusterView(now_s=20.0, workers=workers, residency=residency)
    scorer = Scorer(nxt, cluster, policy.estimates, links={}, horizon_s=1.0,
                    default_bps=12.5e9, prefix=("p1", 8000))  # fmt: skip
    cached, cold = scorer.handoff(workers[0], workers[2]), scorer.handoff(workers[1], workers[2])
    assert cached.leg == PrefillLeg(8000, 0, queued=0.0)
    assert cold.leg == PrefillLeg(0, 0, queued=0.0)
    assert cached.compute_ms < cold.compute_ms / 2
    second = policy.decide(nxt, cluster)
    assert isinstance(second, Handoff)
    assert (second.prefill_worker, second.decode_worker) == ("p1", "d1")
    # Deciding it again sees what it saw the first time.
    assert policy.decide(nxt, cluster) == second


def test_a_split_turns_decode_leg_cache_hit_does_not_teach_its_prefill() -> None:
    # The outcome counts the pulled KV as cached (prompt - 1); the prefill leg computed it all.
    outcome = Outcome(
        request_id="r", session_id="s", action="handoff", prefill_worker="p1",
        decode_worker="d1", prompt_tokens=8000, cached_tokens=7999, completion_tokens=64,
        ok=True, queue_ms=0.0, prefill_ms=0.0,
    )  # fmt: skip
    told, naive = Estimates.from_presets(), Estimates.from_presets()
    outcome = msgspec.structs.replace(outcome, prefill_ms=told.prefill_ms(8000))
    for _ in range(50):
        told.observe(outcome, PrefillLeg(cached=0, beside=0))
        naive.observe(outcome)
    # Told what the leg found, the stage is all prefill: no queue wait is learned.
    assert told.queue_wait_ms(0) == pytest.approx(0.0, abs=1.0)
    assert told.prefill_ms(8000) == pytest.approx(naive.prefill_ms(8000, 0), rel=1.0)
    # Not told, it takes the leg for a 1-token prefill after 7999 cached ones, and learns a
    # roof or a queue wait that makes such a prefill take the whole stage.
    told_short = told.prefill_ms(1, 7999) + told.queue_wait_ms(0)
    naive_short = naive.prefill_ms(1, 7999) + naive.queue_wait_ms(0)
    assert naive_short > 10 * told_short


@pytest.mark.parametrize(
    ("usage", "running", "inflight", "streams", "misses"),
    [
        (0.5, 10, 10, 1.0, 0.0),
        (KV_CROWDED_FROM, 0, 0, 1.0, 0.0),
        (0.8, 80, 80, 1.0, KV_FULL_MISSES * (0.81 - KV_CROWDED_FROM) / (1 - KV_CROWDED_FROM)),
        # The streams the router sent there that the scrape has not counted yet take room.
        (0.8, 40, 49, 1.0, KV_FULL_MISSES),
        # A turn whose context is cached there adds a fraction of a stream.
        (0.8, 80, 80, 0.0, KV_FULL_MISSES * (0.8 - KV_CROWDED_FROM) / (1 - KV_CROWDED_FROM)),
        (0.99, 50, 50, 1.0, KV_FULL_MISSES),
    ],
)
def test_kv_crowding(
    usage: float, running: int, inflight: int, streams: float, misses: float
) -> None:
    worker = w("m1", kv_usage=usage, running=running, inflight=inflight)
    assert kv_crowding(worker, streams) == pytest.approx(misses)


class _FullScan:
    """A `WorkLedger` whose `settle` scans every recent placement, stale ones included (the
    ledger compiles with the policy: a wrapper, not a subclass)."""

    def __init__(self) -> None:
        self.ledger = WorkLedger()

    def place(self, request_id: str, worker: str | None, at_s: float, work_ms: float) -> None:
        self.ledger.place(request_id, worker, at_s, work_ms)

    def finish(self, request_id: str, now_s: float) -> None:
        self.ledger.finish(request_id, now_s)

    def backlog_ms(self, worker: str, now_s: float) -> float:
        return self.ledger.backlog_ms(worker, now_s)

    def settle(self, worker: str, scraped_s: float, queued: int) -> None:
        ledger = self.ledger
        busy, recent = ledger._busy.get(worker), ledger._recent.get(worker)
        if busy is None or recent is None:
            return
        since: list[tuple[float, float]] = []
        bound = scraped_s
        for at_s, request_id in reversed(recent):
            entry = ledger._entries.get(request_id)
            if entry is None or entry[0] != worker or entry[3] != at_s:
                continue
            if at_s >= scraped_s:
                since.append((at_s, entry[4]))
            elif queued > 0:
                queued -= 1
                bound += entry[4]
            else:
                bound += max(at_s + entry[4] - scraped_s, 0.0)
                break
        for at_s, work_s in reversed(since):
            bound = max(bound, at_s) + work_s
        if busy > bound:
            ledger._busy[worker] = bound


@pytest.mark.parametrize("seed", range(20))
def test_settle_skips_only_stale_placements(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Placed again (at the same time too), finished, forgotten or fallen out of the recent
    ones: settle stops where a scan of them all finds nothing current any more."""
    monkeypatch.setattr(tuning, "MAX_RECENT", 8)
    monkeypatch.setattr(tuning, "MAX_TRACKED_REQUESTS", 24)
    rng = random.Random(seed)
    ledger, reference = WorkLedger(), _FullScan()
    workers = ("m1", "m2", "m3")
    for _ in range(400):
        request = f"r{rng.randrange(40)}"
        at_s = rng.randrange(20) / 10.0
        match rng.randrange(3):
            case 0:
                worker = rng.choice((*workers, None))
                work_ms = rng.choice((0.0, 50.0, 300.0))
                for one in (ledger, reference):
                    one.place(request, worker, at_s, work_ms)
            case 1:
                for one in (ledger, reference):
                    one.finish(request, at_s)
            case _:
                worker, queued = rng.choice(workers), rng.randrange(4)
                for one in (ledger, reference):
                    one.settle(worker, at_s, queued)
        assert [ledger.backlog_ms(m, 0.0) for m in workers] == [
            reference.backlog_ms(m, 0.0) for m in workers
        ]
