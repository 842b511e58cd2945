"""`adaptive`'s cache ledger: the share of the KV a placement fills that evicts live contexts,
and what that costs its candidates."""

from __future__ import annotations

import math

import pytest

from policies import ClusterView, Objectives, Residency, Turn
from policies.adaptive.ledgers.cache import CacheLedger, kv_capacity_tokens
from policies.adaptive.policy import AdaptivePolicy
from policies.adaptive.scoring import Scorer
from policies.costmodel.estimates import Estimates
from policies.costmodel.priors import gpu_prior, model_prior
from policies.testing.views import KV, w


def test_kv_capacity_is_the_memory_vllm_takes_less_the_weights() -> None:
    gpu, model = gpu_prior("h200-sxm"), model_prior("llama-3.1-8b")
    expected = (141e9 * 0.9 - 8.03e9 * 2) / model.kv_bytes_per_token
    assert kv_capacity_tokens(gpu.name, model.name, 1) == pytest.approx(expected)
    assert kv_capacity_tokens("h200-sxm", "llama-3.1-8b", 2) > 2 * expected
    # A model whose weights do not fit holds no KV.
    assert kv_capacity_tokens("a100-80g", "llama-3.1-70b", 1) == 0.0


def ledger(*, gap_s: float | None = 5.0, filled: int = 50_000) -> CacheLedger:
    """100,000 tokens of KV; `filled` tokens placed on m1 at t=100 (a rate of filled / 10 s);
    sessions that came back `gap_s` after their last turn ended."""
    cache = CacheLedger(capacity_tokens=100_000, window_s=10.0, rate=0.1)
    if gap_s is not None:
        cache.ended("r0", "s0", 90.0)
        cache.returned("s0", 90.0 + gap_s)
    if filled:
        cache.place("r1", (("m1", filled),), 100.0)
    return cache


@pytest.mark.parametrize(
    ("case", "cache", "kv_usage", "continuing", "share"),
    [
        ("no session came back yet", ledger(gap_s=None), 0.5, 0.75, 0.0),
        ("nothing placed there", ledger(filled=0), 0.5, 0.75, 0.0),
        ("no session continues", ledger(), 0.5, 0.0, 0.0),
        # 50,000 free tokens filled at 5,000 a second turn over in 10 s, twice the gap.
        ("half free", ledger(), 0.5, 0.75, 0.75 * math.exp(-2.0)),
        ("nearly full", ledger(), 0.9, 0.75, 0.75 * math.exp(-0.4)),
        ("full: every block filled evicts", ledger(), 1.0, 0.75, 0.75),
        ("longer gaps outlast the turnover", ledger(gap_s=20.0), 0.5, 0.75, 0.75 * math.exp(-0.5)),
    ],
)
def test_live_share(
    case: str, cache: CacheLedger, kv_usage: float, continuing: float, share: float
) -> None:
    assert cache.live_share("m1", kv_usage, 100.0, continuing) == pytest.approx(share), case


def test_fills_decay_and_a_placement_decided_again_replaces_its_fills() -> None:
    cache = ledger()
    at_once = cache.live_share("m1", 0.5, 100.0, 1.0)
    # The rate decays with the window: after 10 s, 1/e of it, the turnover e times longer.
    assert cache.live_share("m1", 0.5, 110.0, 1.0) == pytest.approx(math.exp(-2.0 * math.e))
    cache.place("r1", (("m1", 50_000),), 100.0)
    assert cache.live_share("m1", 0.5, 100.0, 1.0) == pytest.approx(at_once)
    cache.place("r1", (("m2", 50_000),), 100.0)
    assert cache.live_share("m1", 0.5, 100.0, 1.0) == 0.0
    assert cache.live_share("m2", 0.5, 100.0, 1.0) == pytest.approx(at_once)
    cache.place("r1", (), 100.0)  # rejected when decided again
    assert cache.live_share("m2", 0.5, 100.0, 1.0) == 0.0


def test_gaps_are_learned_up_to_the_next_prefill_and_averaged() -> None:
    cache = ledger(gap_s=3.0)
    cache.ended("r2", "s0", 110.0)
    cache.returned("s0", 117.0)  # a gap of 7 s: the mean of the first gaps is 5 s
    cache.returned("s0", 150.0)  # no turn of it ended since: nothing learned
    cache.returned("other", 150.0)
    assert cache.live_share("m1", 0.5, 100.0, 1.0) == pytest.approx(math.exp(-10.0 / 5.0))


@pytest.mark.parametrize("window_s", [0.0, -1.0, math.inf])
def test_window_must_be_finite_and_positive(window_s: float) -> None:
    with pytest.raises(ValueError, match="window_s"):
        CacheLedger(capacity_tokens=1.0, window_s=window_s, rate=0.1)


TURN = Turn(
    session_id="s9",
    request_id="r9",
    prompt_tokens=2566,
    uncached_tokens=514,
    max_tokens=512,
    objectives=Objectives(ttft_ms=1000.0, itl_ms=100.0),
    arrival_s=100.0,
)
VIEW = ClusterView(
    now_s=100.0,
    workers=(w("m1", running=256, waiting=4, kv_usage=0.9), w("m2", running=200, kv_usage=0.9)),
    residency=Residency(worker_id="m1", tokens=2052, bytes=2052 * KV, epoch=1, turns=2),
)


def scorer(cache: CacheLedger | None) -> Scorer:
    estimates = Estimates.from_presets("h200-sxm", "llama-3.1-8b", 1)
    return Scorer(TURN, VIEW, estimates, links={}, horizon_s=1.0, default_bps=12.5e9,
                  cache=cache, continuing=0.75)  # fmt: skip


def thrashing(workers: tuple[str, ...] = ("m1", "m2")) -> CacheLedger:
    """The workers' caches turn over in about a second, sessions come back after two."""
    cache = CacheLedger(kv_capacity_tokens("h200-sxm", "llama-3.1-8b", 1), 10.0, 0.1)
    cache.ended("r0", "s0", 90.0)
    cache.returned("s0", 92.0)
    cache.place("bulk", tuple((wid, 500_000) for wid in workers), 100.0)
    return cache


def test_candidates_pay_for_the_live_contexts_their_kv_evicts() -> None:
    calm, busy = scorer(None), scorer(thrashing())
    m1, m2 = VIEW.workers
    for plain, priced in [
        (calm.whole(m1), busy.whole(m1)),
        (calm.whole(m2), busy.whole(m2)),
        (calm.handoff(m1, m2, "migrate"), busy.handoff(m1, m2, "migrate")),
    ]:
        assert plain.eviction == 0.0
        assert priced.eviction > 0.0
        assert priced.cost - plain.cost == pytest.approx(priced.eviction)
        assert priced.interference - plain.interference == pytest.approx(priced.eviction)
    colocate, recompute = busy.whole(m1), busy.whole(m2)
    # The colocated turn fills its new input and answer; the recompute its whole context.
    assert colocate.fills == (("m1", 514 + 512),)
    assert recompute.fills == (("m2", 2566 + 512),)
    assert recompute.eviction > colocate.eviction
    # A worker whose cache keeps its contexts costs nothing to fill.
    only_m1 = scorer(thrashing(("m1",)))
    assert only_m1.whole(m2).eviction == 0.0
    assert only_m1.whole(m1).eviction == pytest.approx(colocate.eviction)


def primed(policy: AdaptivePolicy) -> None:
    """Sessions came back 2 s after their turns ended; each worker was filled at 50,000 tokens
    a second (at 90% KV usage, its free cache turns over in 1.7 s); 3 in 4 turns continue."""
    policy._cache = thrashing()
    policy._admission.continuing = 0.75


@pytest.mark.parametrize(
    ("case", "thrash", "action"),
    [
        ("caches keep the contexts: the recompute on the calmer worker", False, "recompute"),
        ("caches evict live contexts: the turn stays", True, "colocate"),
    ],
)
def test_a_returning_turn_stays_where_moving_it_evicts_live_contexts(
    case: str, thrash: bool, action: str
) -> None:
    policy = AdaptivePolicy()
    if thrash:
        primed(policy)
    decision = policy.decide(TURN, VIEW)
    assert type(decision).__name__.lower() == action, (case, decision.reason)
