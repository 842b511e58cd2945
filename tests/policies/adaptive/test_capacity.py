"""What `adaptive` knows of a worker's capacity beyond its last scrape: the work placed there
settled by the scrapes (`WorkLedger.settle`) and its recent share of the worker's time
(`WorkLedger.utilisation`), the engine's sequence cap (`slot_wait_ms`), the streams the
router has placed since the scrape (`Scorer.streams`), steps predicted near the ITL
objective, and the workers that host slow prefills."""

from __future__ import annotations

import pytest

from policies import (
    ClusterView,
    Colocate,
    Handoff,
    Objectives,
    Reject,
    Residency,
    Turn,
    create_policy,
)
from policies.adaptive.candidates import Candidate
from policies.adaptive.ledgers.legs import slot_wait_ms
from policies.adaptive.ledgers.work import WorkLedger
from policies.adaptive.policy import AdaptivePolicy
from policies.adaptive.ranking import rank_key
from policies.adaptive.scoring import Scorer
from policies.costmodel.calibration import queue_ahead
from policies.costmodel.estimates import Estimates, PrefillLeg
from policies.testing.views import w
from policies.types import Action, WorkerView


def turn(prompt: int, request: str = "r1", itl_ms: float = 100.0, tokens: int = 512) -> Turn:
    return Turn(
        session_id=f"s-{request}", request_id=request, prompt_tokens=prompt,
        uncached_tokens=prompt, max_tokens=tokens, arrival_s=10.0,
        objectives=Objectives(ttft_ms=1000.0 + 0.2 * prompt, itl_ms=itl_ms),
    )  # fmt: skip


def scorer(
    t: Turn, workers: tuple[WorkerView, ...], estimates: Estimates | None = None, cap: int = 256
) -> Scorer:
    cluster = ClusterView(now_s=10.0, workers=workers)
    est = estimates if estimates is not None else Estimates.from_presets()
    return Scorer(t, cluster, est, links={}, horizon_s=1.0, default_bps=12.5e9, max_seqs=cap)


# (scraped at, requests queued at the scrape, backlog expected at 9.97 s in ms)
SETTLED = [
    (9.0, 0, 60.0),  # a scrape before the placements bounds nothing
    (9.95, 0, 20.0),  # nothing queued then: only the work placed since counts
    (9.95, 1, 60.0),  # the last one placed before it still queued: it runs first
    (9.97, 0, 20.0),  # all placed before it and not queued; the latest may still run
]


@pytest.mark.parametrize(("scraped", "queued", "backlog"), SETTLED)
def test_settle_bounds_the_placed_work_by_what_a_scrape_saw(
    scraped: float, queued: int, backlog: float
) -> None:
    ledger = WorkLedger()
    # A cold prior: 400 ms predicted for a turn that took far less; then two more.
    ledger.place("r1", "m1", 9.5, 400.0)
    ledger.place("r2", "m1", 9.8, 50.0)
    ledger.place("r2", "m1", 9.8, 100.0)  # decided again: replaced
    ledger.place("r3", "m1", 9.96, 30.0)
    assert ledger.backlog_ms("m1", 9.97) == pytest.approx(60.0, abs=1e-6)
    ledger.settle("m1", scraped, queued)
    assert ledger.backlog_ms("m1", 9.97) == pytest.approx(backlog, abs=1e-6)
    # Settling never adds work, and a finished request still takes its work back.
    ledger.settle("m1", scraped, 1000)
    assert ledger.backlog_ms("m1", 9.97) == pytest.approx(backlog, abs=1e-6)
    ledger.finish("r3", 9.97)
    assert ledger.backlog_ms("m1", 9.97) == pytest.approx(0.0, abs=1e-6)


# (scraped at, queued at the scrape, requests ahead this policy placed, their weight)
QUEUED = [
    (9.45, 0, 1, 3.0),  # placed since the scrape: r4 (r3 went to another worker)
    (9.45, 1, 2, 5.0),  # and the last one placed before it, still queued: r2
    (9.45, 2, 3, 5.5),  # and r1
    (9.45, 9, 3, 5.5),  # more queued than it placed there: the rest are others'
    (9.05, 0, 2, 5.0),  # r2 and r4 placed since (r1 before: running or done)
    (9.6, 0, 0, 0.0),  # all seen, none queued
]


@pytest.mark.parametrize(("scraped", "waiting", "count", "weight"), QUEUED)
def test_queued_counts_its_requests_a_scrape_leaves_ahead_by_weight(
    scraped: float, waiting: int, count: int, weight: float
) -> None:
    ledger = WorkLedger()
    ledger.place("r1", "m1", 9.0, 100.0, 0.5)
    ledger.place("r2", "m1", 9.1, 100.0, 1.0)
    ledger.place("r2", "m1", 9.2, 100.0, 2.0)  # decided again: replaced
    ledger.place("r2", "m1", 9.2, 100.0, 2.0)  # and again, at the same time
    ledger.place("r3", "m1", 9.3, 100.0, 7.0)
    ledger.place("r3", "m2", 9.4, 100.0, 7.0)  # decided again, elsewhere: it moves
    ledger.place("r4", "m1", 9.5, 100.0, 3.0)
    ledger.place("r5", None, 9.5, 0.0)  # rejected: nothing placed
    assert ledger.queued("m1", scraped, waiting) == (count, pytest.approx(weight))
    if count:  # the asking request's own is left out
        assert ledger.queued("m1", scraped, waiting, exclude="r4") == (
            count - 1, pytest.approx(weight - 3.0)
        )  # fmt: skip
    ledger.finish("r4", 9.7)
    ledger.finish("r2", 9.7)
    ledger.finish("r2", 9.7)  # twice: nothing more to take back
    assert ledger.queued("m1", 9.5, 0) == (0, 0.0)
    assert ledger.queued("m1", 9.5, 1) == (1, pytest.approx(0.5))
    assert ledger.queued("m1", 9.0, 0) == (1, pytest.approx(0.5))  # placed as it scraped
    assert ledger.queued("m9", 8.0, 0) == (0, 0.0)


# The scrape saw `running` and `waiting`; the fleet has `inflight` requests there, of which
# `started` began answering since that scrape (a first token out, or a decode leg bringing
# its KV): those queue no prefill, whether the scrape counted them waiting or not at all.
QUEUE_AHEAD = [
    (4, 0, 4, 0, 0),  # nothing queued
    (4, 2, 6, 0, 2),  # the scrape's queue
    (4, 0, 5, 0, 1),  # sent since the scrape, not answering yet
    (4, 0, 5, 1, 0),  # sent since the scrape, answering already
    (4, 2, 6, 2, 0),  # both queued at the scrape answer now
    (4, 2, 7, 1, 2),  # one of three answers
    (2, 0, 1, 1, 0),  # the scrape is older than some that ended: never below none
]


@pytest.mark.parametrize(("running", "waiting", "inflight", "started", "depth"), QUEUE_AHEAD)
def test_the_queue_leaves_out_what_answers_since_the_scrape(
    running: int, waiting: int, inflight: int, started: int, depth: int
) -> None:
    worker = w("m1", running=running, waiting=waiting, inflight=inflight,
               started_since_scrape=started)  # fmt: skip
    assert queue_ahead(worker) == depth
    # A short turn sent there waits for what is queued, no more.
    estimates = Estimates.from_presets()
    terms = scorer(turn(64), (worker,), estimates)
    assert terms.queue_ms(worker) == pytest.approx(estimates.queue_wait_ms(depth))


# The worker's scrape saw `waiting` queued, and the fleet has `unseen` requests in flight
# there it has not counted; this policy placed `own` of them (the latest), each a prefill
# of `weight` typical ones. The others count one typical prefill each.
AHEAD = [
    (0, 1, 1, 0.1, 0.1),  # a short prompt placed since the scrape
    (0, 3, 3, 0.1, 0.3),
    (0, 3, 1, 4.0, 6.0),  # a long one, and two others'
    (2, 0, 2, 0.5, 1.0),  # its own, seen queued
    (3, 0, 1, 0.5, 2.5),
    (0, 2, 4, 0.5, 1.0),  # more placed than the count holds: the scrape is stale
    (0, 0, 2, 0.5, 0.0),  # nothing queued
]


@pytest.mark.parametrize(("waiting", "unseen", "own", "weight", "ahead"), AHEAD)
def test_the_queue_counts_its_own_requests_by_their_prefills(
    waiting: int, unseen: int, own: int, weight: float, ahead: float
) -> None:
    """The learned wait per queued request averages the workload's prefills (long ones
    included); the requests this policy placed count by their own predicted prefills."""
    estimates = Estimates.from_presets()
    work = WorkLedger()
    for i in range(own):
        work.place(f"q{i}", "m1", 9.99, 10.0, weight)
    worker = w("m1", running=4, waiting=waiting, inflight=4 + waiting + unseen,
               scraped_age_s=0.5)  # fmt: skip
    t = turn(64)
    terms = Scorer(
        t, ClusterView(now_s=10.0, workers=(worker,)), estimates, links={}, horizon_s=1.0,
        default_bps=12.5e9, max_seqs=256, work=work,
    )  # fmt: skip
    backlog = work.backlog_ms("m1", 10.0)
    expected = max(estimates.queue_wait_ms(ahead), backlog)
    assert terms.queue_ms(worker) == pytest.approx(expected)
    # Without its ledger every request queued there waits the learned average.
    alone = scorer(t, (worker,), estimates)
    assert alone.queue_ms(worker) == pytest.approx(estimates.queue_wait_ms(queue_ahead(worker)))


def test_a_placed_prefill_weighs_against_the_mean_placed() -> None:
    policy = AdaptivePolicy()
    weights = [policy._weigh(ms) for ms in (100.0, 100.0, 10.0, 400.0)]
    assert weights[:3] == pytest.approx([1.0, 1.0, 0.1])
    assert weights[3] == pytest.approx(400.0 / 70.0)  # the mean of those placed before


def test_utilisation_is_the_recent_share_of_time_placed_work_takes() -> None:
    ledger = WorkLedger(window_s=1.0)
    for i in range(100):  # 200 ms of work a second for 10 s
        ledger.place(f"r{i}", "m1", i / 10.0, 20.0)
    busy = ledger.utilisation("m1", 9.9)
    assert 0.15 < busy < 0.25
    assert ledger.utilisation("m1", 9.9, exclude="r99") < busy  # its own left out
    assert ledger.utilisation("m1", 20.0) < 0.001  # decays
    assert ledger.utilisation("m2", 9.9) == 0.0
    ledger.place("r99", None, 9.9, 0.0)  # rejected on a second decision: taken back
    assert ledger.utilisation("m1", 9.9) == pytest.approx(ledger.utilisation("m1", 9.9, "r99"))


# (running, waiting, inflight, slots the turn waits for)
SLOTS = [(100, 0, 100, 0), (255, 0, 255, 0), (256, 0, 256, 1), (256, 9, 256, 10), (250, 0, 266, 11)]


@pytest.mark.parametrize(("running", "waiting", "inflight", "past"), SLOTS)
def test_a_turn_past_the_sequence_cap_waits_for_streams_to_finish(
    running: int, waiting: int, inflight: int, past: int
) -> None:
    estimates = Estimates.from_presets()
    worker = w("m1", running=running, waiting=waiting, inflight=inflight)
    wait = slot_wait_ms(worker, 256, estimates)
    step = estimates.decode_step_ms(running, estimates.mean_context_tokens, "m1")
    assert wait == pytest.approx(past * estimates.mean_completion_tokens * step / running)
    assert slot_wait_ms(worker, 0, estimates) == 0.0  # no cap known
    # The wait is a queue: a turn's TTFT there carries it.
    t = turn(512)
    assert scorer(t, (worker,)).whole(worker).queue_ms >= wait


# (running, waiting, inflight, cap, streams)
STREAMS = [
    (40, 0, 40, 256, 40),  # the scrape is current
    (40, 0, 90, 256, 90),  # 50 placed since
    (40, 30, 90, 256, 60),  # of which the scrape saw 30 queued
    (250, 0, 300, 256, 256),  # at most the engine's cap
]


@pytest.mark.parametrize(("running", "waiting", "inflight", "cap", "streams"), STREAMS)
def test_streams_count_what_the_router_placed_since_the_scrape(
    running: int, waiting: int, inflight: int, cap: int, streams: int
) -> None:
    worker = w("m1", running=running, waiting=waiting, inflight=inflight)
    assert scorer(turn(512), (worker,), cap=cap).streams(worker) == streams


def test_a_burst_within_one_scrape_spreads_over_the_workers() -> None:
    policy = create_policy("adaptive", {})
    assert isinstance(policy, AdaptivePolicy)
    scraped = [w(f"m{i}", running=100, inflight=100, scraped_age_s=0.1) for i in range(4)]
    placed: dict[str, int] = {}
    for i in range(8):
        # The scrape is the same for the whole burst; the router's counts are current.
        workers = tuple(
            w(x.worker_id, running=100, inflight=100 + placed.get(x.worker_id, 0),
              scraped_age_s=0.1)
            for x in scraped
        )  # fmt: skip
        decision = policy.decide(turn(2560, f"r{i}"), ClusterView(now_s=10.0, workers=workers))
        assert isinstance(decision, Colocate)
        placed[decision.worker] = placed.get(decision.worker, 0) + 1
    assert sorted(placed.values()) == [2, 2, 2, 2]


# prefill tokens beside 200 streams: the step it predicts over the ITL objective, and whether
# a prefill worker that runs no streams should take it instead.
NEAR = [(512, False), (3000, True)]


@pytest.mark.parametrize(("prompt", "separated"), NEAR)
def test_a_step_predicted_just_under_the_objective_still_counts_as_slow(
    prompt: int, separated: bool
) -> None:
    estimates = Estimates.from_presets()
    itl = 0.9 * estimates.prefill_ms(3000, 0, "d1", 200)  # 3000 tokens: 90% of the ITL
    busy, idle = w("d1", "decode", running=200, inflight=200), w("p1", "prefill")
    t = turn(prompt, itl_ms=itl)
    whole = scorer(t, (busy, idle), estimates).whole(busy)
    assert (whole.harm > 1.0) is separated
    assert (whole.harm == 0.0) is not separated
    policy = create_policy("adaptive", {})
    decision = policy.decide(t, ClusterView(now_s=10.0, workers=(busy, idle)))
    assert isinstance(decision, Handoff if separated else Colocate)


# (slow prefills placed lately on each of the other workers, whether the long prompt is
# handed off to one of them rather than prefilled and decoded on the empty worker)
HOSTS = [(0, False), (6, True)]


@pytest.mark.parametrize(("placed", "separated"), HOSTS)
def test_a_slow_prefill_makes_its_worker_a_host_of_slow_steps(placed: int, separated: bool) -> None:
    policy = create_policy("adaptive", {})
    assert isinstance(policy, AdaptivePolicy)
    for i in range(placed):  # long prompts prefilled on the busy workers, stalls recorded
        policy._stalls.place(f"old{i}", f"h{i % 2}", 9.5, 1)
    # Two workers hosting long prefills (no streams left), one empty: a long prompt
    # prefilled on the empty one makes it a host too, so its answer meets their stalls.
    workers = (w("h0"), w("h1"), w("e0"))
    t = turn(12000, tokens=512)
    decision = policy.decide(t, ClusterView(now_s=10.0, workers=workers))
    if separated:
        assert isinstance(decision, Handoff)
        assert decision.decode_worker == "e0"
        assert decision.prefill_worker in ("h0", "h1")
    else:
        assert isinstance(decision, Colocate)


# (exposure of the candidate that meets the TTFT objective, which one ranks first)
OWN_ITL = [(0.5, "meets"), (0.99, "meets"), (1.0, "late"), (3.0, "late")]


@pytest.mark.parametrize(("exposure", "first"), OWN_ITL)
def test_a_turn_sure_to_miss_its_itl_objective_does_not_meet_its_objectives(
    exposure: float, first: str
) -> None:
    def candidate(ttft_ms: float, exposure: float) -> Candidate:
        return Candidate(
            "colocate", ("m1",), 2000.0, queue_ms=ttft_ms - 100.0, compute_ms=100.0,
            own_wait_ms=0.0, harm_ms=0.0, harm=0.0, exposure=exposure, slow_steps=0,
            leg=PrefillLeg(0, 0), work_ms=100.0,
        )  # fmt: skip

    # TTFT just within the objective, decoding amid slow steps; or 1% late, decoding calmly.
    meets, late = candidate(1990.0, exposure), candidate(2020.0, 0.0)
    key = rank_key(_turn_with_ttft(2000.0))
    assert min((meets, late), key=key) is (meets if first == "meets" else late)


def _turn_with_ttft(ttft_ms: float) -> Turn:
    return Turn(
        session_id="s", request_id="r", prompt_tokens=6000, uncached_tokens=6000,
        max_tokens=512, arrival_s=10.0, objectives=Objectives(ttft_ms=ttft_ms, itl_ms=100.0),
    )  # fmt: skip


# (expected misses a candidate meeting its own TTFT objective costs the streams beside its
# prefill, those the colocated reference, late, costs them, which one ranks first)
OTHERS_HARM = [
    (0.0, 0.0, "meets"),
    (0.9, 0.0, "meets"),
    (1.5, 0.0, "late"),
    (24.0, 0.0, "late"),
    (24.0, 23.5, "meets"),  # within one miss of what colocating costs them
]


@pytest.mark.parametrize(("harm", "usual", "first"), OTHERS_HARM)
def test_a_turn_on_time_at_a_miss_more_of_the_others_does_not_meet_its_objectives(
    harm: float, usual: float, first: str
) -> None:
    def candidate(action: Action, ttft_ms: float, harm: float) -> Candidate:
        return Candidate(
            action, ("m1",), 2000.0, queue_ms=ttft_ms - 100.0, compute_ms=100.0,
            own_wait_ms=0.0, harm_ms=0.0, harm=harm, exposure=0.0, slow_steps=0,
            leg=PrefillLeg(0, 0), work_ms=100.0,
        )  # fmt: skip

    # Recomputed on another worker in time at that harm, or colocated late where it lives.
    meets, late = candidate("recompute", 1000.0, harm), candidate("colocate", 2500.0, usual)
    key = rank_key(_turn_with_ttft(2000.0), late)
    assert min((meets, late), key=key) is (meets if first == "meets" else late)
    # Without a reference harm (a new session's reference is being chosen) no gate applies.
    assert min((meets, late), key=rank_key(_turn_with_ttft(2000.0))) is meets


def test_a_decode_leg_waits_for_room_on_a_full_worker_even_behind_a_long_prefill_queue() -> None:
    # The decode worker is at its sequence cap with turns queued: it stays full while turns
    # keep coming, so the wait for a slot there does not drain while the prefill waits.
    prefill = w("m1", running=100, waiting=30, inflight=130)
    full = w("m2", running=256, waiting=20, inflight=276, kv_usage=0.5)
    t = turn(512)
    score = scorer(t, (prefill, full))
    handoff = score.handoff(prefill, full)
    slot = slot_wait_ms(full, 256, Estimates.from_presets(), score._streams_of("m2"))
    assert slot > 0.0
    assert handoff.queue_ms == pytest.approx(score.queue_ms(prefill) + slot)
    # A decode worker with room adds no wait of its own behind that queue.
    roomy = w("m3", running=100, inflight=100, kv_usage=0.3)
    calm = scorer(t, (prefill, roomy))
    assert calm.handoff(prefill, roomy).queue_ms == pytest.approx(calm.queue_ms(prefill))


def test_a_full_resident_is_not_escaped_by_a_recompute_that_stalls_many_streams() -> None:
    # The resident is at its sequence cap with turns queued: colocated, the turn misses its
    # TTFT objective. Recomputed on the other worker it would meet it, but its whole context
    # prefilled there makes a step past the ITL objective for the 200 streams running there:
    # more misses than the one turn saved. Nothing else meets the objective: rejected.
    policy = create_policy("adaptive", {})
    resident = w("m1", running=256, waiting=40, inflight=296, kv_usage=0.6)
    other = w("m2", running=200, inflight=200, kv_usage=0.5)
    t = Turn(
        session_id="s", request_id="r", prompt_tokens=3584, uncached_tokens=512,
        max_tokens=512, arrival_s=10.0, objectives=Objectives(ttft_ms=1717.0, itl_ms=100.0),
    )  # fmt: skip
    view = ClusterView(
        now_s=10.0, workers=(resident, other), residency=Residency("m1", 3072, 3072 * 131072, 1)
    )
    decision = policy.decide(t, view)
    assert isinstance(decision, Reject), decision
