from __future__ import annotations

import math
import random
import re

import msgspec
import pytest

from policies import Outcome, PolicyConfigError
from policies.costmodel.estimates import FACTOR_MAX, FACTOR_MIN, Estimates, PrefillLeg
from policies.costmodel.priors import GPU_PRIORS, gpu_prior, model_prior


class Truth:
    """The "measured" stage times: an a100-80g-like roofline with its own efficiencies and step
    overhead, written out here independently of the policy's prior, step by step."""

    def __init__(
        self, peak_flops: float = 312e12, bandwidth: float = 2.0e12, chunk: int | None = None
    ) -> None:
        self.chunk = chunk
        layers, heads, kv_heads, head_dim, params = 32, 32, 8, 128, 8.03e9
        self.flops_per_token = 2 * params
        self.flops_per_pair = 4 * layers * heads * head_dim
        self.weight_bytes = 2 * params
        self.kv_bytes = 2 * layers * kv_heads * head_dim * 2
        self.flops_per_ms = peak_flops * 0.5 / 1000
        self.bytes_per_ms = bandwidth * 0.8 / 1000
        self.overhead_ms = 2.0

    def prefill_ms(self, new: int, cached: int, running: int = 0, context: float = 0) -> float:
        """The prefill's steps, each fused with a decode step of `running` streams."""
        total, done = 0.0, 0
        while done < new:
            size = new - done if self.chunk is None else min(self.chunk, new - done)
            before = cached + done
            flops = self.flops_per_token * size + self.flops_per_pair * size * (before + size / 2)
            nbytes = self.weight_bytes + self.kv_bytes * (before + size)
            flops += running * (self.flops_per_token + self.flops_per_pair * context)
            nbytes += running * self.kv_bytes * (context + 1)
            total += self.overhead_ms + max(flops / self.flops_per_ms, nbytes / self.bytes_per_ms)
            done += size
        return total

    def step_ms(self, batch: int, context: float) -> float:
        flops = batch * (self.flops_per_token + self.flops_per_pair * context)
        nbytes = self.weight_bytes + self.kv_bytes * batch * (context + 1)
        return self.overhead_ms + max(flops / self.flops_per_ms, nbytes / self.bytes_per_ms)


def draw_prompt(rng: random.Random) -> tuple[int, int]:
    """(new, cached): new tokens log-uniform over 16..16k, half the turns with a cached prefix."""
    new = int(math.exp(rng.uniform(math.log(16), math.log(16384))))
    return new, rng.choice((0, rng.randint(0, 16000)))


def _workload_context() -> float:
    rng = random.Random(0)
    return sum(sum(draw_prompt(rng)) + 128 for _ in range(20_000)) / 20_000


WORKLOAD_CONTEXT = _workload_context()  # a stream's mean context: prompt + half its answer


def measured_outcome(
    rng: random.Random, truth: Truth, action: str, worker: str = "w1", queue_ms: float | None = None
) -> Outcome:
    new, cached = draw_prompt(rng)
    completion = rng.randint(2, 512)
    running = rng.randint(0, 48)
    prefill = truth.prefill_ms(new, cached)
    if action == "colocate" and running:
        # The prefill shares its step with the running streams, of the workload's contexts.
        others = sum(sum(draw_prompt(rng)) + 128 for _ in range(running)) / running
        prefill = truth.prefill_ms(new, cached, running, others)
    # Its decode steps too hold the streams beside it, of the workload's mean context.
    own = new + cached + completion / 2
    step = truth.step_ms(running + 1, (own + running * WORKLOAD_CONTEXT) / (running + 1))
    return Outcome(
        request_id="r",
        session_id="s",
        action="handoff" if action == "handoff" else "colocate",
        prefill_worker=worker,
        decode_worker=worker,
        prompt_tokens=new + cached,
        cached_tokens=cached,
        completion_tokens=completion,
        ok=True,
        prefill_ms=prefill * rng.uniform(0.95, 1.05),
        decode_ms=(completion - 1) * step * rng.uniform(0.95, 1.05),
        queue_ms=queue_ms,
        worker_running_at_start=running,
    )


def worst_errors(
    estimates: Estimates, truth: Truth, seed: int, worker: str | None = None
) -> tuple[float, float]:
    """Largest relative prefill and decode-step errors over 300 fresh inputs."""
    rng = random.Random(10_000 + seed)
    prefill = decode = 0.0
    for _ in range(300):
        new, cached = draw_prompt(rng)
        guess = estimates.prefill_ms(new, cached, worker)
        prefill = max(prefill, abs(guess / truth.prefill_ms(new, cached) - 1))
        batch, context = rng.randint(1, 64), rng.randint(256, 8000)
        guess = estimates.decode_step_ms(batch, context, worker)
        decode = max(decode, abs(guess / truth.step_ms(batch, context) - 1))
    return prefill, decode


@pytest.mark.parametrize(
    ("action", "chunk"),
    [("handoff", None), ("colocate", None), ("colocate", 512), ("handoff", 2048)],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_converges_from_a_wrong_gpu_prior(action: str, chunk: int | None, seed: int) -> None:
    truth = Truth(chunk=chunk)
    estimates = Estimates.from_presets("h200-sxm", "llama-3.1-8b", chunk_tokens=chunk)
    before = worst_errors(estimates, truth, seed)
    assert min(before) > 0.5  # the h200 prior is far from a100 numbers
    rng = random.Random(seed)
    for _ in range(200):
        estimates.observe(measured_outcome(rng, truth, action))
    prefill, decode = worst_errors(estimates, truth, seed)
    assert prefill < 0.15
    assert decode < 0.15


def behind_placed_work(
    truth: Truth, rng: random.Random, share: float
) -> tuple[Outcome, PrefillLeg]:
    """A handoff's prefill that waited behind prefill work already running on its worker (a
    scrape counts no queue), `share` of its own measured prefill, as the placement's ledger
    knew it."""
    outcome = measured_outcome(rng, truth, "handoff")
    assert outcome.prefill_ms is not None
    wait = share * outcome.prefill_ms
    stage = msgspec.structs.replace(outcome, prefill_ms=outcome.prefill_ms + wait)
    return stage, PrefillLeg(outcome.cached_tokens, 0, wait)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fits_an_engine_unlike_its_roofline(seed: int) -> None:
    """vLLM's CPU build as measured through the router (tiny model): each whole turn waits
    ~20 ms besides its steps, attention costs 5x its roofline share against the weights'
    products at 0.9x, and a decode step is mostly overhead (6 ms). Fitted as one model, the
    TTFT of a short fresh prompt and of a long session's turn both come out right; fitted
    apart, a base learnt from residuals flattens the slope between them."""
    estimates = Estimates.from_presets("cpu", "tiny-llama")
    prior = estimates.prior
    rng = random.Random(seed)

    def ttft_ms(new: int, cached: int) -> float:
        terms = prior.prefill_terms(new, cached)
        return 20.0 + 1.5 + 0.9 * terms[4] + 5.0 * terms[5]

    for _ in range(120):
        new = rng.choice((128, 384, 1024)) * rng.randint(1, 3)
        cached = rng.choice((0, rng.randint(0, 2048)))
        running = rng.randint(0, 3)
        steps = rng.randint(15, 47)
        estimates.observe(Outcome(
            request_id="r", session_id="s", action="colocate", prefill_worker="w1",
            decode_worker="w1", prompt_tokens=new + cached, cached_tokens=cached,
            completion_tokens=steps + 1, ok=True, queue_ms=0.0,
            ttft_ms=ttft_ms(new, cached) * rng.uniform(0.9, 1.1),
            decode_ms=steps * 6.0 * rng.uniform(0.9, 1.1), worker_running_at_start=running,
        ))  # fmt: skip
    for new, cached in ((300, 0), (1000, 0), (1100, 900), (1100, 2000)):
        predicted = estimates.queue_wait_ms(0) + estimates.prefill_ms(new, cached)
        assert predicted == pytest.approx(ttft_ms(new, cached), rel=0.1), (new, cached)
    assert estimates.decode_step_ms(1, 2000) == pytest.approx(6.0, rel=0.1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_prefill_behind_placed_work_teaches_its_own_time(seed: int) -> None:
    truth = Truth()
    told, blind = (Estimates.from_presets("h200-sxm", "llama-3.1-8b") for _ in range(2))
    rng = random.Random(seed)
    for _ in range(400):
        outcome, leg = behind_placed_work(truth, rng, rng.uniform(0.0, 0.5))
        told.observe(outcome, leg)
        blind.observe(outcome, leg._replace(ahead_ms=0.0))
    assert worst_errors(told, truth, seed)[0] < 0.15
    # Taken for the prefill's own time, the wait would make every prefill look slower.
    assert worst_errors(blind, truth, seed)[0] > 0.15


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_wait_for_placed_work_is_no_wait_in_an_empty_queue(seed: int) -> None:
    """The placement's ledger foresaw these waits (the work ahead of each): what a turn that
    finds no queue and no work placed ahead waits learns none of them."""
    truth = Truth()
    estimates = Estimates.from_presets("h200-sxm", "llama-3.1-8b")
    rng = random.Random(seed)
    waits = []
    for _ in range(400):
        outcome, leg = behind_placed_work(truth, rng, rng.uniform(0.0, 0.5))
        estimates.observe(outcome, leg)
        waits.append(leg.ahead_ms)
    assert estimates.queue_wait_ms(0) < 0.1 * sum(waits) / len(waits)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_split_turn_teaches_from_the_prefix_its_prefill_leg_found(seed: int) -> None:
    """Placed assuming nothing cached on the prefill worker, the prefill legs found a prefix
    there (a system prompt other sessions left): told what each found, the roofs converge;
    taken for uncached, the prefix makes the GPU look faster than it is."""
    truth = Truth()
    told, blind = (Estimates.from_presets("h200-sxm", "llama-3.1-8b") for _ in range(2))
    rng = random.Random(seed)
    for _ in range(200):
        outcome = measured_outcome(rng, truth, "handoff")
        assumed = PrefillLeg(cached=0, beside=0)
        told.observe(
            msgspec.structs.replace(outcome, prefill_cached_tokens=outcome.cached_tokens), assumed
        )
        blind.observe(outcome, assumed)
    assert worst_errors(told, truth, seed)[0] < 0.15
    assert worst_errors(blind, truth, seed)[0] > 0.15


def test_a_whole_turn_keeps_the_cache_hit_it_was_placed_with() -> None:
    """`prefill_cached_tokens` speaks of a split turn's prefill leg: a colocated turn's one
    leg is its own outcome's `cached_tokens`, whatever the field says."""
    outcome = measured_outcome(random.Random(3), Truth(), "colocate")
    plain, marked = Estimates.from_presets(), Estimates.from_presets()
    leg = PrefillLeg(outcome.cached_tokens, outcome.worker_running_at_start)
    plain.observe(outcome, leg)
    marked.observe(msgspec.structs.replace(outcome, prefill_cached_tokens=0), leg)
    assert marked.factors() == plain.factors()


def test_a_prefill_behind_more_than_its_own_work_teaches_no_roof() -> None:
    estimates, reference = Estimates.from_presets(), Estimates.from_presets()
    rng = random.Random(7)
    for _ in range(50):
        outcome, leg = behind_placed_work(Truth(), rng, 50.0)
        estimates.observe(msgspec.structs.replace(outcome, decode_ms=None), leg)
    assert estimates.factors()["prefill_linear"] == reference.factors()["prefill_linear"]
    assert estimates.factors()["prefill_memory"] == reference.factors()["prefill_memory"]


def test_learns_each_workers_speed() -> None:
    slow, fast = Truth(), Truth(peak_flops=989e12, bandwidth=4.8e12)
    estimates = Estimates.from_presets("h100-sxm", "llama-3.1-8b")
    rng = random.Random(5)
    for _ in range(200):
        estimates.observe(measured_outcome(rng, slow, "handoff", worker="slow"))
        estimates.observe(measured_outcome(rng, fast, "handoff", worker="fast"))
    for worker, truth in (("slow", slow), ("fast", fast)):
        prefill, decode = worst_errors(estimates, truth, 3, worker)
        assert prefill < 0.15
        assert decode < 0.15
    # A worker that never reported is predicted with the fleet's factors, between the two.
    new, cached = 4096, 0
    fleet = estimates.prefill_ms(new, cached, "unseen")
    assert fast.prefill_ms(new, cached) < fleet < slow.prefill_ms(new, cached)
    assert fleet == estimates.prefill_ms(new, cached)


def test_queue_wait_learns_the_cost_of_each_request_ahead() -> None:
    # The router forwards at once (queue stage ~0): the engine's queue wait is inside the
    # measured prefill stage, and the estimates separate it from the prefill they predict.
    truth = Truth()
    estimates = Estimates.from_presets("h200-sxm")
    rng = random.Random(11)
    for _ in range(400):
        depth = rng.choice((0, rng.randint(1, 12)))
        # Each request ahead costs about one mean prefill of this workload (~150 ms on truth).
        outcome = measured_outcome(rng, truth, "handoff", queue_ms=0.0)
        wait = 150.0 * depth
        assert outcome.prefill_ms is not None
        estimates.observe(
            msgspec.structs.replace(
                outcome, prefill_ms=outcome.prefill_ms + wait, worker_waiting_at_start=depth
            )
        )
    assert estimates.queue_wait_ms(0) < 15.0
    for depth in (4, 10):
        assert estimates.queue_wait_ms(depth) == pytest.approx(150.0 * depth, rel=0.15)
    # The roofs learned from the turns that found no queue.
    prefill, _ = worst_errors(estimates, truth, 4)
    assert prefill < 0.15


def test_queue_wait_learns_from_the_queue_the_placement_weighed() -> None:
    """A placement that knew the prefills ahead (`PrefillLeg.queued`, in typical prefills)
    teaches the wait per typical prefill from that, not from the count of requests ahead:
    many short prompts ahead wait little."""
    truth = Truth()
    estimates = Estimates.from_presets("h200-sxm")
    rng = random.Random(12)
    typical = 0.0
    for _ in range(400):
        count = rng.choice((0, rng.randint(1, 12)))
        weight = rng.choice((0.1, 1.0, 3.0))  # short, typical or long prompts ahead
        outcome = measured_outcome(rng, truth, "handoff", queue_ms=0.0)
        typical = estimates.typical_prefill_ms
        wait = typical * weight * count
        assert outcome.prefill_ms is not None
        leg = PrefillLeg(outcome.cached_tokens, 0, 0.0, queued=weight * count)
        estimates.observe(
            msgspec.structs.replace(
                outcome, prefill_ms=outcome.prefill_ms + wait, worker_waiting_at_start=count
            ),
            leg,
        )
    for queued in (4.0, 10.0):
        assert estimates.queue_wait_ms(queued) == pytest.approx(typical * queued, rel=0.15)
    # Twelve short prompts ahead wait like one or two typical ones, not twelve.
    assert estimates.queue_wait_ms(12 * 0.1) < estimates.queue_wait_ms(12.0) / 4


def test_link_rate_is_an_ewma_of_observed_transfers() -> None:
    estimates = Estimates.from_presets(rate=0.1)  # links follow at 3 x rate
    assert estimates.link_bps("p1", "d1") is None
    for transfer_ms in (100.0, 50.0):
        estimates.observe(_outcome(transfer_ms=transfer_ms, transfer_bytes=1_000_000_000))
    # 10 GB/s, then 30% of the way toward 20 GB/s.
    assert estimates.link_bps("p1", "d1") == pytest.approx(13e9)
    assert estimates.link_bps("d1", "p1") is None
    estimates.observe(
        _outcome(prefill_worker="d1", transfer_ms=10.0, transfer_bytes=1_000_000)
    )  # src == dst: a local copy, not a link
    assert estimates.link_bps("d1", "d1") is None


def test_a_link_not_used_yet_is_expected_to_run_like_the_others() -> None:
    estimates = Estimates.from_presets(rate=0.1)
    assert estimates.expected_link_bps("p2", "d2") is None
    estimates.observe(_outcome(transfer_ms=100.0, transfer_bytes=1_000_000_000))
    estimates.observe(
        _outcome(prefill_worker="p2", decode_worker="d1", transfer_ms=50.0,
                 transfer_bytes=1_000_000_000)
    )  # fmt: skip
    # its own rate where it has one; else every link's EWMA: 10 GB/s, then 30% of the way
    # to 20 GB/s
    assert estimates.expected_link_bps("p1", "d1") == pytest.approx(10e9)
    assert estimates.expected_link_bps("p2", "d1") == pytest.approx(20e9)
    assert estimates.expected_link_bps("p2", "d2") == pytest.approx(13e9)
    assert estimates.link_bps("p2", "d2") is None


def test_failed_outcomes_and_missing_stages_teach_nothing() -> None:
    estimates = Estimates.from_presets()
    reference = Estimates.from_presets()
    wild = dict(
        prefill_ms=9e9, decode_ms=9e9, queue_ms=9e9, transfer_ms=1e-6, transfer_bytes=10**15
    )
    estimates.observe(_outcome(ok=False, **wild))
    estimates.observe(_outcome())  # every stage None
    estimates.observe(_outcome(decode_ms=50.0, completion_tokens=1))  # no inter-token gap
    assert _snapshot(estimates) == _snapshot(reference)


GARBAGE: list[dict[str, object]] = [
    {"prefill_ms": 0.0},
    {"prefill_ms": -5.0},
    {"prefill_ms": math.nan},
    {"prefill_ms": math.inf},
    {"prefill_ms": 1e300},
    {"prefill_ms": 1e-300},
    {"decode_ms": 0.0, "completion_tokens": 100},
    {"decode_ms": 1e300, "completion_tokens": 2},
    {"decode_ms": 1e-300, "completion_tokens": 10**9},
    {"queue_ms": -1.0, "worker_waiting_at_start": 3},
    {"queue_ms": math.nan, "worker_waiting_at_start": 3},
    {"queue_ms": 1e300, "worker_waiting_at_start": 1},
    {"queue_ms": 0.0, "worker_waiting_at_start": 10**9},
    {"transfer_ms": 0.0, "transfer_bytes": 10**12},
    {"transfer_ms": 1e-300, "transfer_bytes": 10**12},
    {"transfer_ms": 1e300, "transfer_bytes": 1},
    {"prompt_tokens": -10, "cached_tokens": -5, "prefill_ms": 10.0, "decode_ms": 10.0},
    {"prompt_tokens": 10, "cached_tokens": 10**9, "prefill_ms": 10.0},
    {"worker_running_at_start": -7, "prefill_ms": 10.0, "decode_ms": 10.0},
    {"worker_running_at_start": 10**6, "prefill_ms": 10.0, "action": "colocate"},
]


@pytest.mark.parametrize("garbage", GARBAGE, ids=[str(sorted(g.items())) for g in GARBAGE])
def test_estimates_stay_bounded_after_garbage(garbage: dict[str, object]) -> None:
    estimates = Estimates.from_presets(chunk_tokens=512)
    outcome = msgspec.structs.replace(_outcome(completion_tokens=64), **garbage)
    for _ in range(500):
        estimates.observe(outcome)
    for factor in estimates.factors().values():
        assert FACTOR_MIN <= factor <= FACTOR_MAX
    for value in (
        estimates.prefill_ms(1),
        estimates.prefill_ms(100_000, 100_000, "p1"),
        estimates.decode_step_ms(1, 0),
        estimates.decode_step_ms(256, 100_000, "d1"),
        estimates.queue_wait_ms(0),
        estimates.queue_wait_ms(1000),
        estimates.mean_context_tokens,
    ):
        assert math.isfinite(value)
        assert value >= 0.0
    rate = estimates.link_bps("p1", "d1")
    assert rate is None or 1e6 <= rate <= 1e13


def test_prior_is_the_roofline_of_the_preset() -> None:
    estimates = Estimates.from_presets("h200-sxm", "llama-3.1-8b")
    # The ARCHITECTURE worked example: 10k new tokens, compute-bound at 989e12 x 0.6 FLOP/s.
    flops = 2 * 8.03e9 * 10_000 + 4 * 32 * 32 * 128 * 10_000 * 5_000
    assert estimates.prefill_ms(10_000) == pytest.approx(1.5 + flops / 989e12 / 0.6 * 1000)
    # One decode step of one short stream is bound by reading the 16 GB of weights.
    nbytes = 2 * 8.03e9 + 131072 * 1 * (100 + 1)
    assert estimates.decode_step_ms(1, 100) == pytest.approx(1.5 + nbytes / 4.8e12 / 0.85 * 1000)
    # Tensor parallelism splits both roofs.
    tp2 = Estimates.from_presets("h200-sxm", "llama-3.1-8b", tp=2)
    assert tp2.prefill_ms(10_000) - 1.5 == pytest.approx((estimates.prefill_ms(10_000) - 1.5) / 2)


@pytest.mark.parametrize(
    ("chunk", "uncached", "chunks"),
    [(None, 100_000, 1), (512, 1, 1), (512, 512, 1), (512, 513, 2), (512, 16384, 32)],
)
def test_chunked_prefill_steps(chunk: int | None, uncached: int, chunks: int) -> None:
    estimates = Estimates.from_presets(chunk_tokens=chunk)
    assert estimates.prefill_chunks(uncached) == chunks
    unchunked = Estimates.from_presets().prefill_ms(uncached)
    # Every extra step pays the overhead and reads the weights again.
    assert (estimates.prefill_ms(uncached) > unchunked) == (chunks > 1)


@pytest.mark.parametrize(
    ("name", "peak", "bandwidth", "memory"),
    [
        ("h100-sxm", 989e12, 3.35e12, 80e9),
        ("h200-sxm", 989e12, 4.8e12, 141e9),
        ("a100-80g", 312e12, 2.0e12, 80e9),
    ],
)
def test_gpu_presets(name: str, peak: float, bandwidth: float, memory: float) -> None:
    gpu = gpu_prior(name)
    assert (gpu.peak_flops, gpu.mem_bandwidth, gpu.mem_bytes) == (peak, bandwidth, memory)


@pytest.mark.parametrize(
    ("name", "shape", "kv_bytes"),
    [
        ("llama-3.1-8b", (32, 4096, 32, 8, 128, 8.03e9), 131072),
        ("llama-3.1-70b", (80, 8192, 64, 8, 128, 70.6e9), 327680),
    ],
)
def test_model_presets(
    name: str, shape: tuple[int, int, int, int, int, float], kv_bytes: int
) -> None:
    m = model_prior(name)
    assert (m.layers, m.hidden_size, m.heads, m.kv_heads, m.head_dim, m.params) == shape
    assert m.kv_bytes_per_token == kv_bytes


def test_unknown_presets_list_the_known_ones() -> None:
    known_gpus = ", ".join(sorted(GPU_PRIORS))
    with pytest.raises(
        PolicyConfigError, match=re.escape(f"GPU preset 'b200'; known: {known_gpus}")
    ):
        Estimates.from_presets(gpu="b200")
    with pytest.raises(PolicyConfigError, match=re.escape("known: llama-3.1-70b, llama-3.1-8b")):
        Estimates.from_presets(model="llama-4")


@pytest.mark.parametrize(
    ("chunk", "rate", "message"),
    [
        (0, 0.1, "chunk_tokens must be >= 1 or None, got 0"),
        (None, 0.0, "rate must be in (0, 1], got 0.0"),
        (None, 1.5, "rate must be in (0, 1], got 1.5"),
    ],
)
def test_invalid_settings(chunk: int | None, rate: float, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Estimates.from_presets(chunk_tokens=chunk, rate=rate)


def _outcome(**changes: object) -> Outcome:
    base = Outcome(
        request_id="r",
        session_id="s",
        action="handoff",
        prefill_worker="p1",
        decode_worker="d1",
        prompt_tokens=4096,
        cached_tokens=1024,
        completion_tokens=64,
        ok=True,
    )
    return msgspec.structs.replace(base, **changes)


def _snapshot(estimates: Estimates) -> tuple[object, ...]:
    return (
        estimates.factors(),
        estimates.factors("p1"),
        estimates.queue_wait_ms(3),
        estimates.mean_context_tokens,
        estimates.link_bps("p1", "d1"),
        estimates.prefill_ms(1000, 0, "p1"),
        estimates.decode_step_ms(8, 1000, "d1"),
    )


def test_typical_prefill_is_the_predicted_prefill_of_the_turns_served() -> None:
    # A measured stage holds the queue wait as well: what a request ahead costs is the
    # prefill predicted for the turns this workload sends.
    estimates = Estimates.from_presets()
    assert estimates.typical_prefill_ms == pytest.approx(estimates.prefill_ms(2048))
    served = _outcome(action="colocate", prefill_worker="d1", decode_ms=630.0)
    for _ in range(100):
        estimates.observe(served)
    assert estimates.typical_prefill_ms == pytest.approx(
        estimates.prefill_ms(3072, 1024, "d1"), rel=0.01
    )
    assert estimates.queue_wait_ms(2) == pytest.approx(2 * estimates.typical_prefill_ms)


def test_mean_answer_length_and_shared_prefix_are_running_means() -> None:
    estimates = Estimates.from_presets(rate=0.1)
    assert estimates.mean_completion_tokens == 256.0
    assert estimates.shared_prefix_tokens == 0.0
    estimates.observe(_outcome(completion_tokens=64))
    assert estimates.mean_completion_tokens == pytest.approx((256 + 64) / 2)
    fresh = _outcome(action="colocate", cached_tokens=2048, decode_ms=100.0)
    estimates.observe_fresh(fresh)
    assert estimates.shared_prefix_tokens == pytest.approx(1024.0)
    # Failed turns and split ones (whose decode leg reports the pulled KV) teach nothing.
    estimates.observe_fresh(msgspec.structs.replace(fresh, ok=False))
    estimates.observe_fresh(msgspec.structs.replace(fresh, action="handoff"))
    assert estimates.shared_prefix_tokens == pytest.approx(1024.0)


def test_a_held_turn_teaches_its_prefill_without_the_hold() -> None:
    """A colocated turn's TTFT holds the router's hold (`Colocate.hold_s`): the prefill it
    teaches is the same as the same turn's unheld."""
    held, unheld, reference = (Estimates.from_presets() for _ in range(3))
    whole = _outcome(action="colocate", prefill_worker="m1", decode_worker="m1",
                     cached_tokens=0, queue_ms=0.0, decode_ms=None)  # fmt: skip
    for _ in range(20):
        unheld.observe(msgspec.structs.replace(whole, ttft_ms=400.0))
        held.observe(msgspec.structs.replace(whole, ttft_ms=1400.0, held_ms=1000.0))
    assert _snapshot(held) == _snapshot(unheld)
    assert _snapshot(held) != _snapshot(reference)


def test_the_mean_context_is_that_of_a_stream_found_decoding() -> None:
    # Short prompts with long answers and long prompts with short answers, turn for turn: a
    # batch holds the long answers most of the time, and a decode step reads their KV.
    estimates = Estimates.from_presets("h200-sxm")
    classes = ((256, 768), (6144, 48))
    for turn in range(600):
        prompt, completion = classes[turn % 2]
        estimates.observe(Outcome(
            request_id=f"r{turn}", session_id="s", action="colocate", prefill_worker="w",
            decode_worker="w", prompt_tokens=prompt, cached_tokens=0,
            completion_tokens=completion, ok=True, prefill_ms=50.0,
            decode_ms=10.0 * (completion - 1), worker_running_at_start=8,
        ))  # fmt: skip
    contexts = [(prompt + completion / 2, completion - 1) for prompt, completion in classes]
    found = sum(c * n for c, n in contexts) / sum(n for _, n in contexts)  # about 960
    assert estimates.mean_context_tokens == pytest.approx(found, rel=0.05)
