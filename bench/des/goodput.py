"""The search for a policy's max goodput rate over the trace's rate scale.

Exponential bracketing, then bisection: probe `start`; while it passes (attainment >= target)
double the scale until a probe fails, or while it fails halve it until one passes; then bisect
the bracket [highest passing, lowest failing] geometrically (probe sqrt(lo x hi)) until
hi / lo <= 1 + tolerance. The answer is the highest passing scale probed, with the failing
scale just above it. Attainment is assumed to fall as the rate rises; where it does not, the
search still returns a probed passing scale with a probed failing one above it.

The search is a generator so one driver can run many searches' probes in parallel: it yields a
scale to probe, is sent that probe's attainment, and returns a `GoodputSearch`.
"""

from __future__ import annotations

import math
from collections.abc import Generator

import msgspec


class Probe(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rate_scale: float
    attainment: float


class GoodputSearch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`best_scale`: the highest passing scale probed (None: none passed down to the floor);
    `failing_scale`: the lowest failing scale above it (None: none failed up to the ceiling)."""

    best_scale: float | None
    failing_scale: float | None
    probes: list[Probe]


Search = Generator[float, float, GoodputSearch]


def goodput_search(
    target: float = 0.9,
    start: float = 1.0,
    tolerance: float = 0.05,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
) -> Search:
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    if not (tolerance > 0 and 0 < min_scale <= start <= max_scale):
        raise ValueError("need tolerance > 0 and 0 < min_scale <= start <= max_scale")
    probes: list[Probe] = []

    def probe(scale: float, attainment: float) -> bool:
        probes.append(Probe(scale, attainment))
        return attainment >= target

    scale = start
    passed = probe(scale, (yield scale))
    low: float | None = scale if passed else None
    high: float | None = None if passed else scale
    factor = 2.0 if passed else 0.5
    while low is None or high is None:
        scale *= factor
        if not min_scale <= scale <= max_scale:
            return GoodputSearch(low, high, probes)
        if probe(scale, (yield scale)):
            low = scale
        else:
            high = scale
    while high / low > 1 + tolerance:
        scale = math.sqrt(low * high)
        if probe(scale, (yield scale)):
            low = scale
        else:
            high = scale
    return GoodputSearch(low, high, probes)
