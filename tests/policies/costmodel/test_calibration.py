from __future__ import annotations

import math
import random
import statistics

import pytest

from policies.costmodel.calibration import BASE_MAX_MS, FACTOR_MAX, FACTOR_MIN, Correction
from policies.costmodel.estimates import Estimates

PRIOR = Estimates.from_presets("cpu", "tiny-llama").prior
BASE_MS = 20.0


def engine_sample(rng: random.Random, attention: float) -> tuple[tuple[float, ...], float, bool]:
    """(terms, ms, with_base) of one stage of an engine whose steps cost 2.5 x the roofline's
    overhead, 1.2 x its weights' products, `attention` x its attention and 5 x its memory
    roof, each whole turn waiting `BASE_MS` besides: half whole turns, half decode steps."""
    if rng.random() < 0.5:
        new = rng.choice((128, 384, 1024)) * rng.randint(1, 3)
        terms = PRIOR.prefill_terms(new, rng.choice((0, rng.randint(0, 2048))))
        compute = 1.2 * (terms[1] + terms[4]) + attention * (terms[2] + terms[5])
        return terms, BASE_MS + 2.5 * terms[0] + compute, True
    terms = PRIOR.decode_terms(rng.randint(1, 8), rng.uniform(300.0, 3000.0))
    compute = 1.2 * (terms[1] + terms[4]) + attention * (terms[2] + terms[5])
    return terms, 2.5 * terms[0] + max(compute, 5.0 * (terms[3] + terms[6])), False


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("attention", [0.0, 5.0])
def test_the_fit_stays_bounded_when_a_factor_sits_at_its_bound(seed: int, attention: float) -> None:
    """An engine whose attention costs nothing (a factor below `FACTOR_MIN`) or 5x the
    roofline's, seen through noisy samples. Clipped after each step, the factor at its bound
    kept none of its share while the base, correlated with it, kept stepping against it: the
    base climbed to the minute its bound allows, every turn predicted a minute late, and the
    policy rejected a fleet that was idle."""
    correction = Correction(base_spread_ms=BASE_MS)
    rng = random.Random(seed)
    errors, highest_base = [], 0.0
    for k in range(3000):
        terms, truth, with_base = engine_sample(rng, attention)
        predicted = correction.predict(terms) + (correction.base if with_base else 0.0)
        if k >= 2500:
            errors.append(abs(predicted / truth - 1.0))
        correction.update(terms, truth * rng.lognormvariate(0.0, 0.3), with_base, 50.0)
        highest_base = max(highest_base, correction.base)
        assert correction.attention >= FACTOR_MIN
    assert highest_base < 2.0 * BASE_MS
    assert statistics.median(errors) < 0.1


def reference_update(
    theta: list[float], cov: list[list[float]], prior: list[float], terms: tuple[float, ...],
    observed: float, with_base: bool, memory_s: float,
) -> tuple[list[float], list[list[float]]] | None:  # fmt: skip
    """`Correction.update` on plain matrices: a step of recursive least squares with
    forgetting on the error relative to sqrt(observed x predicted), numbers that would step
    past their bounds pinned there and the step taken again, the covariance decoupled from
    the pinned numbers and wound down to the prior (None: the sample teaches nothing)."""
    lower = (0.0, FACTOR_MIN, FACTOR_MIN, FACTOR_MIN, FACTOR_MIN)
    upper = (BASE_MAX_MS, FACTOR_MAX, FACTOR_MAX, FACTOR_MAX, FACTOR_MAX)
    n = len(theta)
    x = [1.0 if with_base else 0.0, terms[0], 0.0, 0.0, 0.0]
    for linear, attention, memory in (terms[1:4], terms[4:7]):
        if linear * theta[2] + attention * theta[3] >= memory * theta[4]:
            x[2] += linear
            x[3] += attention
        else:
            x[4] += memory
    predicted = sum(theta[i] * x[i] for i in range(n))
    if not observed > 0.0 or not predicted > 0.0:
        return None
    scale = math.sqrt(observed * predicted)
    z = [value / scale for value in x]
    forget = 1.0 - 1.0 / memory_s
    theta, cov = list(theta), [list(row) for row in cov]
    free = [True] * n
    gains = pz = [0.0] * n
    for _ in range(n):
        zf = [z[i] if free[i] else 0.0 for i in range(n)]
        pz = [sum(cov[i][j] * zf[j] for j in range(n)) if free[i] else 0.0 for i in range(n)]
        denominator = forget + sum(zf[i] * pz[i] for i in range(n))
        if not denominator > 0.0:
            return None
        error = observed / scale - sum(theta[i] * z[i] for i in range(n))
        gains = [pz[i] / denominator for i in range(n)]
        stepped = [theta[i] + gains[i] * error for i in range(n)]
        out = [i for i in range(n) if free[i] and not lower[i] <= stepped[i] <= upper[i]]
        if not out:
            theta = stepped
            break
        for i in out:
            theta[i] = lower[i] if stepped[i] < lower[i] else upper[i]
            free[i] = False
    for i in range(n):
        for j in range(i, n):
            if free[i] and free[j]:
                cov[i][j] = cov[j][i] = (cov[i][j] - gains[i] * pz[j]) / forget
    for i in range(n):
        for j in range(n):
            if free[i] != free[j]:
                cov[i][j] = 0.0
    for i in range(n):
        if cov[i][i] > prior[i]:
            shrink = math.sqrt(prior[i] / cov[i][i])
            for j in range(n):
                cov[i][j] *= shrink
                cov[j][i] *= shrink
    return theta, cov


@pytest.mark.parametrize("seed", range(4))
def test_the_fit_is_recursive_least_squares_to_the_last_bit(seed: int) -> None:
    """The fit's unrolled arithmetic (five numbers, a symmetric covariance kept as its upper
    triangle) gives exactly what the same algorithm on plain matrices gives, over samples
    that pin numbers at both bounds, teach nothing, wind the covariance up and copy the fit."""
    rng = random.Random(seed)
    correction = Correction(base_spread_ms=rng.choice((1.0, BASE_MS)))
    prior = [row[i] for i, row in enumerate(correction.covariance())]
    pinned = set()
    for _ in range(2000):
        terms = tuple(rng.choice((0.0, rng.uniform(0.0, 5.0), rng.expovariate(0.01)))
                      for _ in range(7))  # fmt: skip
        observed = rng.choice((rng.uniform(0.01, 1000.0), rng.expovariate(0.001), 1e-4, -1.0))
        with_base, memory_s = rng.random() < 0.5, rng.choice((5.0, 200.0))
        theta = [correction.base, correction.overhead, correction.linear,
                 correction.attention, correction.memory]  # fmt: skip
        before = correction.covariance()
        stepped = reference_update(theta, before, prior, terms, observed, with_base, memory_s)
        expected = stepped if stepped is not None else (theta, before)
        correction.update(terms, observed, with_base, memory_s)
        got = [correction.base, correction.overhead, correction.linear, correction.attention,
               correction.memory]  # fmt: skip
        assert got == expected[0]
        assert correction.covariance() == expected[1]
        pinned.update(i for i, v in enumerate(got) if v in (FACTOR_MIN, FACTOR_MAX, BASE_MAX_MS))
        if rng.random() < 0.05:
            correction = correction.copy()
    assert pinned  # the samples did pin numbers at their bounds
