"""What a slow prefill costs the streams decoding beside it (`TurnTerms._harm`)."""

from __future__ import annotations

import math

import pytest

from bench.results.summary import itl_stats
from policies import ClusterView, Objectives, Turn
from policies.adaptive import tuning
from policies.adaptive.ledgers.legs import (
    StallLedger,
    budget_crossings,
    slow_gap_budget,
    slow_gaps_allowed,
    stream_harm,
)
from policies.adaptive.scoring import Scorer
from policies.adaptive.tuning import CROSSING_WEIGHT
from policies.costmodel.estimates import Estimates
from policies.testing.views import w


@pytest.mark.parametrize("tokens", [2, 64, 101, 102, 256, 512, 1024, 4096])
def test_the_allowed_slow_gaps_are_what_the_p99_of_an_answers_gaps_tolerates(
    tokens: int,
) -> None:
    allowed = slow_gaps_allowed(tokens)
    gaps = tokens - 1
    for slow, meets in ((allowed, True), (allowed + 1, False)):
        if slow > gaps:
            continue
        # however slow they are (one more and the p99 interpolates towards it)
        p99 = itl_stats([10.0] * (gaps - slow) + [1e6] * slow).p99
        assert p99 is not None
        assert (p99 <= 100.0) is meets, (tokens, slow, p99)


def _poisson(mean: float, n: int) -> float:
    return math.exp(-mean) * mean**n / math.factorial(n)


# (mean slow gaps a stream meets, gaps it may have slow, slow gaps added)
CROSSINGS = [(0.0, 5, 2), (0.0, 0, 1), (0.0, 2, 3), (1.5, 5, 2), (4.0, 5, 1), (4.0, 5, 3),
             (9.0, 2, 1), (2.0, 0, 1), (2.0, 3, 10)]  # fmt: skip


@pytest.mark.parametrize(("mean", "allowed", "added"), CROSSINGS)
def test_budget_crossings_are_the_streams_pushed_past_their_allowance(
    mean: float, allowed: int, added: int
) -> None:
    expected = sum(_poisson(mean, n) for n in range(max(0, allowed - added + 1), allowed + 1))
    assert budget_crossings(mean, allowed, added) == pytest.approx(expected, abs=1e-9)


def test_a_fractional_slow_share_interpolates_its_neighbours() -> None:
    low, high = budget_crossings(2.0, 3, 1), budget_crossings(2.0, 3, 2)
    assert budget_crossings(2.0, 3, 1.25) == pytest.approx(low + 0.25 * (high - low))
    assert budget_crossings(2.0, 3, 0.5) == pytest.approx(0.5 * low)


# (mean slow gaps a stream meets, gaps it may have slow, slow gaps added, its budget B)
HARMS = [(0.0, 5, 1, 5.1), (5.0, 5, 1, 5.1), (4.0, 5, 3, 5.1), (0.0, 0, 2, 1.0), (30.0, 2, 1, 2.5)]


@pytest.mark.parametrize(("mean", "allowed", "added", "budget"), HARMS)
def test_a_streams_harm_weighs_its_crossing_now_and_the_budget_share_it_spends(
    mean: float, allowed: int, added: int, budget: float
) -> None:
    crossing = sum(_poisson(mean, n) for n in range(max(0, allowed - added + 1), allowed + 1))
    expected = CROSSING_WEIGHT * crossing + (1.0 - CROSSING_WEIGHT) * added / budget
    assert stream_harm(mean, allowed, added, budget) == pytest.approx(expected, abs=1e-9)


def _harm(itl_ms: float, placed_slow_steps: int) -> float:
    """A 4096-token turn's prefill harm on a worker with 20 streams, after that many slow
    steps were placed there in the last 0.1 s."""
    stalls = StallLedger(5.0)
    for i in range(placed_slow_steps):
        stalls.place(f"old{i}", "m1", 9.9, 1)
    turn = Turn(
        session_id="s", request_id="r", prompt_tokens=4096, uncached_tokens=4096,
        max_tokens=256, arrival_s=10.0, objectives=Objectives(ttft_ms=2000.0, itl_ms=itl_ms),
    )  # fmt: skip
    worker = w("m1", running=20, inflight=20)
    view = ClusterView(now_s=10.0, workers=(worker,))
    scorer = Scorer(turn, view, Estimates.from_presets(), links={}, horizon_s=1.0,
                    default_bps=12.5e9, stalls=stalls)  # fmt: skip
    assert scorer.slow_prefill(worker)  # its step is past the objective either way
    return scorer.whole(worker).harm


@pytest.mark.parametrize("placed", [0, 1, 3])
def test_where_the_typical_prefill_is_fast_each_slow_step_spends_a_budget_share(
    placed: int,
) -> None:
    # The prior's typical prefill (~60 ms) is within 100 ms: the streams' slow steps come
    # from prefills joining one step, which no ledger counts.
    estimates = Estimates.from_presets()
    assert estimates.typical_prefill_ms < 100.0
    budget = slow_gap_budget(estimates.mean_completion_tokens)
    assert _harm(100.0, placed) == pytest.approx(20 / budget)


def test_where_the_typical_prefill_is_slow_a_stream_pays_mostly_past_its_allowance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At 40 ms the typical prefill is a slow step: the slow steps the streams meet are those
    # placed there, and a 256-token answer may have 2 of them.
    assert Estimates.from_presets().typical_prefill_ms > 40.0
    calm, some, more = _harm(40.0, 0), _harm(40.0, 1), _harm(40.0, 3)
    monkeypatch.setattr(tuning, "CROSSING_WEIGHT", 0.0)
    share = _harm(40.0, 0)  # what its slow steps spend of the 20 streams' budgets
    assert share > 0.0
    # No stream is near its allowance: only the share its slow steps spend is weighed.
    assert calm == pytest.approx((1.0 - CROSSING_WEIGHT) * share)
    assert calm < some < more
