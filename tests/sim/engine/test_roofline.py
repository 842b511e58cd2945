from __future__ import annotations

import math

import pytest

from sim.engine.presets import deployment_from_names
from sim.engine.roofline import CostModel, Efficiency, attainable_flops

H200_8B = deployment_from_names("h200-sxm", "llama-3.1-8b")


@pytest.mark.parametrize(
    ("intensity", "expected"),
    [(8.0, 640e9), (12.5, 1000e9), (16.0, 1000e9), (1.0, 80e9)],
)
def test_attainable_flops_textbook_roofline(intensity: float, expected: float) -> None:
    assert attainable_flops(1000e9, 80e9, intensity) == pytest.approx(expected)


def _expected(
    model: CostModel, decode: list[int], chunks: list[tuple[int, int]], tp: int = 1
) -> float:
    dep = model.deployment
    m, g = dep.model, dep.gpu
    tokens = len(decode) + sum(n for n, _ in chunks)
    attn = 4 * m.layers * m.heads * m.head_dim
    flops = 2 * m.params * tokens + attn * (sum(decode) + sum(n * (c + n / 2) for n, c in chunks))
    kv = dep.kv_bytes_per_token
    nbytes = dep.weight_bytes + kv * (sum(decode) + sum(c for _, c in chunks)) + kv * tokens
    return 0.0015 + max(flops / (g.peak_flops * tp * 0.6), nbytes / (g.mem_bandwidth * tp * 0.85))


@pytest.mark.parametrize(
    ("decode", "chunks"),
    [
        ([100], []),
        ([1000] * 64, []),
        ([], [(10_000, 0)]),
        ([], [(512, 3584)]),
        ([2000, 3000], [(256, 1024), (1000, 0)]),
    ],
)
def test_step_time_is_the_roofline_formula(
    decode: list[int], chunks: list[tuple[int, int]]
) -> None:
    model = CostModel(H200_8B)
    assert model.step_time(decode, chunks) == pytest.approx(_expected(model, decode, chunks))


def test_empty_step_costs_nothing() -> None:
    assert CostModel(H200_8B).step_time([], []) == 0.0


def test_prefill_sanity_8b_on_h200() -> None:
    t = CostModel(H200_8B).predict_prefill_s(10_000)
    assert 0.25 <= t <= 0.32
    assert t == pytest.approx(_expected(CostModel(H200_8B), [], [(10_000, 0)]))


def test_decode_sanity_8b_on_h200() -> None:
    t = CostModel(H200_8B).predict_decode_step_s(1, 100)
    assert 0.004 <= t <= 0.006
    # bandwidth-bound: weights plus a little KV over 85% of 4.8 TB/s, plus the overhead
    assert t == pytest.approx(0.0015 + (16.06e9 + 131072 * 101) / (4.8e12 * 0.85))


def test_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    model = CostModel(H200_8B, step_overhead_s=0.0)
    prefill = model.predict_prefill_s(8192)
    flops = 2 * 8.03e9 * 8192 + 4 * 32 * 32 * 128 * 8192 * 4096
    assert prefill == pytest.approx(flops / (989e12 * 0.6))
    decode = model.predict_decode_step_s(8, 512)
    assert decode == pytest.approx((16.06e9 + 131072 * 8 * 513) / (4.8e12 * 0.85))


def test_cached_tokens_make_prefill_cheaper_but_not_free() -> None:
    model = CostModel(H200_8B)
    full = model.predict_prefill_s(8000)
    tail = model.predict_prefill_s(1000, cached_tokens=7000)
    assert tail < full / 4
    assert tail > model.predict_prefill_s(1000)  # attention over the cached context


def test_predictions_match_step_time() -> None:
    model = CostModel(H200_8B)
    assert model.predict_prefill_s(3000, 500) == pytest.approx(model.step_time([], [(3000, 500)]))
    assert model.predict_decode_step_s(4, 250) == pytest.approx(model.step_time([250] * 4, []))


def test_efficiency_scales_the_roof() -> None:
    slow = CostModel(H200_8B, Efficiency(compute=0.3, memory=0.85), step_overhead_s=0.0)
    fast = CostModel(H200_8B, Efficiency(compute=0.6, memory=0.85), step_overhead_s=0.0)
    assert slow.predict_prefill_s(8192) == pytest.approx(2 * fast.predict_prefill_s(8192))


def test_tensor_parallel_adds_all_reduce() -> None:
    dep = deployment_from_names("h100-sxm", "llama-3.1-70b", tp=4)
    model = CostModel(dep)
    tokens = 1000
    all_reduce = 2 * 80 * (5e-6 + 2 * 3 / 4 * tokens * 8192 * 2 / 450e9)
    expected = _expected(model, [], [(tokens, 0)], tp=4) + all_reduce
    assert model.predict_prefill_s(tokens) == pytest.approx(expected)


def test_noise_is_seeded_lognormal() -> None:
    quiet = CostModel(H200_8B)
    a = CostModel(H200_8B, noise_sigma=0.1, seed=7)
    b = CostModel(H200_8B, noise_sigma=0.1, seed=7)
    base = quiet.step_time([500] * 8, [])
    draws_a = [a.step_time([500] * 8, []) for _ in range(2000)]
    draws_b = [b.step_time([500] * 8, []) for _ in range(2000)]
    assert draws_a == draws_b
    logs = [math.log(d / base) for d in draws_a]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    assert abs(mean) < 0.01
    assert sd == pytest.approx(0.1, rel=0.1)
    assert a.predict_prefill_s(100) == quiet.predict_prefill_s(100)  # predictions are noise-free


@pytest.mark.parametrize("sigma", [0.0, 0.1])
def test_totals_price_a_step_as_its_contexts_do(sigma: float) -> None:
    by_contexts = CostModel(H200_8B, noise_sigma=sigma, seed=3)
    by_totals = CostModel(H200_8B, noise_sigma=sigma, seed=3)
    decode, chunks = [700, 1200, 90], [(512, 3584), (40, 0)]
    pairs = sum(n * (c + n * 0.5) for n, c in chunks)
    for _ in range(5):  # the same noise draws, in the same order
        assert by_contexts.step_time(decode, chunks) == by_totals.sample_step_time(
            len(decode), sum(decode), 552, 3584, pairs
        )


def test_negative_noise_rejected() -> None:
    with pytest.raises(ValueError):
        CostModel(H200_8B, noise_sigma=-0.1)
