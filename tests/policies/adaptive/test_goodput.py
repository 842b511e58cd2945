"""The goodput terms of `adaptive`: slow-gap budgets, the stall ledger, exposure, the price
of GPU time, KV headroom and the shared prefix."""

from __future__ import annotations

import math

import msgspec
import pytest

from policies import (
    ClusterView,
    Colocate,
    Handoff,
    Objectives,
    Outcome,
    Recompute,
    Residency,
    Turn,
    WorkerView,
    create_policy,
)
from policies.adaptive.ledgers.work import WorkLedger
from policies.adaptive.policy import AdaptivePolicy
from policies.adaptive.scoring import Scorer, StallLedger, slow_gap_budget
from policies.testing.views import KV, w


def turn(
    prompt: int, uncached: int | None = None, request: str = "r1", max_tokens: int = 512
) -> Turn:
    return Turn(
        session_id=f"s-{request}",
        request_id=request,
        prompt_tokens=prompt,
        uncached_tokens=prompt if uncached is None else uncached,
        max_tokens=max_tokens,
        objectives=Objectives(ttft_ms=1000.0 + 0.2 * prompt, itl_ms=100.0),
        arrival_s=10.0,
    )


def view(*workers: WorkerView, resident: str | None = None, tokens: int = 0) -> ClusterView:
    residency = None
    if resident is not None:
        residency = Residency(worker_id=resident, tokens=tokens, bytes=tokens * KV, epoch=1)
    return ClusterView(now_s=10.0, workers=workers, residency=residency)


def adaptive(**params: object) -> AdaptivePolicy:
    policy = create_policy("adaptive", params)
    assert isinstance(policy, AdaptivePolicy)
    return policy


@pytest.mark.parametrize(
    ("tokens", "budget"), [(1, 1.0), (64, 1.0), (101, 1.0), (201, 2.0), (512, 5.11), (4097, 40.96)]
)
def test_slow_gap_budget_is_one_percent_of_the_gaps_at_least_one(
    tokens: int, budget: float
) -> None:
    assert slow_gap_budget(tokens) == pytest.approx(budget)


def test_stall_ledger_rates_decay_and_replace_a_request_entry() -> None:
    ledger = StallLedger(window_s=5.0)
    assert ledger.rate("m1", 0.0) == 0.0
    ledger.place("r1", "m1", 10.0, 2)
    ledger.place("r2", "m1", 10.0, 1)
    assert ledger.rate("m1", 10.0) == pytest.approx(3 / 5)
    assert ledger.rate("m1", 15.0) == pytest.approx(3 / 5 * math.exp(-1))
    # The asking request is left out; placing it again replaces its entry.
    assert ledger.rate("m1", 10.0, exclude="r1") == pytest.approx(1 / 5)
    ledger.place("r1", "m2", 10.0, 2)
    assert ledger.rate("m1", 10.0) == pytest.approx(1 / 5)
    assert ledger.rate("m2", 10.0) == pytest.approx(2 / 5)
    ledger.place("r1", None, 10.0, 0)
    assert ledger.rate("m2", 10.0) == pytest.approx(0.0, abs=1e-12)
    # A finished request stays counted but is no longer excluded.
    ledger.forget("r2")
    assert ledger.rate("m1", 10.0, exclude="r2") == pytest.approx(1 / 5)
    # An event reported late counts as of its own time.
    ledger.place("r3", "m3", 20.0, 1)
    ledger.place("r4", "m3", 15.0, 1)
    assert ledger.rate("m3", 20.0) == pytest.approx((1 + math.exp(-1)) / 5)


def test_deciding_again_neither_double_counts_nor_changes_the_decision() -> None:
    policy = adaptive()
    cluster = view(w("m1"), w("m2"))
    first = policy.decide(turn(8000), cluster)
    assert policy.decide(turn(8000), cluster) == first
    assert isinstance(first, Colocate)
    # The 8k prefill (~250 ms) outlasts the ITL objective once: one slow step on its worker.
    assert policy._stalls.rate(first.worker, 10.0) == pytest.approx(1 / 5.0)


def test_an_answer_avoids_the_worker_that_just_ran_a_slow_prefill() -> None:
    policy = adaptive()
    cluster = view(w("m1"), w("m2"))
    first = policy.decide(turn(8000, request="r1"), cluster)
    assert isinstance(first, Colocate)
    assert first.worker == "m1"
    second = policy.decide(turn(8000, request="r2"), cluster)
    # Its slow prefill goes where slow steps already expose the streams (a slow prefill on
    # m2 would make m2 such a worker too), its answer to m2.
    assert isinstance(second, Handoff)
    assert (second.prefill_worker, second.decode_worker) == ("m1", "m2")
    # Exposure: the slow steps an answer of G tokens expects there, over its budget.
    scorer = Scorer(turn(8000, request="r3"), cluster, policy.estimates, links={},
                    horizon_s=1.0, default_bps=12.5e9, stalls=policy._stalls)  # fmt: skip
    step = policy.estimates.decode_step_ms(1, policy.estimates.mean_context_tokens, "m1")
    # Both slow prefills ran on m1: 2 in the 5 s window.
    assert scorer.exposure(cluster.workers[0]) == pytest.approx(0.4 * 511 * step / 1000 / 5.11)


def test_slow_prefills_move_to_a_worker_without_streams() -> None:
    # m1 decodes 40 streams; m2 none: the 8k prefill runs on m2 and its answer decodes on m1.
    decision = adaptive().decide(turn(8000), view(w("m1", running=40), w("m2")))
    assert isinstance(decision, Colocate)
    assert decision.worker == "m2"
    decision = adaptive().decide(turn(8000), view(w("m1", running=40), w("m2", running=40)))
    assert isinstance(decision, Colocate)  # both harm as much: no transfer is cheaper
    # A short prompt's prefill stays within the ITL objective: it runs beside the streams,
    # on the worker its answer fills best (answers packed keep the other free for prefills).
    decision = adaptive().decide(turn(500), view(w("m1", running=40), w("m2", running=39)))
    assert isinstance(decision, Colocate)
    assert decision.worker == "m1"


def test_answers_pack_onto_the_fullest_worker_whose_step_meets_the_objective() -> None:
    # A short turn whose prefill harms no one: it goes where its answer fills the most
    # headroom under the ITL objective, not where it would decode fastest.
    decision = adaptive().decide(turn(300), view(w("m1", running=30), w("m2", running=2),
                                                 w("m3", running=10)))  # fmt: skip
    assert isinstance(decision, Colocate)
    assert decision.worker == "m1"


def test_where_prefills_are_slow_an_answer_packs_beside_streams_not_on_a_free_worker() -> None:
    # A workload of long prompts: the typical prefill is a step past the ITL objective.
    policy = adaptive()
    for i in range(200):
        policy.observe(Outcome(
            request_id=f"o{i}", session_id=f"s-o{i}", action="handoff", prefill_worker="p1",
            decode_worker="d1", prompt_tokens=16000, cached_tokens=0, completion_tokens=64,
            ok=True, decode_ms=640.0,
        ))  # fmt: skip
    assert policy.estimates.typical_prefill_ms > 100.0
    # Queued behind p1's prefills, the turn's TTFT risks its objective. d2 has no stream:
    # the first step there would be shorter, but an answer there keeps the slow prefills
    # off it for its life. Beside d1's streams (a step of 30 ms at their 16k-token
    # contexts) it costs less.
    busy = w("p1", "prefill", waiting=4, running=1, inflight=5)
    cluster = view(busy, w("d1", "decode", running=20), w("d2", "decode"))
    scorer = Scorer(turn(16000), cluster, policy.estimates, links={}, horizon_s=1.0,
                    default_bps=12.5e9)  # fmt: skip
    prefill, beside, free = cluster.workers
    packed, spread = scorer.handoff(prefill, beside), scorer.handoff(prefill, free)
    assert packed.ttft_ms > spread.ttft_ms
    assert packed.risk > 0.0
    assert packed.cost < spread.cost
    # Past half the ITL objective a fuller worker is credited no headroom: there an answer
    # goes to the emptier one.
    crowded = view(busy, w("d1", "decode", running=60), w("d2", "decode"))
    scorer = Scorer(turn(16000), crowded, policy.estimates, links={}, horizon_s=1.0,
                    default_bps=12.5e9)  # fmt: skip
    prefill, full, free = crowded.workers
    assert scorer.handoff(prefill, free).cost < scorer.handoff(prefill, full).cost


def test_gpu_time_is_priced_a_short_queue_does_not_buy_a_recompute() -> None:
    # Recomputing 8200 tokens on the idle d2 would start sooner than the 200 new tokens behind
    # d1's queue of 5, but takes 25 times the GPU time.
    cluster = view(w("d1", "decode", waiting=5), w("d2", "decode"), resident="d1", tokens=8000)
    policy = adaptive(migrate_queue_threshold=64)
    decision = policy.decide(turn(8200, 200), cluster)
    assert isinstance(decision, Colocate)
    assert decision.worker == "d1"
    assert decision.reason.endswith("of recompute on d2")
    scorer = Scorer(turn(8200, 200), cluster, policy.estimates, links={}, horizon_s=1.0,
                    default_bps=12.5e9)  # fmt: skip
    colocate, recompute = scorer.whole(cluster.workers[0]), scorer.whole(cluster.workers[1])
    assert recompute.ttft_ms < colocate.ttft_ms
    assert recompute.cost > colocate.cost


def test_a_new_answer_goes_where_its_kv_fits() -> None:
    cluster = view(w("d1", "decode", kv_usage=0.95), w("d2", "decode", running=30))
    decision = adaptive().decide(turn(500), cluster)
    assert isinstance(decision, Colocate)
    assert decision.worker == "d2"
    # With every worker full, the least loaded still takes it.
    full = view(w("d1", "decode", kv_usage=0.95), w("d2", "decode", kv_usage=0.97, running=30))
    decision = adaptive().decide(turn(500), full)
    assert isinstance(decision, Colocate)
    assert decision.worker == "d1"


def _fresh_outcome(request: str, cached: int, action: str = "colocate") -> Outcome:
    return Outcome(
        request_id=request, session_id=f"s-{request}", action=action,  # type: ignore[arg-type]
        prefill_worker="m1", decode_worker="m1", prompt_tokens=6144, cached_tokens=cached,
        completion_tokens=64, ok=True, decode_ms=640.0,
    )  # fmt: skip


def test_a_shared_prefix_is_learned_from_fresh_sessions_and_priced_everywhere() -> None:
    policy = adaptive()
    cluster = view(w("m1"), w("m2"))
    before = Scorer(turn(6144), cluster, policy.estimates, links={}, horizon_s=1.0,
                    default_bps=12.5e9).whole(cluster.workers[1])  # fmt: skip
    alone = view(w("m1"))  # the fresh sessions run whole on m1; m2 never runs one
    for k in range(40):
        request = f"f{k}"
        assert isinstance(policy.decide(turn(6144, request=request), alone), Colocate)
        policy.observe(_fresh_outcome(request, cached=2048))
    # A handoff's decode leg reports the pulled KV as cached: it teaches nothing here.
    policy.observe(_fresh_outcome("other", cached=6144, action="handoff"))
    assert policy.estimates.shared_prefix_tokens == pytest.approx(2048, rel=0.02)
    after = Scorer(turn(6144), cluster, policy.estimates, links={}, horizon_s=1.0,
                   default_bps=12.5e9).whole(cluster.workers[1])  # fmt: skip
    expected = policy.estimates.prefill_ms(6144 - 2047, 2047, "m2")
    assert after.compute_ms == pytest.approx(expected, rel=0.01)
    assert after.compute_ms < 0.8 * before.compute_ms


def test_returning_turns_teach_no_shared_prefix() -> None:
    policy = adaptive()
    cluster = view(w("m1"), w("m2"), resident="m1", tokens=4000)
    decision = policy.decide(turn(6144, 2144), cluster)
    assert isinstance(decision, Colocate | Handoff | Recompute)
    policy.observe(_fresh_outcome("r1", cached=4000))
    assert policy.estimates.shared_prefix_tokens == 0.0


def fast_itl_turn() -> Turn:
    """A turn whose ITL objective (50 ms) the workload's typical prefill (~59 ms) outlasts."""
    return Turn(session_id="s-new", request_id="r-new", prompt_tokens=2000,
                uncached_tokens=2000, max_tokens=256,
                objectives=Objectives(ttft_ms=2000.0, itl_ms=50.0), arrival_s=10.0)  # fmt: skip


# (streams on m1 and on the other workers, the share of turns continuing a session, the
# turn's ITL objective, ms of prefill work placed on m1 and not done: the share of the
# answer's life on m1 whose slow steps count)
AVOIDED = [
    pytest.param((40, 0, 0), 0.25, 50.0, 0.0, 0.25, id="new sessions' prefills go elsewhere"),
    pytest.param((40, 0, 0), 0.0, 50.0, 500.0, None, id="the work placed there still stalls"),
    pytest.param((40, 0, 0), 1.0, 50.0, 0.0, 1.0, id="every turn continues a session"),
    pytest.param((0, 0, 0), 0.25, 50.0, 0.0, 1.0, id="m1 is as calm as the others"),
    pytest.param((40, 0), 0.25, 50.0, 0.0, 1.0, id="one other worker is not enough"),
    pytest.param((40, 0, 0), 0.25, 100.0, 0.0, 1.0, id="prefills are no slow steps"),
]


@pytest.mark.parametrize(("streams", "continuing", "itl_ms", "backlog_ms", "share"), AVOIDED)
def test_an_answer_beside_many_streams_meets_only_the_prefills_that_stay(
    streams: tuple[int, ...], continuing: float, itl_ms: float, backlog_ms: float,
    share: float | None,
) -> None:  # fmt: skip
    """The harm bound keeps new sessions' prefills off a worker with a stream budget more
    streams than the calmest other: an answer decoded there meets the slow steps already
    placed there, then the returning sessions' (the `continuing` share) only."""
    policy = adaptive()
    cluster = view(*(w(f"m{i + 1}", running=n) for i, n in enumerate(streams)))
    the_turn = msgspec.structs.replace(
        fast_itl_turn(), objectives=Objectives(ttft_ms=2000.0, itl_ms=itl_ms)
    )
    policy._stalls.place("earlier", "m1", 10.0, 3)
    work = WorkLedger()
    work.place("earlier", "m1", 10.0, backlog_ms)

    def exposure(share_continuing: float) -> float:
        scorer = Scorer(the_turn, cluster, policy.estimates, links={}, horizon_s=1.0,
                        default_bps=12.5e9, stalls=policy._stalls, work=work,
                        continuing=share_continuing)  # fmt: skip
        return scorer.exposure(cluster.workers[0])

    whole = exposure(1.0)
    assert whole > 0.0
    if share is None:  # the placed work's time counts whole, the rest at the share
        step = policy.estimates.decode_step_ms(41, policy.estimates.mean_context_tokens, "m1")
        life = 255 * step
        share = (backlog_ms + continuing * (life - backlog_ms)) / life
    assert exposure(continuing) == pytest.approx(whole * share)
