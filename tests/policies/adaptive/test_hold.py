"""Holding a turn until the streams its prefill would stall are done (`hold_s`), and the
`StreamLedger` that knows when they end."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest

from policies import (
    AdaptivePolicy,
    ClusterView,
    Colocate,
    Decision,
    Handoff,
    Objectives,
    Outcome,
    Recompute,
    Turn,
    create_policy,
)
from policies.adaptive.ledgers.streams import StreamLedger
from policies.adaptive.scoring import Scorer
from policies.adaptive.tuning import STALE_AFTER_S
from policies.testing.views import w
from policies.types import action_of, hold_of

SHORT = Objectives(ttft_ms=4000.0, itl_ms=100.0)


def turn(request: str, prompt: int, now: float, max_tokens: int = 64) -> Turn:
    return Turn(
        session_id=f"s-{request}", request_id=request, prompt_tokens=prompt,
        uncached_tokens=prompt, max_tokens=max_tokens, objectives=SHORT, arrival_s=now,
    )  # fmt: skip


def cluster(now: float, m1: int = 0, m2: int = 0) -> ClusterView:
    """Two mixed workers running `m1` and `m2` decode streams."""
    workers = (w("m1", running=m1, inflight=m1), w("m2", running=m2, inflight=m2))
    return ClusterView(now_s=now, workers=workers)


def decode_worker(decision: Decision) -> str:
    assert isinstance(decision, Colocate | Recompute | Handoff)
    return decision.worker if isinstance(decision, Colocate | Recompute) else decision.decode_worker


def finished(request: str, worker: str, completion: int) -> Outcome:
    return Outcome(
        request_id=request, session_id=f"s-{request}", action="colocate",
        prefill_worker=worker, decode_worker=worker, prompt_tokens=1000, cached_tokens=0,
        completion_tokens=completion, ok=True, ttft_ms=80.0, decode_ms=6.0 * completion,
    )  # fmt: skip


def busy_policy(
    params: Mapping[str, object], answers: int = 64
) -> tuple[AdaptivePolicy, dict[str, str]]:
    """A policy that has seen answers of `answers` tokens and placed one short-answer turn
    on each worker at t=10 (streams it knows end about 0.4 s later), and where each went."""
    policy = create_policy("adaptive", params)
    assert isinstance(policy, AdaptivePolicy)
    for i in range(100):
        policy.observe(finished(f"old-{i}", f"m{1 + i % 2}", answers))
    first = policy.decide(turn("a", 1000, 10.0), cluster(10.0))
    second = policy.decide(turn("b", 1000, 10.0), cluster(10.0, **{decode_worker(first): 1}))
    placed = {decode_worker(first): "a", decode_worker(second): "b"}
    assert set(placed) == {"m1", "m2"}
    return policy, placed


def test_a_long_prompt_is_held_until_the_short_answers_beside_it_are_done() -> None:
    policy, _ = busy_policy({})
    # A fresh 16k prompt: its prefill, unchunked, stalls any stream beside it past 100 ms.
    decision = policy.decide(turn("c", 16_000, 10.1), cluster(10.1, m1=1, m2=1))
    hold = hold_of(decision, SHORT.ttft_ms)
    assert hold > 0.0
    # The 1000-token turns each take a prefill (~60 ms) and 63 decode steps (~6 ms).
    assert 0.2 < hold < 1.0
    assert decision.predicted.ttft_ms >= hold * 1000.0
    assert " held " in decision.reason


@pytest.mark.parametrize(
    ("params", "answers", "m1", "m2", "done", "held"),
    [
        pytest.param({}, 64, 1, 1, (), True, id="both-workers-run-its-streams"),
        pytest.param({"max_hold_s": "0"}, 64, 1, 1, (), False, id="holding-disabled"),
        pytest.param({"max_hold_s": "0.05"}, 64, 1, 1, (), False, id="streams-end-too-late"),
        pytest.param({}, 64, 2, 2, (), False, id="streams-another-router-placed"),
        pytest.param({}, 64, 0, 0, ("a", "b"), False, id="nothing-to-wait-for"),
        # One slow step spends a fifth of a 512-token answer's budget: no stream surely
        # misses, and holding would idle the worker for what the streams can absorb.
        pytest.param({}, 512, 1, 1, (), False, id="answers-absorb-the-stall"),
    ],
)
def test_when_a_turn_is_held(
    params: Mapping[str, object], answers: int, m1: int, m2: int, done: tuple[str, ...],
    held: bool,
) -> None:  # fmt: skip
    policy, placed = busy_policy(params, answers)
    for request in done:
        worker = next(k for k, v in placed.items() if v == request)
        policy.observe(finished(request, worker, 64))
    decision = policy.decide(turn("c", 16_000, 10.1), cluster(10.1, m1=m1, m2=m2))
    assert action_of(decision) != "reject"
    assert (hold_of(decision, SHORT.ttft_ms) > 0.0) is held


def test_a_held_prefill_is_work_the_next_turn_waits_for() -> None:
    policy, _ = busy_policy({})
    first = policy.decide(turn("c", 16_000, 10.1), cluster(10.1, m1=1, m2=1))
    hold = hold_of(first, SHORT.ttft_ms)
    assert hold > 0.0
    assert isinstance(first, Colocate | Recompute | Handoff)
    worker = first.prefill_worker if isinstance(first, Handoff) else first.worker
    # Its prefill (held, then ~1 s of compute) is ahead of a second one placed there.
    ahead = policy._work.backlog_ms(worker, 10.1)
    assert ahead > hold * 1000.0


def test_hold_of_bounds_the_hold_by_the_ttft_objective() -> None:
    assert hold_of(Colocate("m1", hold_s=0.25), 1000.0) == 0.25
    assert hold_of(Colocate("m1", hold_s=3.0), 1000.0) == 1.0
    assert hold_of(Colocate("m1", hold_s=float("inf")), 1000.0) == 1.0
    assert hold_of(Handoff("p", "d", hold_s=float("nan")), 1000.0) == 0.0
    assert hold_of(Recompute("m1", hold_s=-1.0), 1000.0) == 0.0
    assert hold_of(Colocate("m1"), 1000.0) == 0.0


def test_stream_ledger_knows_when_a_workers_requests_are_done() -> None:
    ledger = StreamLedger(5.0)
    ledger.place("a", (("m1", 12.0),), 10.0)
    # A split turn: its prefill leg, then its answer.
    ledger.place("b", (("p1", 10.5), ("m1", 13.0)), 10.0)
    assert ledger.done_at("m1", 10.0) == (2, 13.0)
    # A prefill leg is a request there, but no stream to wait for.
    assert ledger.done_at("p1", 10.0) == (1, 10.0)
    # The asking request's own placement is left out (deciding a turn again).
    assert ledger.done_at("m1", 10.0, exclude="b") == (1, 12.0)
    # Late: predicted done, not seen finish: it ends any moment.
    assert ledger.done_at("m1", 13.5) == (2, 13.5)
    ledger.place("b", (("m2", 14.0),), 10.0)  # decided again: replaces its legs
    assert ledger.done_at("m1", 10.0) == (1, 12.0)
    assert ledger.done_at("p1", 10.0) == (0, 10.0)
    ledger.finish("a")
    assert ledger.done_at("m1", 10.0) == (0, 10.0)
    ledger.place("c", (), 10.0)  # rejected: nowhere
    assert ledger.done_at("m2", 10.0) == (1, 14.0)


def test_stream_ledger_forgets_requests_whose_outcome_never_came() -> None:
    ledger = StreamLedger(5.0)
    ledger.place("lost", (("m1", 10.0),), 10.0)
    ledger.place("live", (("m1", 10.0 + STALE_AFTER_S),), 10.0)
    later = 10.0 + STALE_AFTER_S + 1.0
    assert ledger.done_at("m1", later) == (1, later)
    ledger.finish("live")
    assert ledger.done_at("m1", 0.0) == (0, 0.0)


def test_stream_ledger_counts_the_answers_placed_on_each_worker_lately() -> None:
    ledger = StreamLedger(5.0)
    for i in range(10):
        ledger.place(f"r{i}", (("p1", 10.1), ("m1", 11.0)), 10.0)  # answers on m1
    assert ledger.answer_rate("m1", 10.0) == pytest.approx(10 / 5.0)
    assert ledger.answer_rate("p1", 10.0) == 0.0
    # The asking request's own answer is left out; decided again, it moves.
    assert ledger.answer_rate("m1", 10.0, exclude="r0") == pytest.approx(9 / 5.0)
    ledger.place("r0", (("m2", 11.0),), 10.0)
    assert ledger.answer_rate("m1", 10.0) == pytest.approx(9 / 5.0)
    assert ledger.answer_rate("m2", 10.0) == pytest.approx(1 / 5.0)
    # Finished answers still count: the rate is of placements, decaying over the window.
    ledger.finish("r1")
    assert ledger.answer_rate("m1", 15.0) == pytest.approx(9 / 5.0 * math.exp(-1.0))


def test_stream_ledger_knows_the_slow_steps_of_the_prefills_held_for_a_worker() -> None:
    ledger = StreamLedger(5.0)
    # A prefill held for m1 until 11.0, running 11.0-12.0 in 4 slow steps.
    ledger.place("h", (("m1", 12.5),), 10.0, held=(11.0, 12.0, 4))
    assert ledger.held_steps("m1", 10.0, 10.9) == 0.0  # done before it goes
    assert ledger.held_steps("m1", 12.1, 13.0) == 0.0  # starts after it ran
    assert ledger.held_steps("m1", 10.0, 13.0) == 4.0  # decodes all through it
    assert ledger.held_steps("m1", 11.5, 13.0) == pytest.approx(2.0)  # its second half
    assert ledger.held_steps("m2", 10.0, 13.0) == 0.0
    assert ledger.held_steps("m1", 10.0, 13.0, exclude="h") == 0.0
    ledger.finish("h")
    assert ledger.held_steps("m1", 10.0, 13.0) == 0.0


def test_an_answer_placed_where_a_prefill_is_held_meets_its_slow_steps() -> None:
    policy, _ = busy_policy({})
    held = policy.decide(turn("c", 16_000, 10.1), cluster(10.1, m1=1, m2=1))
    assert hold_of(held, SHORT.ttft_ms) > 0.0
    assert isinstance(held, Colocate | Recompute | Handoff)
    worker = held.prefill_worker if isinstance(held, Handoff) else held.worker

    def exposure(now: float, done: StreamLedger | None) -> float:
        """Of a short turn prefilled on the other worker and decoded on the held one's."""
        view = cluster(now, m1=1, m2=1)
        there = next(w for w in view.workers if w.worker_id == worker)
        other = next(w for w in view.workers if w.worker_id != worker)
        scorer = Scorer(turn("d", 1000, now), view, policy.estimates, links={},
                        horizon_s=1.0, default_bps=12.5e9, done=done)  # fmt: skip
        return scorer.handoff(other, there).exposure

    # Its answer decodes while the held prefill runs there: it meets its slow step.
    assert exposure(10.15, policy._done) > exposure(10.15, None) + 0.1
    # Placed once the held prefill has run, it meets nothing.
    assert exposure(12.0, policy._done) == exposure(12.0, None)
