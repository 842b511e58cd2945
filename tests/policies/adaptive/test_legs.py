"""What `adaptive` counts beyond the view on a decode worker: the decode legs of the split
turns it placed there and not sent yet (`LegLedger`); and how likely the prefills joining a
step make it slow (`poisson_tail`)."""

from __future__ import annotations

import itertools
import math

import pytest

from policies import ClusterView, Handoff, Objectives, Turn, create_policy
from policies.adaptive.ledgers.legs import LegLedger, poisson_tail, slot_wait_ms
from policies.adaptive.ledgers.work import WorkLedger
from policies.adaptive.policy import AdaptivePolicy
from policies.adaptive.scoring import Scorer
from policies.costmodel.estimates import Estimates
from policies.testing.views import w
from policies.types import WorkerView


def turn(prompt: int, request: str = "r1", tokens: int = 512) -> Turn:
    return Turn(
        session_id=f"s-{request}", request_id=request, prompt_tokens=prompt,
        uncached_tokens=prompt, max_tokens=tokens, arrival_s=10.0,
        objectives=Objectives(ttft_ms=1000.0 + 0.2 * prompt, itl_ms=100.0),
    )  # fmt: skip


def scorer(
    t: Turn,
    workers: tuple[WorkerView, ...],
    legs: LegLedger | None = None,
    work: WorkLedger | None = None,
) -> Scorer:
    return Scorer(
        t, ClusterView(now_s=10.0, workers=workers), Estimates.from_presets(), links={},
        horizon_s=1.0, default_bps=12.5e9, max_seqs=256, legs=legs, work=work,
    )  # fmt: skip


def test_the_ledger_counts_a_decode_leg_until_it_is_sent() -> None:
    ledger = LegLedger()
    ledger.place("r1", "d1", 12.0, 1000)
    ledger.place("r2", "d1", 11.0, 3000)
    ledger.place("r3", "d2", 12.0, 500)
    ledger.place("r4", None, 12.0, 700)  # a whole turn: no leg to wait for
    assert ledger.coming("d1", 10.0) == (2, 4000)
    assert ledger.coming("d1", 10.0, exclude="r1") == (1, 3000)  # its own left out
    ledger.place("r2", "d2", 11.0, 3000)  # decided again: it goes elsewhere
    assert ledger.coming("d1", 10.0) == (1, 1000)
    assert ledger.coming("d2", 10.0) == (2, 3500)
    # Past its send time the router counts the leg in flight: the ledger no longer does.
    assert ledger.coming("d2", 11.5) == (1, 500)
    assert ledger.coming("d2", 10.0) == (1, 500)
    ledger.finish("r1")  # its outcome came
    assert ledger.coming("d1", 10.0) == (0, 0)
    assert ledger.coming("d9", 10.0) == (0, 0)


# (legs on their way, slots past the cap of 256 a new turn waits for)
COMING = [(0, 0), (5, 0), (10, 5), (20, 15)]


@pytest.mark.parametrize(("coming", "past"), COMING)
def test_legs_on_their_way_take_sequence_slots(coming: int, past: int) -> None:
    estimates = Estimates.from_presets()
    worker = w("d1", "decode", running=250, inflight=250)
    wait = slot_wait_ms(worker, 256, estimates, coming=coming)
    step = estimates.decode_step_ms(250, estimates.mean_context_tokens, "d1")
    assert wait == pytest.approx(past * estimates.mean_completion_tokens * step / 250)


def test_legs_on_their_way_fill_the_decode_worker_they_go_to() -> None:
    t = turn(2048)
    source, target = w("p1", "prefill"), w("d1", "decode", running=20, inflight=20, kv_usage=0.6)
    alone = scorer(t, (source, target)).handoff(source, target)
    legs = LegLedger()
    for i in range(8):  # placed within the scrape, their prefills about to end
        legs.place(f"old{i}", "d1", 10.2, 4096)
    crowded = scorer(t, (source, target), legs).handoff(source, target)
    assert scorer(t, (source, target), legs).decode_streams(target) == 28
    assert crowded.exposure > alone.exposure  # KV nearly full once they are in
    assert crowded.queue_ms > alone.queue_ms  # and the turn waits for room there
    assert crowded.ttft_ms > alone.ttft_ms
    # The same legs due once the 20 streams there now have ended (a mean answer's life
    # later) come into the room those leave: they crowd nothing.
    later = LegLedger()
    for i in range(8):
        later.place(f"old{i}", "d1", 15.0, 4096)
    assert scorer(t, (source, target), later).handoff(source, target).exposure == alone.exposure


def test_legs_add_at_their_peak_what_the_streams_have_not_freed_by_their_due_time() -> None:
    ledger = LegLedger()
    ledger.place("r1", "d1", 11.0, 1000)
    ledger.place("r2", "d1", 12.0, 3000)
    ledger.place("r3", "d1", 14.0, 2000)
    assert ledger.surplus("d1", 10.0) == 6000  # nothing freed: all of them
    # 1000 tokens freed a second: by 12.0, 4000 due less 2000 freed; by 14.0, 6000 less 4000.
    assert ledger.surplus("d1", 10.0, freed_per_s=1000.0, held=5000.0) == 2000
    assert ledger.surplus("d1", 10.0, "r2", freed_per_s=1000.0, held=5000.0) == 0
    # No more is freed than the streams there hold.
    assert ledger.surplus("d1", 10.0, freed_per_s=1000.0, held=1500.0) == 4500
    assert ledger.surplus("d9", 10.0) == 0


def test_a_burst_of_handoffs_within_one_scrape_spreads_over_the_decode_workers() -> None:
    policy = create_policy("adaptive", {})
    assert isinstance(policy, AdaptivePolicy)
    # Two prefill workers, two decode workers with the same load. The router counts a
    # decode leg only once its prefill ends, so every turn of the burst sees the same view.
    workers = (
        w("p0", "prefill"), w("p1", "prefill"),
        w("d0", "decode", running=20, inflight=20, kv_usage=0.7),
        w("d1", "decode", running=20, inflight=20, kv_usage=0.7),
    )  # fmt: skip
    decoded: dict[str, int] = {}
    for i in range(4):
        decision = policy.decide(turn(4096, f"r{i}"), ClusterView(now_s=10.0, workers=workers))
        assert isinstance(decision, Handoff)
        decoded[decision.decode_worker] = decoded.get(decision.decode_worker, 0) + 1
    assert sorted(decoded.values()) == [2, 2]


def test_poisson_tail() -> None:
    assert poisson_tail(4.0, 5) == pytest.approx(0.3711631, abs=1e-6)
    below = sum(math.exp(-2.5) * 2.5**k / math.factorial(k) for k in range(3))
    assert poisson_tail(2.5, 3) == pytest.approx(1.0 - below)
    assert poisson_tail(4.0, 0) == 1.0  # nothing more needs to come
    assert poisson_tail(0.0, 1) == 0.0  # nothing comes
    assert poisson_tail(1.0, 500) == 0.0
    tails = [poisson_tail(mean, 4) for mean in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert tails == sorted(tails) and tails[-1] < 1.0


def test_a_prefill_joining_a_backlog_shares_slow_steps_as_likely_as_it_fills_them() -> None:
    t = turn(512, tokens=64)
    worker = w("m1", running=40, inflight=40)
    harms = []
    for backlog_ms in (0.0, 20.0, 40.0, 60.0, 80.0, 120.0):
        work = WorkLedger()
        if backlog_ms:
            work.place("old", "m1", 10.0, backlog_ms)
        harms.append(scorer(t, (worker,), work=work).whole(worker).harm)
    assert harms[0] == 0.0  # alone, its step is well within the objective
    assert all(a < b for a, b in itertools.pairwise(harms))
    # Even a backlog that fills the step past the objective on average leaves it a share
    # (its own time), not a whole slow step per stream.
    estimates = Estimates.from_presets()
    own = estimates.prefill_ms(512, 0, "m1", 40) / 100.0
    assert harms[-1] < 40 * own
