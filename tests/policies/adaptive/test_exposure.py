"""What an answer meets where it decodes (`TurnTerms.exposure`): a whole turn waiting on a
worker that hosts slow prefills meets the ones placed there while it waits, however short its
own answer; and the streams a slow prefill stalls there (`TurnTerms.streams`): a split turn's
prefill leg running there is none."""

from __future__ import annotations

import pytest

from policies import ClusterView, Objectives, Turn
from policies.adaptive.ledgers.legs import StallLedger, slow_gap_budget
from policies.adaptive.ledgers.streams import StreamLedger
from policies.adaptive.scoring import Scorer
from policies.costmodel.estimates import Estimates
from policies.testing.views import w

NOW_S = 10.0


def _turn(answer: int) -> Turn:
    prompt = 16384  # one prefill step far past the ITL objective on an H200
    return Turn(
        session_id="s", request_id="r", prompt_tokens=prompt, uncached_tokens=prompt,
        max_tokens=answer, arrival_s=NOW_S,
        objectives=Objectives(ttft_ms=1000.0 + 0.2 * prompt, itl_ms=100.0),
    )  # fmt: skip


# (slow steps placed on the host in the last second, requests queued there, answer tokens)
WAITS = [(0, 0, 4), (0, 12, 4), (4, 0, 4), (4, 12, 4), (8, 12, 4), (4, 12, 256), (4, 0, 256)]


@pytest.mark.parametrize(("placed", "queued", "answer"), WAITS)
def test_a_whole_turn_meets_the_slow_prefills_placed_while_it_waits_for_its_first_token(
    placed: int, queued: int, answer: int
) -> None:
    stalls = StallLedger(5.0)
    for i in range(placed):
        stalls.place(f"old{i}", "h", NOW_S - 1.0 + 0.1 * i, 1)
    host = w("h", running=1, waiting=queued, inflight=1 + queued)
    turn = _turn(answer)
    scorer = Scorer(turn, ClusterView(now_s=NOW_S, workers=(host,)), Estimates.from_presets(),
                    links={}, horizon_s=1.0, default_bps=12.5e9, stalls=stalls)  # fmt: skip
    assert scorer.slow_prefill(host)
    whole = scorer.whole(host)
    rate = stalls.rate("h", NOW_S)  # the only host: the rate hosts see lately is its own
    decode = scorer.exposure(host, hosting=True)  # what its answer's own gaps meet
    # The prefills placed there until its first token queue behind it, then run beside it.
    waited = rate * whole.ttft_ms / 1000.0 / slow_gap_budget(answer)
    assert whole.exposure == pytest.approx(decode + waited)
    if placed and queued:
        assert whole.exposure > decode
    if not placed:
        assert whole.exposure == 0.0


# (requests the scrape counts running on the worker, split turns' prefill legs this policy
# placed there whose KV has not left, whole turns placed there: the streams a slow prefill
# placed there stalls)
RUNNING = [(1, 1, 0, 0), (1, 0, 1, 1), (3, 1, 2, 2), (2, 2, 0, 0), (4, 1, 0, 3), (0, 1, 0, 0)]


@pytest.mark.parametrize(("running", "legs", "whole", "streams"), RUNNING)
def test_a_prefill_leg_running_on_a_worker_is_no_stream_there(
    running: int, legs: int, whole: int, streams: int
) -> None:
    ledger = StreamLedger(5.0)
    for i in range(legs):  # prefilled on h, decoded on d: on h until its KV leaves at 11 s
        ledger.place(f"leg{i}", (("h", 11.0), ("d", 12.0)), NOW_S - 0.1)
    for i in range(whole):  # a whole turn's prefill on h: it decodes there next
        ledger.place(f"whole{i}", (("h", 12.0),), NOW_S - 0.1)
    ledger.place("sent", (("h", NOW_S - 0.5), ("d", 12.0)), NOW_S - 1.0)  # KV gone: not counted
    host = w("h", running=running, inflight=running)
    turn = _turn(64)
    scorer = Scorer(turn, ClusterView(now_s=NOW_S, workers=(host,)), Estimates.from_presets(),
                    links={}, horizon_s=1.0, default_bps=12.5e9, done=ledger)  # fmt: skip
    assert scorer.streams(host) == streams
    # The harm of a slow prefill there counts only those streams.
    assert (scorer.whole(host).harm > 0.0) is (streams > 0)
