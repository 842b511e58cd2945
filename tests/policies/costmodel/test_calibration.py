from __future__ import annotations

import random
import statistics

import pytest

from policies.costmodel.calibration import FACTOR_MIN, Correction
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
